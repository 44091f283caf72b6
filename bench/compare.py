"""compare: the same model, data, seed and DeepSpeed JSON (a) through bin/train and (b) through a minimal
hand-written DeepSpeed loop (bench/raw_loop.py), interleaved A B A B under the deepspeed launcher:
median step time after warm-up, tokens/s, the ratio ours/raw (its min and max over rounds), whether
the final weights are bitwise equal, and on a CUDA machine MFU."""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (
    ROOT,
    cache_dir,
    env_for,
    interleave,
    job,
    launch,
    median_after,
    ours,
    ratio,
    run_sets,
    spec_for,
)
from trainer.cluster.devices import gpu_present
from trainer.cluster.dist import malloc_env


def raw(spec: dict[str, Any], nproc: int, work: Path) -> dict[str, Any]:
    out = work / "raw.json"
    spec_file = work / "spec.json"
    spec_file.write_text(json.dumps({**spec, "out": str(out)}))
    # the raw loop gets bin/train's malloc settings too (trainer.cluster.dist.keep_freed_memory, CPU), as the
    # environment variables that mean the same: the comparison is of the loops
    malloc = {} if gpu_present() else malloc_env()
    launch([str(ROOT / "bench" / "raw_loop.py"), "--spec", str(spec_file)], nproc, env_for(nproc, malloc))
    return json.loads(out.read_text())


def stage_rounds(
    a: argparse.Namespace, experiment: Path, sets: dict[str, Any], nproc: int, work: Path
) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """One stage: the raw loop's spec, and both sides' runs over the rounds, A B each round."""
    spec = spec_for(experiment, sets, nproc)
    stage = sets["strategy.zero_stage"]

    def run(side: str, r: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        res = ours(experiment, sets, nproc, work) if side == "ours" else raw(spec, nproc, work)
        med = median_after(res["intervals"], a.warmup, a.log_every)
        print(
            f"  zero{stage} round {r} {side:4}: median step {med * 1000:8.1f} ms  "
            f"({time.perf_counter() - t0:.0f} s wall)",
            flush=True,
        )
        return {**res, "median_step_s": med}

    return spec, interleave(("ours", "raw"), a.rounds, run)


def stage_result(
    stage: int, spec: dict[str, Any], rows: dict[str, list[dict[str, Any]]], nproc: int, gpu: bool
) -> dict[str, Any]:
    tokens_per_step = spec["micro"] * nproc * spec["grad_accum"] * spec["seq_len"]
    s = ratio([x["median_step_s"] for x in rows["ours"]], [x["median_step_s"] for x in rows["raw"]])
    o, w = s["num"], s["den"]
    digests = {x["param_digest"] for x in rows["ours"] + rows["raw"]}
    res = {
        "stage": stage,
        "ours_step_ms": o * 1000,
        "raw_step_ms": w * 1000,
        "ours_tokens_per_s": tokens_per_step / o,
        "raw_tokens_per_s": tokens_per_step / w,
        "ratio": s["ratio"],
        "ratio_min": s["ratio_min"],
        "ratio_max": s["ratio_max"],
        "bitwise_equal": len(digests) == 1,
        "runs": {side: [x["median_step_s"] for x in rows[side]] for side in rows},
        "intervals": {
            side: [[r["step_time_s"] for r in x["intervals"]] for x in rows[side]] for side in rows
        },
    }
    if gpu:
        import torch

        from trainer.metrics import peak_flops

        peak = peak_flops(torch.device("cuda", 0))
        if peak:
            res["ours_mfu"] = res["ours_tokens_per_s"] / nproc * spec["flops_per_token"] / peak
            res["raw_mfu"] = res["raw_tokens_per_s"] / nproc * spec["flops_per_token"] / peak
    return res


def print_table(results: list[dict[str, Any]], gpu: bool) -> None:
    print()
    print(
        "| stage | ours ms/step | raw ms/step | ours tok/s | raw tok/s | ratio ours/raw (min-max) | weights bitwise equal |"
        + (" MFU ours / raw |" if gpu else "")
    )
    print("|---|---|---|---|---|---|---|" + ("---|" if gpu else ""))
    for r in results:
        mfu = f" {r['ours_mfu']:.1%} / {r['raw_mfu']:.1%} |" if "ours_mfu" in r else (" n/a |" if gpu else "")
        print(
            f"| {r['stage']} | {r['ours_step_ms']:.1f} | {r['raw_step_ms']:.1f} | {r['ours_tokens_per_s']:,.0f} | "
            f"{r['raw_tokens_per_s']:,.0f} | {r['ratio']:.3f} ({r['ratio_min']:.3f}-{r['ratio_max']:.3f}) | "
            f"{'yes' if r['bitwise_equal'] else 'NO'} |{mfu}"
        )


def compare(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    gpu = torch.cuda.is_available() and not a.cpu
    nproc = a.nproc or (torch.cuda.device_count() if gpu else 2)
    experiment, base = job(a, gpu)
    results = []
    work = Path(tempfile.mkdtemp(prefix="bench-"))
    cache = cache_dir(a)
    print(
        f"# compare: {experiment.name} on {nproc} {'GPU' if gpu else 'CPU'} rank(s); {a.rounds} rounds A B, "
        f"{a.steps} steps, median of the {a.log_every}-step intervals after step {a.warmup}",
        flush=True,
    )
    for stage in a.stages:
        sets = {**base, **run_sets(a.steps, a.log_every, work / "run", cache), "strategy.zero_stage": stage}
        spec, rows = stage_rounds(a, experiment, sets, nproc, work)
        results.append(stage_result(stage, spec, rows, nproc, gpu))
    shutil.rmtree(work, ignore_errors=True)
    print_table(results, gpu)
    return {
        "compare": results,
        "device": "cuda" if gpu else "cpu",
        "nproc": nproc,
        "experiment": experiment.name,
    }
