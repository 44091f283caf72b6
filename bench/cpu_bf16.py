#!/usr/bin/env python3
"""A bf16 step against an fp32 one on CPU, for a large-vocabulary tiny model (issue 46): bin/train on
a 2-layer Qwen3 shape (hidden 32) with Qwen3's published tokenizer (151,669 tokens) and chat
template, micro 4 x 256 chat tokens, one process, one thread. Each side is a whole bin/train run;
the step time is the median of the logged steps after the first (metrics.jsonl), the loss the last.

    bench/cpu_bf16.py [--root REPO] [--steps 6] [--rounds 2] [--precisions bf16 fp32] [--set KEY=VALUE]

`--root` runs another checkout's bin/train on the same data (the code before a change), with this
one's tokenizers. Run it under `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` to see an
AVX2-only host (make test-avx2's setting). Needs `make tokenizers`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))


def job(
    root: Path, tmp: Path, precision: str, steps: int, data: Path, more: list[str]
) -> tuple[float, float]:
    model = {"model_type": "qwen3", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 512,
             "tie_word_embeddings": True}  # fmt: skip
    sets = {"model.config": json.dumps(model), "data.tokenizer": str(ROOT / ".cache" / "tokenizers" / "qwen3"),
            "data.train.files": str(data), "data.train.kind": "chat", "data.seq_len": 256,
            "data.eval_fraction": 0, "data.num_workers": 0, "train.micro_batch_size": 4,
            "train.precision": precision, "train.max_steps": steps, "train.log_every": 1, "train.eval_every": 0,
            "train.eval_prompts": "[]", "optim.warmup_steps": 0, "checkpoint.every_steps": 0,
            "checkpoint.save_final": "false", "run_dir": str(tmp / f"run-{precision}"),
            "data.cache_dir": str(tmp / "cache"), "strategy.justification": "benchmark"}  # fmt: skip
    args = [sys.executable, str(root / "bin" / "train"), str(root / "configs" / "experiments" / "tiny.yaml")]
    for k, v in sets.items():
        args += ["--set", f"{k}={v}"]
    for kv in more:
        args += ["--set", kv]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(p.stdout[-3000:] + p.stderr[-3000:])
    rows = [json.loads(x) for x in (tmp / f"run-{precision}" / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in rows if "step_time_s" in r and r.get("step", 0) > 1]
    subprocess.run(["rm", "-rf", str(tmp / f"run-{precision}")])
    return statistics.median(r["step_time_s"] for r in steps_), steps_[-1]["loss"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=ROOT)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--precisions", nargs="+", default=["bf16", "fp32"])
    ap.add_argument("--set", action="append", default=[], help="an override for every run (KEY=VALUE)")
    a = ap.parse_args()
    import torch
    from make_chat_samples import conversations, write

    print(f"ATen CPU capability {torch.backends.cpu.get_cpu_capability()}; {a.root}")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        data = write(tmp / "chat.jsonl", conversations(120, True, False, 0, True))
        got: dict[str, list[float]] = {p: [] for p in a.precisions}
        for r in range(a.rounds):
            for p in a.precisions:
                t, loss = job(a.root.resolve(), tmp, p, a.steps, data, a.set)
                got[p].append(t)
                print(f"round {r}: {p} {t * 1000:.0f} ms a step, last loss {loss:.6f}", flush=True)
        med = {p: statistics.median(v) for p, v in got.items()}
        print(
            json.dumps({"step_s": med, **({"bf16/fp32": med["bf16"] / med["fp32"]} if len(med) == 2 else {})})
        )


if __name__ == "__main__":
    main()
