"""datawait: the share of step time spent waiting for data on tiny, per data.num_workers setting."""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.common import TINY, TRAIN, cache_dir, env_for, interleave, launch, overrides


def datawait(a: argparse.Namespace) -> dict[str, Any]:
    """tiny with each data.num_workers setting, interleaved per round, on --nproc ranks: the data-wait
    share of step time, the median step time, and whether PyTorch warned about too many workers."""
    work = Path(tempfile.mkdtemp(prefix="bench-data-"))
    cache = cache_dir(a)

    def run(w: str, r: int) -> dict[str, Any]:
        sets = {
            "run_dir": str(work / "run"),
            "data.cache_dir": str(cache),
            "data.num_workers": w,
            "train.max_steps": a.steps,
            "train.eval_every": 0,
            "train.log_every": 5,
            "checkpoint.save_final": False,
            "checkpoint.every_steps": 0,
        }
        shutil.rmtree(work / "run", ignore_errors=True)
        p = launch([str(TRAIN), str(TINY), *overrides(sets)], a.nproc, env_for(a.nproc))
        lines = [
            json.loads(x) for x in (work / "run" / "metrics.jsonl").read_text().splitlines() if '"loss"' in x
        ]
        steady = [m for m in lines if m["step"] > 10]
        return {
            "wait": statistics.mean(m["data_wait_share"] for m in steady),
            "step_ms": 1000 * statistics.median(m["step_time_s"] for m in steady),
            "warned": "worker processes in total" in p.stdout + p.stderr,
        }

    runs = interleave(a.settings, a.rounds, run)
    out = {w: {k: [x[k] for x in runs[w]] for k in ("wait", "step_ms", "warned")} for w in runs}
    shutil.rmtree(work, ignore_errors=True)
    print(
        f"# data wait on tiny, {a.nproc} rank(s), {a.steps} steps, {a.rounds} rounds interleaved (after step 10)"
    )
    print("| data.num_workers | data wait (mean share of step) | median step ms | DataLoader warning |")
    print("|---|---|---|---|")
    for w, r in out.items():
        print(f"| {w} | {statistics.mean(r['wait']):.2%} | {statistics.median(r['step_ms']):.1f} | "
              f"{'yes' if any(r['warned']) else 'no'} |")  # fmt: skip
    return {"datawait": out, "nproc": a.nproc}
