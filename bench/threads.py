"""threads: 2 ranks on this machine with the automatic threads per rank against torch's default."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.common import (
    TINY,
    TRAIN,
    cache_dir,
    cores,
    env_for,
    interleave,
    launch,
    median_after,
    overrides,
    run_sets,
)


def threads(a: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-threads-"))
    cache = cache_dir(a)
    sets = run_sets(a.steps, 10, work / "run", cache)

    def run(name: str, r: int) -> float:
        shutil.rmtree(work / "run", ignore_errors=True)
        env = env_for(2)
        env.pop("OMP_NUM_THREADS")
        if name == "torch default":  # what torch does on its own: every core, in every rank
            env["OMP_NUM_THREADS"] = str(cores())
        p = launch([str(TRAIN), str(TINY), *overrides(sets)], 2, env)
        lines = [json.loads(x) for x in (work / "run" / "metrics.jsonl").read_text().splitlines()]
        med = median_after([m for m in lines if "loss" in m], 10, 10)
        threads_line = re.search(r"(\d+) CPU thread\(s\) per rank", p.stdout)
        print(
            f"  {name:13}: {threads_line.group(1) if threads_line else '?'} thread(s)/rank, "
            f"median step {med * 1000:.0f} ms",
            flush=True,
        )
        return med

    results = interleave(("auto", "torch default"), a.rounds, run)
    shutil.rmtree(work, ignore_errors=True)
    auto, default = (statistics.median(results[k]) for k in results)
    print(
        f"\n# threads: tiny on 2 ranks, {cores()} cores: auto {auto * 1000:.0f} ms/step, torch default "
        f"{default * 1000:.0f} ms/step: {default / auto:.2f}x faster with the automatic setting"
    )
    return {"threads": results}
