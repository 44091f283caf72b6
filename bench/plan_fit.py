"""The CPU profile's figures (trainer/strategy/planning/hardware.py, "cpu") fitted to the steps bench/plan_order.py
measured: least squares on log(measured / planned) over every (job, setting), the planner's own step model
(speed.py) recomputed for each trial machine. Prints the figures, then per job Spearman's rho and the pick at
those figures, fitted on every job (in sample) and on the other three jobs only (out of sample: the figures
the job itself did not shape).

    python bench/plan_fit.py [bench/results/plan-order-cpu-DATE.json]

A search by coordinates in log space (each figure up and down by a factor, the factor halved when none
helps), from the profile as it stands; `overlap` is False (a CPU's host work and its "device" work share
the cores). What it prints goes into hardware.py by hand, rounded, and BENCHMARKS.md quotes both fits.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import plan_order  # noqa: E402

FIT = ("flops", "peers", "host_link", "cpu_adam", "op_s", "zero3_tensor_s", "micro_s", "collective_s")
# Every fit starts here, not from the profile it would revise (the profile's round figures before the first
# fit), so that the figures a held-out job's fit finds owe nothing to that job
START = {"flops": 60e9, "peers": 2e9, "host_link": 8e9, "cpu_adam": 0.3e9, "op_s": 10e-6, "zero3_tensor_s": 0.2e-3,
         "micro_s": 0.01, "collective_s": 1e-3}  # fmt: skip


def timers() -> dict[tuple[str, str], tuple[Any, Any, Any, bool]]:
    """(job, setting) -> (the Timer's arguments, the planned levers, the rung, whether it offloads), as
    bin/train plans each setting on this CPU with 2 ranks."""
    from trainer.strategy.planning import ladder, speed

    made: list[tuple[tuple, dict]] = []

    class Recorded(speed.Timer):
        def __init__(self, *a: Any, **k: Any) -> None:
            made.append((a, {key: v for key, v in k.items() if key != "hardware"}))
            super().__init__(*a, **k)

    out = {}
    original, ladder.Timer = ladder.Timer, Recorded
    try:
        for name in plan_order.JOBS:
            for rung, levers in plan_order.SETTINGS:
                p = plan_order.plan_of(name, rung, levers)
                out[(name, plan_order.label(rung, levers))] = (made[-1], p.levers, p.candidate,
                                                               p.candidate.offload != "none")  # fmt: skip
    finally:
        ladder.Timer = original
    return out


def seconds(machine: Any, case: tuple[Any, Any, Any, bool]) -> float:
    from trainer.strategy.planning.speed import Timer

    (a, k), levers, c, _ = case
    return Timer(*a, **k, hardware=machine)(levers, c).seconds


def machine_at(x: list[float]) -> Any:
    from trainer.strategy.planning.hardware import PROFILES

    return dataclasses.replace(
        PROFILES["cpu"], overlap=False, **{f: math.exp(v) for f, v in zip(FIT, x, strict=True)}
    )


def fit(cases: dict, measured: dict[tuple[str, str], float]) -> list[float]:
    """The log figures that minimise the squared log error over `measured`."""

    def loss(x: list[float]) -> float:
        m = machine_at(x)
        return sum((math.log(v) - math.log(seconds(m, cases[k]))) ** 2 for k, v in measured.items())

    best = [math.log(START[f]) for f in FIT]
    least, step = loss(best), 1.0
    while step > 0.01:
        improved = False
        for i in range(len(FIT)):
            for d in (step, -step):
                y = list(best)
                y[i] += d
                if (value := loss(y)) < least:
                    best, least, improved = y, value, True
        if not improved:
            step /= 2
    return best


def verdicts(cases: dict, measured: dict, machine: Any, jobs: list[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for name in jobs:
        rows = [{"setting": s, "planned_s": seconds(machine, cases[(n, s)]), "measured_s": v,
                 "offload": cases[(n, s)][3]} for (n, s), v in measured.items() if n == name]  # fmt: skip
        out[name] = plan_order.verdict(rows)
    return out


def main() -> int:
    recordings = sorted(plan_order.RESULTS.glob("plan-order-cpu-*.json"))
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else recordings[-1]
    jobs = json.loads(path.read_text())["jobs"]
    measured = {
        (n, r["setting"]): statistics.median(r["measured"]) for n, j in jobs.items() for r in j["rows"]
    }
    cases = timers()
    x = fit(cases, measured)
    print(
        f"{path.name}: fitted on every job: "
        + ", ".join(f"{f} {math.exp(v):.3g}" for f, v in zip(FIT, x, strict=True))
    )
    for name, v in verdicts(cases, measured, machine_at(x), list(jobs)).items():
        print(
            f"  {name}: rho {v['rho']:.2f}, pick {v['pick']} at {v['pick_ratio']:.2f}x the fastest ({v['fastest']})"
        )
    from trainer.strategy.planning.hardware import PROFILES

    print("the profile as it stands (the fit, rounded):")
    for name, v in verdicts(cases, measured, PROFILES["cpu"], list(jobs)).items():
        print(
            f"  {name}: rho {v['rho']:.2f}, pick {v['pick']} at {v['pick_ratio']:.2f}x the fastest ({v['fastest']})"
        )
    print("each job at the figures fitted on the other three:")
    for name in jobs:
        y = fit(cases, {k: v for k, v in measured.items() if k[0] != name})
        v = verdicts(cases, measured, machine_at(y), [name])[name]
        print(
            f"  {name}: rho {v['rho']:.2f}, pick {v['pick']} at {v['pick_ratio']:.2f}x the fastest ({v['fastest']})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
