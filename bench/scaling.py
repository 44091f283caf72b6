"""scaling: runs of one experiment at each world size in --ranks, per stage: the batch per rank kept
(weak scaling) and the global batch of the most ranks kept through gradient accumulation (strong
scaling); then `bin/report` on all of them (efficiencies, loss curves overlaid). On CPU every rank
gets one thread, so that a rank is one core as a GPU is one device."""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path
from typing import Any

from bench.common import TRAIN, cache_dir, env_for, job, launch, overrides, run_sets


def scaling(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    from trainer.report.compare import compare_main

    gpu = torch.cuda.is_available() and not a.cpu
    ranks = sorted(set(a.ranks or [1, torch.cuda.device_count() if gpu else 2]))
    experiment, base = job(a, gpu)
    cache = cache_dir(a)
    out = Path(a.out)
    widest = ranks[-1]
    # (ranks, grad_accum): the batch per rank kept at every size (weak), and the global batch of the
    # most ranks kept (strong) by accumulating widest/n micro batches on n ranks
    jobs = sorted({(n, 1) for n in ranks} | {(n, widest // n) for n in ranks if widest % n == 0})
    print(
        f"# scaling: {experiment.name} at {ranks} {'GPU' if gpu else 'CPU'} rank(s), stages {a.stages}; "
        f"{a.steps} steps each; runs in {out}",
        flush=True,
    )
    dirs = []
    for stage in a.stages:
        for n, accum in jobs:
            run = out / f"zero{stage}-{n}rank{'s' if n > 1 else ''}-accum{accum}"
            shutil.rmtree(run, ignore_errors=True)
            sets = {
                **base,
                **run_sets(a.steps, a.log_every, run, cache),
                "strategy.zero_stage": stage,
                "train.grad_accum": accum,
            }
            env = env_for(n, None if gpu else {"OMP_NUM_THREADS": "1"})  # CPU: one core per rank
            t0 = time.perf_counter()
            launch([str(TRAIN), str(experiment), *overrides(sets)], n, env)
            print(f"  {run.name}: {time.perf_counter() - t0:.0f} s wall", flush=True)
            dirs.append(run)
    print()
    code = compare_main(dirs, out / "scaling.png")
    return {"scaling": [str(d) for d in dirs], "report_exit": code}
