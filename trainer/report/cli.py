"""`bin/report`'s arguments: one run directory -> its curves and summary (`runs`); several -> compared
(`compare`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainer.common.errors import EXIT_USER_ERROR, UserError
from trainer.report.compare import compare_main
from trainer.report.runs import load, plot, summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="bin/report",
        description="Plot a run's loss, learning rate, throughput and memory; print a summary. Given "
        "several runs of one experiment at different world sizes: their strong and weak scaling "
        "efficiency per ZeRO strategy, and their loss curves overlaid.",
    )
    p.add_argument("run_dir", nargs="+", help="a run directory (holds metrics.jsonl), or several to compare")
    p.add_argument(
        "--out",
        default=None,
        help="PNG path (default: RUN_DIR/report.png; several runs: scaling.png beside them)",
    )
    args = p.parse_args(argv)
    if len(args.run_dir) > 1:
        return compare_main([Path(r) for r in args.run_dir], Path(args.out) if args.out else None)
    run_dir = Path(args.run_dir[0])
    try:
        train, evals, wall = load(run_dir)
        out = plot(run_dir, train, evals, Path(args.out) if args.out else run_dir / "report.png")
        rows = summary(run_dir, train, evals, wall)
    except UserError as e:
        print(e.render(), file=sys.stderr)
        return EXIT_USER_ERROR
    width = max(len(k) for k, _ in rows)
    print(f"run {run_dir}")
    for k, v in rows:
        print(f"  {k.ljust(width)}  {v}")
    from trainer.rl.completions import shown

    for line in shown(run_dir):  # grpo's train.rl.log_completions: the last ones the model wrote
        print(line)
    print(f"plot: {out}")
    return 0
