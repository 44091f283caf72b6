"""startup: seconds from starting bin/train to its first completed step, against bench/bare_start.py
(import deepspeed, build the same model, deepspeed.initialize, one step); and `--help`, `--plan`."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, TINY, TRAIN, cache_dir, env_for, overrides, run_sets, spec_for


def time_to_line(cmd: list[str], pattern: str, env: dict[str, str]) -> float:
    """Seconds from starting `cmd` to the first output line matching `pattern` (then it is waited for)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    found = None
    tail = []
    for line in p.stdout:
        tail = (tail + [line])[-30:]
        if found is None and re.search(pattern, line):
            found = time.perf_counter() - t0
    p.wait()
    if p.returncode != 0 or found is None:
        raise SystemExit(
            f"{' '.join(cmd)}: exit {p.returncode}, '{pattern}' seen: {found is not None}\n{''.join(tail)}"
        )
    return found


def startup(a: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-start-"))
    cache = cache_dir(a)
    sets = {**run_sets(1, 1, work / "run", cache), "train.max_steps": 1, "dist.preflight": True}
    spec = spec_for(TINY, sets, 1)
    spec_file = work / "spec.json"
    spec_file.write_text(json.dumps(spec))
    env = env_for(1)
    ours_cmd = [sys.executable, str(TRAIN), str(TINY), *overrides(sets)]
    bare_cmd = [sys.executable, str(ROOT / "bench" / "bare_start.py"), "--spec", str(spec_file)]
    rows: dict[str, list[float]] = {"ours": [], "bare": [], "help": [], "plan": []}
    time_to_line(ours_cmd, r"step +1/1", env)  # warm: data cache, model-shape cache, JIT ops
    time_to_line(bare_cmd, r"first step done", env)
    for _ in range(a.rounds):
        shutil.rmtree(work / "run", ignore_errors=True)
        rows["ours"].append(time_to_line(ours_cmd, r"step +1/1", env))
        rows["bare"].append(time_to_line(bare_cmd, r"first step done", env))
        rows["help"].append(time_to_line([sys.executable, str(TRAIN), "--help"], r"usage:", env))
        rows["plan"].append(
            time_to_line(
                [sys.executable, str(TRAIN), str(TINY), "--plan", *overrides(sets)], r"^decision:", env
            )
        )
    shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"# startup on tiny, median of {a.rounds} (seconds from process start)")
    print("| what | median s | runs |")
    print("|---|---|---|")
    for k, label in (
        ("ours", "bin/train to its first completed step"),
        ("bare", "bare import + deepspeed.initialize + one step"),
        ("help", "bin/train --help"),
        ("plan", "bin/train --plan (model shape cached)"),
    ):
        print(f"| {label} | {med[k]:.2f} | {', '.join(f'{x:.2f}' for x in rows[k])} |")
    print(f"\nratio first step ours/bare: {med['ours'] / med['bare']:.2f}")
    return {"startup": rows, "ratio": med["ours"] / med["bare"]}
