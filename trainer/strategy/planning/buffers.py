"""Fixed per-rank buffers: the CUDA context and ZeRO's communication buckets (`buffers`), and the
DeepSpeed sizes behind them: what a template's zero_optimization means for the bucket and
persistence sizes ("measured", "auto", a number or DeepSpeed's default: `zero_sizes`) and for
`overlap_comm`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainer.strategy.planning.candidates import Candidate, GiB, ModelInfo

CUDA_CONTEXT = 1 * GiB  # CUDA context, NCCL and allocator slack on a GPU (not counted on CPU)


def buffers(c: Candidate, info: ModelInfo, lp: int, on_gpu: bool, template: Mapping[str, Any] | None) -> int:
    """Fixed per-rank buffers: CUDA context on a GPU plus ZeRO's communication buckets; with ZeRO-Offload (stage
    1/2 with the optimizer on the host) the buffer of the largest trainable tensor each gradient goes to the host
    through (stage_1_and_2.py: temp_grad_buffer_for_gpu_offload; under LoRA bounded by the trainable
    parameters, whose largest tensor is not known here)."""
    zero = zero_section(template)
    sizes = zero_sizes(info, zero)
    out = CUDA_CONTEXT if on_gpu else 0
    if c.stage in (1, 2):  # the reduce bucket, double-buffered with overlap_comm
        out += int((2 if overlap_comm(zero, on_gpu) else 1) * sizes["reduce_bucket_size"] * lp)
        if c.offload != "none":
            largest = max(info.param_sizes, default=info.largest_layer)
            out += lp * (largest if info.trainable is None else min(largest, info.trainable))
    elif c.stage == 3:
        out += int((sizes["reduce_bucket_size"] + sizes["stage3_prefetch_bucket_size"]) * lp)
    return out


def overlap_comm(zero: Mapping[str, Any], on_gpu: bool) -> bool:
    """What `overlap_comm` at stage 1/2 means: as written; "measured" (this project's templates) on
    a GPU only, where the reduction runs on its own CUDA stream beside the backward pass. On CPU there
    is no stream to overlap on, and off (DeepSpeed's default at these stages, one bucket instead of two)
    was 1.034x, 1.012x and 1.002x as fast on gpt2-4x256, llama-gqa and tiny at stage 2 (BENCHMARKS.md:
    overlap_comm at stage 2 on CPU). Absent: DeepSpeed's default, off below stage 3."""
    value = zero.get("overlap_comm", False)
    return on_gpu if value == "measured" else bool(value)


def auto_bucket(hidden: int) -> int:
    """Bucket size (elements) for "auto": hidden^2, as the Hugging Face integration does."""
    return hidden * hidden


# DeepSpeed 0.19's defaults for the sizes below (DeepSpeedZeroConfig).
DEEPSPEED_DEFAULTS = {
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
}
MEASURED = tuple(DEEPSPEED_DEFAULTS)


def measured_sizes(info: ModelInfo) -> dict[str, int]:
    """The rule behind "measured" in configs/deepspeed/ (BENCHMARKS.md: DeepSpeed defaults by
    measurement): DeepSpeed's own defaults, with the buckets no larger than the trainable parameters
    (one bucket for a small model: as few collectives as DeepSpeed's default, without a 1 GB buffer).
    The Hugging Face rule for "auto" (hidden^2 buckets, a persistence threshold of 10 x hidden) ran
    stage 2 at 0.63x and stage 3 at 0.82x of this on CPU: many small collectives."""
    p = info.trainable if info.trainable is not None else info.params
    return {
        "reduce_bucket_size": int(min(DEEPSPEED_DEFAULTS["reduce_bucket_size"], max(p, 1))),
        "allgather_bucket_size": int(min(DEEPSPEED_DEFAULTS["allgather_bucket_size"], max(p, 1))),
        "stage3_prefetch_bucket_size": int(
            min(DEEPSPEED_DEFAULTS["stage3_prefetch_bucket_size"], max(info.params, 1))
        ),
        "stage3_param_persistence_threshold": DEEPSPEED_DEFAULTS["stage3_param_persistence_threshold"],
    }


def zero_section(template: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """A user's template's zero_optimization, or what this project's templates say (no template
    given: the candidate's own, whose sizes are "measured")."""
    if template:
        return template.get("zero_optimization", {})
    return dict.fromkeys((*MEASURED, "overlap_comm"), "measured")


def zero_sizes(info: ModelInfo, zero: Mapping[str, Any]) -> dict[str, int]:
    """The bucket and threshold sizes a zero_optimization section means: a number as written,
    "measured" by `measured_sizes`, "auto" by the Hugging Face integration's rule, absent by
    DeepSpeed's default."""
    h = info.hidden or 1024
    hf = {
        "reduce_bucket_size": auto_bucket(h),
        "allgather_bucket_size": auto_bucket(h),
        "stage3_prefetch_bucket_size": int(0.9 * auto_bucket(h)),
        "stage3_param_persistence_threshold": 10 * h,
    }
    measured = measured_sizes(info)
    out = {}
    for key, default in DEEPSPEED_DEFAULTS.items():
        value = zero.get(key)
        if value == "auto":
            out[key] = hf[key]
        elif value == "measured":
            out[key] = measured[key]
        else:
            out[key] = _number(value, default)
    return out


def is_number(value: Any) -> bool:
    """A JSON number (true/false are not, though Python's bool is an int)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _number(value: Any, default: int) -> int:
    return int(value) if is_number(value) else default
