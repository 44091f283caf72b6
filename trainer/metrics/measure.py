"""Measurements: FLOPs per token and the device's peak (for MFU), peak memory, the sums of one log
interval, and which ranks straggle.

Model FLOPs utilisation (GPU only): FLOPs per token (the planner's count from the model's shape,
trainer/strategy/planning/layers.py: 6 N + 12 L H Q T, N the parameters a token multiplies by, H heads of
size Q, T tokens per sequence: the matmuls of forward and backward plus attention, as in the PaLM paper and
nanoGPT), times tokens per second per device, over the device's dense bf16 peak (989 TFLOP/s on an H100
SXM; `logging.peak_tflops` overrides it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

# Dense bf16 peak per device, by a substring of torch.cuda.get_device_name() (first match wins).
PEAK_BF16_TFLOPS = (
    ("H200", 989.4),
    ("H100 PCIe", 756.0),
    ("H100", 989.4),
    ("GH200", 989.4),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("A10G", 125.0),
    ("A10", 125.0),
    ("L4", 121.0),
    ("RTX 4090", 165.2),
    ("RTX 3090", 71.0),
    ("V100", 125.0),  # fp16: V100 has no bf16
)


def peak_flops(device: Any, override_tflops: float | None = None) -> float | None:
    """The device's dense bf16 peak in FLOP/s; None on CPU or for an unknown GPU (no MFU then)."""
    if override_tflops:
        return override_tflops * 1e12
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    return next((tf * 1e12 for key, tf in PEAK_BF16_TFLOPS if key in name), None)


def peak_memory(device: Any) -> int:
    """Peak bytes this rank has held: allocated device memory on GPU, the process's peak RSS on CPU
    (a host counter either way: no synchronisation)."""
    if getattr(device, "type", None) == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


def duration(seconds: float) -> str:
    s = int(max(0, seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


@dataclass
class Interval:
    """Sums over the steps since the last log line."""

    steps: int = 0
    loss: Any = 0.0  # device tensor sum
    data_wait: float = 0.0
    forward: float = 0.0  # host seconds in forward (the rank's own compute, no collectives)
    paused: float = 0.0  # seconds in eval and checkpoint saves: not training, not counted in step time
    tokens: int = 0  # tokens fed, all ranks (fine-tuning batches are as wide as their longest row)
    started: float = field(default_factory=time.perf_counter)


def stragglers(busy: list[float], hosts: list[str], margin: float) -> list[dict[str, Any]]:
    """Ranks whose own time per step (`busy`: data wait + forward, no collectives) exceeds the
    median by more than `margin` (and by at least 2 ms, so timer noise on tiny steps is not
    reported)."""
    if len(busy) < 2:
        return []
    ordered = sorted(busy)
    n = len(busy)
    median = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    return [
        {"rank": r, "host": hosts[r], "busy_ms": b * 1000, "median_ms": median * 1000,
         "slower_by": b / max(median, 1e-9) - 1}
        for r, b in enumerate(busy)
        if b > median * (1 + margin) and b - median > 0.002
    ]  # fmt: skip


class UtilisationWatch:
    """On a GPU: a warning when the device's utilisation (the share of time a kernel ran, as
    nvidia-smi reports it: torch.cuda.utilization) stays under `floor` for `window` log intervals in a
    row, naming the likely cause: the data (the step's data wait share) or the host (kernels launched
    too slowly to keep the device busy). Once per streak."""

    def __init__(self, read: Any, window: int = 3, floor: float = 0.8) -> None:
        self.read, self.window, self.floor = read, window, floor
        self.low: list[float] = []

    def check(self, rec: dict[str, Any]) -> str | None:
        try:
            u = self.read()
        except Exception:  # no NVML: no reading, never a failure
            return None
        if u is None:
            return None
        rec["gpu_utilisation"] = u / 100
        self.low = [*self.low, u / 100] if u / 100 < self.floor else []
        if len(self.low) != self.window:
            return None
        wait = rec.get("data_wait_share") or 0.0
        cause = (
            f"the data: {wait:.0%} of the step waits for batches; raise data.num_workers or pre-tokenize "
            "(bin/train --prepare-data)"
            if wait >= 0.1
            else f"the host: data waits only {wait:.0%} of the step, so the CPU does not launch kernels fast enough "
            "to keep the GPU busy; raise train.micro_batch_size, or set train.compile (compile_mode: "
            "reduce-overhead adds CUDA graphs)"
        )
        mean = sum(self.low) / len(self.low)
        return (
            f"warning: GPU utilisation {mean:.0%} (under {self.floor:.0%}) for {self.window} log intervals in a row; "
            f"the likely cause is {cause}"
        )
