"""strategy.hardware: the machine the plan times its settings on (docs/strategies.md: the step's cost)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field

from trainer.config.fields import Section, choice

# the figures a key takes: from a thousandth (a 1 MB/s link, a GFLOP/s device) to 10,000 (ten times NVLink 5's 900
# GB/s and four times a B200's dense 2,250 TFLOP/s); an infinity, NaN or a figure past these would time a setting at
# 0 s or forever
LOW, HIGH = 0.001, 10_000


def auto_or_positive(what: str) -> Any:
    """A field that takes "auto" or a number > 0 from LOW to HIGH (an int taken as a float); `what` names it in the
    error, which gives the range."""

    def check(value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        if isinstance(value, int | float) and not isinstance(value, bool) and LOW <= value <= HIGH:
            return float(value)
        raise ValueError(f"must be auto or {what} from {LOW:g} to {HIGH:,}")

    check.allowed = "auto|float"  # type: ignore[attr-defined]  (for the reference)
    return Annotated[Any, BeforeValidator(check)]


class HardwareSection(Section):
    """Each auto takes the GPU profile's figure (trainer/strategy/planning/hardware.py cites them)."""

    gpu: choice(
        "auto", "h100", "h200", "a100", "l40s", "rtx4090", "h100-pcie", "h100-nvl", "h200-nvl", "a100-pcie"
    ) = Field(
        "auto",
        description="the GPU profile the plan times settings on; auto = this machine's GPU by its name, the H100 "
        "when planning for another machine (a CPU run: the CPU's)",
    )
    tflops: auto_or_positive("TFLOP/s") = Field(
        "auto",
        description="dense TFLOP/s a device achieves on the model's matmuls; auto = 45% of the GPU's peak",
    )
    peer_gbs: auto_or_positive("GB/s") = Field(
        "auto", description="GB/s each way between the GPUs of a node (NVLink; PCIe where there is none)"
    )
    network_gbs: auto_or_positive("GB/s") = Field("auto", description="GB/s each way a GPU between nodes")
    host_gbs: auto_or_positive("GB/s") = Field(
        "auto", description="GB/s each way between a GPU and host memory (PCIe): offload's copies"
    )
    cpu_adam: auto_or_positive("billions of parameters a second") = Field(
        "auto",
        description="billions of parameters a second DeepSpeed's CPU Adam updates on one node, its ranks "
        "together (offload)",
    )
    nvme_gbs: auto_or_positive("GB/s") = Field(
        "auto", description="GB/s a node to and from NVMe (offload: nvme)"
    )
