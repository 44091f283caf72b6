"""The benchmarks of BENCHMARKS.md, one module each (compare, peer, startup, threads, datawait,
checkpoint, scaling) over bench/common.py; bench/bench.py runs them. The other scripts here (raw_loop.py,
hf_peer.py, bare_start.py, the *_step.py and step_memory.py) run as processes of their own."""
