#!/usr/bin/env python3
"""One process: forward + backward of a peer-benchmark shape with sdpa and with eager attention,
alternating, two rounds; median of 7 steps after 3; 1024 tokens a step (micro = 1024 / seq). What
`model.attn_implementation: auto` was decided from (BENCHMARKS.md):

    bench/attention_step.py gpt2 128 1 bf16     # SHAPE (tiny, gpt2, llama) SEQ THREADS PRECISION
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.peer import step_config  # noqa: E402  (bench/peer.py, beside this script)


def main() -> None:
    from transformers import AutoModelForCausalLM

    shape, seq, threads, precision = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(threads)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    micro = max(1, 1024 // seq)
    times: dict[str, list[float]] = {}
    for _ in range(2):
        for attn in ("sdpa", "eager"):
            torch.manual_seed(0)
            cfg = step_config(shape)
            cfg.max_position_embeddings = max(seq, 256)
            if hasattr(cfg, "n_positions"):
                cfg.n_positions = max(seq, 256)
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=dtype).train()
            x = torch.randint(0, cfg.vocab_size, (micro, seq))
            steps = []
            for _ in range(10):
                t = time.perf_counter()
                model(input_ids=x, labels=x, use_cache=False).loss.backward()
                steps.append(time.perf_counter() - t)
            times.setdefault(attn, []).append(sorted(steps[3:])[3])
    ms = {k: " ".join(f"{v * 1000:.0f}" for v in vs) for k, vs in times.items()}
    ratio = min(times["eager"]) / min(times["sdpa"])
    print(f"{shape} seq {seq} micro {micro} threads {threads} {precision}: sdpa {ms['sdpa']} ms, "
          f"eager {ms['eager']} ms; eager/sdpa time {ratio:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
