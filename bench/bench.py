#!/usr/bin/env python3
"""Benchmarks of the wrapper's cost, as ratios measured side by side in one run (see BENCHMARKS.md).

    bench/bench.py compare  [--stages 0 2 3] [--rounds 2] [--steps 40] [--warmup 10] [--nproc 2]
    bench/bench.py peer     [--stages 0 2 3] [--shapes tiny gpt2-4x256 llama-gqa] [--rounds 3] [--peer-config minimal]
    bench/bench.py startup  [--rounds 3]
    bench/bench.py threads  [--rounds 2]
    bench/bench.py datawait [--nproc 1] [--settings 1 auto] [--rounds 2]
    bench/bench.py checkpoint [--rounds 2] [--steps 21] [--every 4] [--stage 2]
    bench/bench.py scaling  [--stages 0 2 3] [--ranks 1 2] [--steps 60] [--out runs/scaling]
    bench/bench.py sequence [--seq-len 4096] [--nproc 2] [--rounds 3] [--precision bf16]
    bench/bench.py preference [--experiment E] [--micro 16] [--nproc 1] [--rounds 3] [--set K=V]

compare: the same model, data, seed and DeepSpeed JSON (a) through bin/train and (b) through a
minimal hand-written DeepSpeed loop (bench/raw_loop.py), interleaved A B A B under the deepspeed
launcher; median step time over the log intervals after warm-up, tokens/s, the ratio ours/raw (and
its min and max over rounds) and whether the final weights are bitwise equal. On a CUDA machine it
measures the GPT-2 124M experiment (configs/experiments/gpt2-124m.yaml) in bf16 and adds MFU.
startup: seconds from starting bin/train to its first completed step, against bench/bare_start.py
(import deepspeed, build the same model, deepspeed.initialize, one step); and `--help`, `--plan`.
threads: 2 ranks on this machine with the automatic threads per rank against torch's default.
datawait: the share of step time spent waiting for data on tiny, per data.num_workers setting.
scaling: runs of one experiment at each world size in --ranks, per stage: the batch per rank kept
(weak scaling) and the global batch of the most ranks kept through gradient accumulation (strong
scaling); then `bin/report` on all of them (efficiencies, loss curves overlaid). On CPU every rank
gets one thread, so that a rank is one core as a GPU is one device.
checkpoint: synchronous against asynchronous saves (checkpoint.async) of a ~100M-parameter model,
interleaved: training blocked per save, the background write time, step times around saves.
sequence: sequence parallel N against 1 on the same N ranks and global batch (a Llama shape): the
step-time ratio, what Ulysses costs where it is not needed, and each side's activations per rank.
preference: a DPO step against an SFT step on the same pairs (SFT on prompt and chosen response),
interleaved: the step-time ratio beside the ratio of tokens a step feeds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# Run as a script, sys.path[0] is bench/: the repository root in its place, so that `bench` is this
# package (not this file) and `trainer` imports, and the benchmark modules are not top-level names.
if sys.path and Path(sys.path[0] or ".").resolve() == HERE:
    del sys.path[0]
sys.path.insert(0, str(ROOT))

from bench.checkpoint import checkpoint  # noqa: E402
from bench.compare import compare  # noqa: E402
from bench.datawait import datawait  # noqa: E402
from bench.peer import PEER_SHAPES, peer  # noqa: E402
from bench.preference import PAIRS, preference  # noqa: E402
from bench.scaling import scaling  # noqa: E402
from bench.sequence import sequence  # noqa: E402
from bench.startup import startup  # noqa: E402
from bench.threads import threads  # noqa: E402

BENCHMARKS = {
    "compare": compare,
    "peer": peer,
    "startup": startup,
    "threads": threads,
    "datawait": datawait,
    "checkpoint": checkpoint,
    "scaling": scaling,
    "sequence": sequence,
    "preference": preference,
}


def add_compare_peer(sub: argparse._SubParsersAction) -> list[argparse.ArgumentParser]:
    c = sub.add_parser("compare", help="bin/train against a hand-written DeepSpeed loop")
    c.add_argument("--stages", type=int, nargs="+", default=[0, 2, 3])
    c.add_argument("--rounds", type=int, default=2)
    c.add_argument("--steps", type=int, default=40)
    c.add_argument("--warmup", type=int, default=10)
    c.add_argument("--log-every", type=int, default=5)
    c.add_argument("--nproc", type=int, default=None, help="ranks (default: every GPU, or 2 on CPU)")
    c.add_argument("--cpu", action="store_true", help="the CPU mode even where CUDA is present")
    c.add_argument("--experiment", default=None, help="default: gpt2-124m.yaml on GPU, tiny (micro 8) on CPU")
    c.add_argument(
        "--set", action="append", help="an override for both sides, e.g. train.micro_batch_size=32"
    )
    pe = sub.add_parser("peer", help="bin/train against the Hugging Face Trainer with DeepSpeed")
    pe.add_argument("--stages", type=int, nargs="+", default=[0, 2, 3])
    pe.add_argument("--shapes", nargs="+", default=None, help=f"CPU: some of {', '.join(PEER_SHAPES)}")
    pe.add_argument("--rounds", type=int, default=3)
    pe.add_argument("--steps", type=int, default=60)
    pe.add_argument("--warmup", type=int, default=20)
    pe.add_argument("--log-every", type=int, default=5)
    pe.add_argument("--nproc", type=int, default=None)
    pe.add_argument("--cpu", action="store_true")
    pe.add_argument("--experiment", default=None)
    pe.add_argument("--peer-config", choices=["minimal", "hf-docs"], default="minimal")
    pe.add_argument(
        "--hf-variants", nargs="+", default=None,
        help="the Trainer's own options, one run per variant and round: 'default' or KEY=VALUE[,KEY=VALUE] "
        "TrainingArguments (attn_implementation goes to the model's from_config), e.g. default "
        "torch_compile=true use_liger_kernel=true attn_implementation=eager",
    )  # fmt: skip
    pe.add_argument("--set", action="append")
    return [c, pe]


def add_others(sub: argparse._SubParsersAction) -> list[argparse.ArgumentParser]:
    s = sub.add_parser("startup", help="bin/train to its first step, against a bare DeepSpeed script")
    s.add_argument("--rounds", type=int, default=3)
    t = sub.add_parser("threads", help="automatic CPU threads per rank against torch's default")
    t.add_argument("--rounds", type=int, default=2)
    t.add_argument("--steps", type=int, default=40)
    d = sub.add_parser("datawait", help="data-wait share on tiny per data.num_workers setting")
    d.add_argument("--steps", type=int, default=60)
    d.add_argument("--rounds", type=int, default=2)
    d.add_argument("--nproc", type=int, default=1)
    d.add_argument("--settings", nargs="+", default=["1", "auto"], help="data.num_workers values")
    k = sub.add_parser("checkpoint", help="synchronous against asynchronous checkpoint saves")
    k.add_argument("--rounds", type=int, default=2)
    k.add_argument("--steps", type=int, default=21)
    k.add_argument("--every", type=int, default=4)
    k.add_argument("--stage", type=int, default=2)
    k.add_argument("--nproc", type=int, default=2)
    sc = sub.add_parser("scaling", help="runs at 1 and N ranks, then bin/report's scaling efficiency")
    sc.add_argument("--stages", type=int, nargs="+", default=[0, 2, 3])
    sc.add_argument(
        "--ranks", type=int, nargs="+", default=None, help="world sizes (default: 1 and every GPU, or 1 2)"
    )
    sc.add_argument("--steps", type=int, default=60)
    sc.add_argument("--log-every", type=int, default=5)
    sc.add_argument("--cpu", action="store_true")
    sc.add_argument("--experiment", default=None)
    sc.add_argument("--set", action="append")
    sc.add_argument("--out", default=str(ROOT / "runs" / "scaling"), help="where the runs are kept")
    q = sub.add_parser("sequence", help="sequence parallel N against 1: the step-time ratio")
    q.add_argument("--seq-len", type=int, default=4096)
    q.add_argument("--nproc", type=int, default=2)
    q.add_argument("--rounds", type=int, default=3)
    q.add_argument("--steps", type=int, default=25)
    q.add_argument("--warmup", type=int, default=5)
    q.add_argument("--log-every", type=int, default=5)
    q.add_argument("--precision", default="bf16")
    pr = sub.add_parser("preference", help="a DPO step against an SFT step on the same pairs")
    pr.add_argument("--experiment", default=None, help="the model and precision (default: tiny)")
    pr.add_argument("--pairs", default=str(PAIRS), help="preference data (prompt, chosen, rejected)")
    pr.add_argument("--micro", type=int, default=16, help="pairs (DPO) and conversations (SFT) a micro batch")
    pr.add_argument("--nproc", type=int, default=1)
    pr.add_argument("--cpu", action="store_true", help="on CPU even where CUDA is present")
    pr.add_argument("--rounds", type=int, default=3)
    pr.add_argument("--steps", type=int, default=30)
    pr.add_argument("--warmup", type=int, default=10)
    pr.add_argument("--log-every", type=int, default=5)
    pr.add_argument("--set", action="append", help="an override for both sides")
    return [s, t, d, k, sc, q, pr]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    for q in add_compare_peer(sub) + add_others(sub):
        q.add_argument("--cache-dir", default=None, help="tokenized-data cache (default .cache/bench-data)")
        q.add_argument("--json", default=None, help="also write the results here")
    return p


def main() -> int:
    a = parser().parse_args()
    if getattr(a, "cpu", False):  # both sides on CPU on a GPU machine too (torch, DeepSpeed, bin/train)
        from trainer.cluster.devices import ENV_CPU, hide_gpus_if_asked

        os.environ[ENV_CPU] = "1"  # for the ranks too, whose CUDA_VISIBLE_DEVICES the launcher resets
        hide_gpus_if_asked()
    res = BENCHMARKS[a.what](a)
    if a.json:
        Path(a.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), **res}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
