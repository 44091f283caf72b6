"""`--profile`: a torch.profiler trace of PROFILE_ACTIVE steps after PROFILE_WARMUP warm-up steps, and
the top operators, grouped by kind (matrix products, attention, communication, copies, the rest)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from trainer.run.attempt import start, steps, training
from trainer.run.build import Run

log = logging.getLogger("trainer")
PROFILE_WARMUP, PROFILE_ACTIVE = 3, 5  # --profile: steps before the trace, steps traced


KINDS = (
    ("communication", ("nccl", "gloo", "all_reduce", "allreduce", "all_gather", "reduce_scatter", "c10d")),
    ("optimizer", ("adam", "multi_tensor_apply", "optimizer", "_foreach")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "scaled_dot_product")),
    ("matmul", ("gemm", "xmma", "cutlass", "cublas", "nvjet", "triton_tem", "aten::mm", "aten::addmm", "aten::bmm")),
    ("copies", ("memcpy", "memset", "aten::copy_", "aten::cat", "aten::_to_copy", "aten::contiguous")),
)  # fmt: skip
OTHER = "elementwise and reductions"
# Device-side ranges over kernels, not kernels: torch.compile's "## Call CompiledFxGraph ..." (counted
# as well, they made a compiled step's kernels look 122% busy and 65% elementwise on an H100).
RANGES = ("## ", "ProfilerStep#")


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, pats in KINDS if any(p in low for p in pats)), OTHER)


def time_by_kind(averages: Any, cuda: bool, wall: float) -> str:
    """One line: the share of device kernel time (CPU: operator self time) per kind of work, and on
    a GPU how busy its kernels kept it during the traced steps (`wall` seconds)."""
    from torch.autograd import DeviceType

    spent: dict[str, float] = {}
    for e in averages:
        if cuda:
            if e.device_type != DeviceType.CUDA or e.key.startswith(RANGES):
                continue  # kernels only: an operator's or a range's device time is its kernels' again
            us = e.self_device_time_total or e.device_time_total
        else:
            us = e.self_cpu_time_total
        kind = kind_of(e.key)
        spent[kind] = spent.get(kind, 0.0) + us
    total = sum(spent.values())
    if total <= 0:
        return "profile: no timed work recorded"
    shares = ", ".join(
        f"{k} {v / total:.0%}" for k, v in sorted(spent.items(), key=lambda kv: -kv[1]) if v / total >= 0.005
    )
    if cuda:
        busy = total / 1e6 / max(wall, 1e-9)
        return (
            f"profile: GPU kernels {total / 1e6:.3f} s in {wall:.3f} s of traced steps (busy {busy:.0%}"
            + ("; the GPU waits for the host: launch overhead, syncs, data" if busy < 0.9 else "")
            + f"); by kind: {shares}"
        )
    return f"profile: CPU operator time by kind: {shares}"


def profile(run: Run) -> int:
    """--profile: PROFILE_WARMUP steps, then PROFILE_ACTIVE steps under torch.profiler; every rank
    writes its Chrome trace (`trace_rank00000.json`, open in chrome://tracing or Perfetto); rank 0
    prints the top operators by self time, and the time by kind of work (`time_by_kind`): on a
    GPU, kernel time against the wall time of the traced steps, so that a device waiting for the
    host shows."""
    start(run, checks=False)
    return training(run, lambda: _profiled(run))


def _profiled(run: Run) -> Path:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    state, device, rank = run.state, run.engine.device, run.env.rank
    steps(run, state.step + PROFILE_WARMUP)
    cuda = getattr(device, "type", None) == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=activities, record_shapes=True) as prof:
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        steps(run, state.step + PROFILE_ACTIVE)
        if cuda:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
    path = Path(run.exp.run_dir) / f"trace_rank{rank:05d}.json"
    prof.export_chrome_trace(str(path))
    if rank == 0:
        sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        averages = prof.key_averages()  # grouping every event of the trace: once
        log.info(
            f"profile: steps {state.step - PROFILE_ACTIVE + 1}-{state.step}; top operators by self time:"
        )
        log.info(averages.table(sort_by=sort, row_limit=15))
        try:  # a summary of the table above: never worth losing the trace over
            log.info(time_by_kind(averages, cuda, wall))
        except Exception as e:  # noqa: BLE001 (profiler event fields differ between torch versions)
            log.warning(f"profile: no time by kind ({type(e).__name__}: {e})")
        log.info(
            f"profile: trace written to {path} (one per rank; open in chrome://tracing or ui.perfetto.dev)"
        )
    return path
