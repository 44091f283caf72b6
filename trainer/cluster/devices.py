"""Which devices this process has, found without initialising CUDA where it can: GPUs hidden for a CPU run
(`TRAINER_CPU`, `CUDA_VISIBLE_DEVICES`), the memory and name of this machine's GPU (nvidia-smi), the host's
memory."""

from __future__ import annotations

import os
import subprocess
from typing import Any

ENV_CPU = "TRAINER_CPU"  # 1: a CPU run on a GPU machine (the deepspeed launcher resets CUDA_VISIBLE_DEVICES)


def gpus_hidden() -> bool:
    """A CPU run on a GPU machine: TRAINER_CPU=1, or CUDA_VISIBLE_DEVICES hides every GPU ("" or a list
    starting at -1). The deepspeed launcher sets CUDA_VISIBLE_DEVICES=0,1,... in every rank even when
    the user hid them, so the supervisor and bench/bench.py --cpu pass TRAINER_CPU=1 as well."""
    if os.environ.get(ENV_CPU) == "1":
        return True
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible is not None and visible.split(",")[0].strip() in ("", "-1")


def hide_gpus_if_asked() -> None:
    """Under TRAINER_CPU=1, hide the GPUs from torch too (before CUDA's first use)."""
    if os.environ.get(ENV_CPU) == "1":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def device_memory(runtime: Any = None) -> int | None:
    """Memory of this rank's GPU, without initialising CUDA when there is no process group yet; None
    without one (none here, or CUDA_VISIBLE_DEVICES hides them all, as torch would find none)."""
    if runtime is not None and runtime.device_type == "cuda":
        import torch

        return torch.cuda.get_device_properties(runtime.device).total_memory
    if runtime is not None or gpus_hidden():
        return None
    try:  # nvidia-smi keeps `--plan` free of CUDA initialisation
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if out.returncode == 0 and out.stdout.strip():
            return int(out.stdout.split()[0]) * 2**20
    except (OSError, subprocess.TimeoutExpired, ValueError):
        pass
    return None


def device_name() -> str | None:
    """This machine's first GPU's name (nvidia-smi, no CUDA initialisation), for the plan's hardware
    profile (strategy.hardware.gpu: auto); None without one."""
    if gpus_hidden():
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10)  # fmt: skip
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.splitlines()[0].strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return None


def host_memory() -> int:
    import psutil

    return psutil.virtual_memory().total


def gpu_present() -> bool:
    """A GPU on this machine, found without initialising CUDA."""
    return device_memory() is not None
