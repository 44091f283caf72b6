"""strategy: how the model is spread over ranks (docs/strategies.md): the ZeRO stage and offload, the activation
levers' and the model-parallel axes' degrees, the machine the plan times on."""

from __future__ import annotations

from pydantic import Field

from trainer.config.fields import AutoBool, Section, Size, auto_or, choice
from trainer.config.hardware_schema import HardwareSection


class StrategySection(Section):
    """How the model is spread over ranks: the ZeRO stage and offload (see docs/strategies.md)."""

    zero_stage: choice("auto", 0, 1, 2, 3) = Field(
        "auto",
        description="auto = the fastest setting that fits by the plan's step time (docs/strategies.md)",
    )
    offload: choice("auto", "none", "cpu", "nvme") = Field(
        "auto", description="auto = none unless nothing fits on the device, then cpu, then nvme"
    )
    offload_params: AutoBool = Field(
        "auto",
        description="stage 3 with offload: the parameters on the host too (true), the optimizer alone (false); "
        "auto = parameters only when the optimizer alone offloaded does not fit",
    )
    nvme_path: str | None = Field(None, description="directory for NVMe offload (offload: nvme)")
    justification: str = Field(
        "", description="why a stage/offload above the one the rules pick is pinned (required then)"
    )
    deepspeed: str | None = Field(
        None, description="explicit DeepSpeed JSON template (e.g. configs/deepspeed/zero2.json)"
    )
    allow_deepspeed_keys: list[str] = Field(
        default_factory=list, description="extra top-level DeepSpeed keys to accept in a template"
    )
    sequence_parallel: auto_or(int, "a whole number") = Field(
        "auto",
        description="Ulysses sequence parallelism: ranks that split every sequence between them (each holds "
        "seq_len / N of it; attention heads exchanged by all-to-all); 1 = off; auto = when the plan needs it "
        "(docs/strategies.md: the activation levers)",
    )
    tensor_parallel: auto_or(int, "a whole number") = Field(
        "auto",
        description="tensor parallelism (DeepSpeed's AutoTP): ranks of a node that divide every layer's "
        "attention and MLP (and the LM head) between them, reading the same rows; 1 = off; auto = inside a node "
        "over NVLink-class links, where the plan finds it fastest or nothing fits without it (docs/strategies.md)",
    )
    expert_parallel: auto_or(int, "a whole number") = Field(
        "auto",
        description="expert parallelism (DeepSpeed's AutoEP) for a mixture of experts: ranks that divide each "
        "layer's experts between them, tokens sent to their experts by all-to-all; bf16; 1 = off; auto = as "
        "tensor_parallel (docs/strategies.md)",
    )
    pipeline_stages: auto_or(int, "a whole number") = Field(
        "auto",
        description="pipeline stages (DeepSpeed's pipeline engine, 1F1B): the model's layers split into N stages "
        "on N ranks (N x strategy.tensor_parallel with AutoTP inside each: 3D), the accumulation's micro batches "
        "flowing through them; ZeRO 0-1; 1 = off; auto = on GPUs, "
        "where nothing fits without it or the plan finds it fastest, stages across nodes first (docs/strategies.md)",
    )
    on_oom: choice("fail", "escalate") = Field(
        "fail",
        description="escalate = on out-of-memory, restart from the last checkpoint on what the plan ranks next "
        "(a ZeRO rung or an activation lever)",
    )
    device_memory: Size = Field(None, description="memory per device, e.g. 80GB; null = read the GPU")
    host_memory: Size = Field(None, description="host memory per node for offload; null = read it")
    headroom: float = Field(0.9, gt=0.0, le=1.0, description="share of device memory the plan may use")
    hardware: HardwareSection = Field(
        default_factory=HardwareSection, description="the machine the plan times its settings on"
    )
