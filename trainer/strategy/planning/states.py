"""Model states: the parameters, gradients and optimizer state a candidate keeps per rank through
the backward pass (`model_states`), and what they are counted in: the training precision
(`resolve_precision`, `low_precision_bytes`) and the optimizer's implementation
(`optimizer_implementation`).
"""

from __future__ import annotations

from trainer.common.errors import ConfigError, Problem
from trainer.strategy.planning.candidates import Candidate, Quantized


def model_states(
    c: Candidate,
    p: int,
    largest: int,
    n: int,
    lp: int,
    grad_accum: int = 1,
    state_bytes: int = 8,
    trainable: int | None = None,
    persistent: int = 0,
    quantized: Quantized | None = None,
) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes per rank for Adam that live through the backward pass,
    following DeepSpeed's estimators, less the fp32 gradient partitions ZeRO makes only at the step
    (`step_bytes`).

    p parameters, n data-parallel ranks, lp bytes per low-precision value (2 for bf16/fp16, 4 for
    fp32). Mixed precision keeps an fp32 master copy (4), the optimizer its state (`state_bytes`: Adam's
    two fp32 moments, 8; see trainer/common/optimizers.py) and the gradients in the training precision. With
    lp=2: stage 0: 16P, stage 2: 2P + 14P/N, stage 3: 16P/N + 4 x largest layer (a gathered layer,
    counted with the parameters as DeepSpeed does). DeepSpeed's estimators count 4P/N more at stage 2
    (an fp32 gradient partition beside the bf16 one) and 2P/N more at stage 3 (fp32 gradients where the
    plan holds bf16 ones): the fp32 partition exists only during the step, where `step_bytes` counts it
    (tests/unit/test_plan.py holds both to the byte, docs/strategies.md explains them).
    Offload moves the optimizer (and at stage 3 the parameters) off the device. Stage 1 keeps full
    gradients only between micro steps (grad_accum > 1); at the accumulation boundary DeepSpeed
    reduces them into partitions during backward, as stage 2 does. Stage 2 with grad_accum > 1 holds
    two partitions of gradients during every backward pass but the first: the accumulated one and the
    buffer the new micro batch's reduced gradients land in (stage_1_and_2.py: `_release_ipg_buffers`
    drops the buffer, `all_grad_tensors` keeps its views, the next backward allocates another).
    `trainable` (model.lora): only these have gradients, master weights and optimizer state; the frozen
    rest are weights in the training precision (partitioned at stage 3 like the others).
    `persistent`: at stage 3, the elements of the tensors small enough to be kept whole on every rank
    (stage3_param_persistence_threshold). `quantized` (model.lora.quantization, ModelInfo.quantized):
    its elements of the frozen ones are held packed (0.5 bytes each for 4-bit, partitioned at stage 3)
    with their quantization state (whole on every rank), and a forward dequantizes one layer at a time
    into the compute precision (the largest such layer, lp bytes an element).
    """
    q = quantized.elements if quantized else 0
    t = p if trainable is None else trainable
    master = 4  # fp32 master weights (a separate fp32 copy in DeepSpeed's ZeRO even for fp32 models)
    moments = state_bytes
    if quantized:  # the quantized elements in packed bytes; their state and one dequantized layer beside
        dense = lp * (p - q) + quantized.packed * q
        extra = quantized.state_bytes() + lp * quantized.largest
    else:
        dense, extra = lp * p, 0
    if c.stage == 0:
        params, grads, optim = dense + extra, lp * t, (master if lp < 4 else 0) * t + moments * t
    elif c.stage == 1:
        full = lp * t if grad_accum > 1 else lp * t / n
        params, grads, optim = dense + extra, full, (master + moments) * t / n
    elif c.stage == 2:
        params, grads, optim = (
            dense + extra,
            (2 if grad_accum > 1 else 1) * lp * t / n,
            (master + moments) * t / n,
        )
    else:
        # own shard, the persistent small tensors also whole, one gathered layer (DeepSpeed: 4 x largest);
        # the gradient partitions in the training precision (stage3.py: grad_partitions_flat_buffer)
        params = dense / n + lp * persistent + 4 * largest + extra
        grads = lp * t / n
        optim = (master + moments) * t / n
    if c.offload != "none":
        # the optimizer's states and the gradients' partitions on the host: stage 2 accumulates them there,
        # stage 3 keeps its gradient partitions' buffer on the optimizer's device (stage3.py: self.device is
        # the CPU with offload_optimizer; DeepSpeed's estimator: 2P/N + the largest layer on the GPU)
        optim, grads = 0, 0
        if c.offload_params:
            params = (
                4 * largest + extra
            )  # the quantization state and the dequantized layer stay on the device
            grads = 0
    return int(params), int(grads), int(optim)


def optimizer_implementation(choice: str, device_type: str, offload: str) -> str:
    """auto: DeepSpeed's fused Adam on GPU and DeepSpeedCPUAdam with offload (the fast paths); torch's
    AdamW on a CPU device, where DeepSpeed's SIMD kernel rounds differently depending on where a
    reloaded tensor lands in memory, which would make resumed runs differ in the last bit."""
    if choice != "auto":
        return choice
    return "deepspeed" if device_type == "cuda" or offload != "none" else "torch"


def resolve_precision(
    precision: str, device_type: str, bf16_supported: bool = True, source: str | None = None
) -> str:
    """train.precision for the device: auto = bf16 on a GPU that has it, else fp32. fp16 needs a
    CUDA GPU: DeepSpeed's CPU accelerator trains fp32 and bf16 only (its loss scaler is GPU-only)."""
    if precision == "fp16" and device_type == "cpu":
        raise ConfigError(
            source,
            [
                Problem(
                    "train.precision",
                    "fp16 needs a CUDA GPU, and training here runs on CPU (DeepSpeed's CPU accelerator has no "
                    "fp16 training); set train.precision: bf16 (mixed precision that runs on CPU and on "
                    "Ampere or newer GPUs) or auto (fp32 on CPU, bf16 on such a GPU), e.g. "
                    "--set train.precision=bf16",
                )
            ],
        )
    if precision != "auto":
        return precision
    return "bf16" if device_type == "cuda" and bf16_supported else "fp32"


def low_precision_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2
