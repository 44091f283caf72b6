"""checkpoint: synchronous against asynchronous saves (checkpoint.async) of a ~100M-parameter model,
interleaved: training blocked per save, the background write time, step times around saves."""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.common import TINY, TRAIN, cache_dir, env_for, interleave, launch, overrides, run_sets

# CPU: a GPT-2 shape of about 100M parameters (8 layers x 1024), one sequence per rank, so that a
# synchronous save at ZeRO-2 on 2 ranks writes about 1 GB on rank 0 (2-3 s here).
CKPT_SETS = {
    "model.config.n_layer": 8,
    "model.config.n_embd": 1024,
    "model.config.n_head": 16,
    "train.micro_batch_size": 1,
}


def save_run(a: argparse.Namespace, mode: str, r: int, work: Path, cache: Path) -> dict[str, Any]:
    """One run with `mode` saves ("sync" or "async"): each save's blocked and write times, and the
    step times after the first save with a write in flight and with none."""
    run_dir = work / f"{mode}-{r}"
    sets = {
        **run_sets(a.steps, 1, run_dir, cache),
        **CKPT_SETS,
        "strategy.zero_stage": a.stage,
        "checkpoint.every_steps": a.every,
        "checkpoint.keep_last": 2,
        "checkpoint.async": mode == "async",
    }
    launch([str(TRAIN), str(TINY), *overrides(sets)], a.nproc, env_for(a.nproc))
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    saves = [x for x in recs if "checkpoint" in x]
    steps = {x["step"]: x["step_time_s"] for x in recs if "step_time_s" in x}
    in_flight = {s for x in saves if x["async"] for s in range(x["saved_step"] + 1, x["step"] + 1)}
    steady = [s for s in steps if s > a.every]  # after the first save (warm-up, first copy)
    res = {
        "blocked_s": [x["blocked_s"] for x in saves],
        "write_s": [x["write_s"] for x in saves],
        "step_s_writing": [steps[s] for s in steady if s in in_flight],
        "step_s_idle": [steps[s] for s in steady if s not in in_flight],
    }
    shutil.rmtree(run_dir, ignore_errors=True)
    print(f"round {r + 1} {mode}: blocked per save {res['blocked_s']}", flush=True)
    return res


def checkpoint(a: argparse.Namespace) -> dict[str, Any]:
    """Synchronous against asynchronous saves (checkpoint.async), interleaved: training blocked per
    save, the background write time, and the step time while a write is in flight against the
    step time with none."""
    work = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    cache = cache_dir(a)
    results = interleave(("sync", "async"), a.rounds, lambda mode, r: save_run(a, mode, r, work, cache))
    shutil.rmtree(work, ignore_errors=True)

    def med(mode: str, key: str, skip_first: bool = False) -> float:
        vals = [v for run in results[mode] for v in (run[key][1:] if skip_first else run[key])]
        return statistics.median(vals) if vals else float("nan")

    sync_b, async_b = med("sync", "blocked_s"), med("async", "blocked_s", skip_first=True)
    print(
        f"\n# checkpoint: ZeRO-{a.stage}, {a.nproc} ranks, a save every {a.every} steps, {a.rounds} rounds:\n"
        f"  synchronous:  blocked {sync_b:.2f} s per save (median), steps {med('sync', 'step_s_idle') * 1000:.0f} ms\n"
        f"  asynchronous: blocked {async_b:.2f} s per save (median after the first, which allocates the "
        f"host copy: {med('async', 'blocked_s'):.2f} s over all), written in {med('async', 'write_s'):.1f} s; "
        f"steps {med('async', 'step_s_idle') * 1000:.0f} ms, {med('async', 'step_s_writing') * 1000:.0f} ms "
        f"while a write is in flight\n"
        f"  stall async/sync: {async_b / sync_b:.3f}"
    )
    return {"checkpoint": results, "stall_ratio": async_b / sync_b}
