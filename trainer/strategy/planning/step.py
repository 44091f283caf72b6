"""The optimizer step's own device memory: what ZeRO allocates only during the step, after the
backward pass has freed the activations (`step_bytes`).
"""

from __future__ import annotations

import math

from trainer.strategy.planning.candidates import Candidate

SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's default zero_optimization.sub_group_size (elements)


def step_bytes(
    c: Candidate,
    t: int,
    n: int,
    lp: int,
    fused_wrapper: bool,
    largest_tensor: int = 0,
    sub_group: int = SUB_GROUP_SIZE,
) -> int:
    """Device bytes per rank the optimizer step allocates for itself, after the backward pass has
    freed the activations: the peak is the larger of the two, not their sum (`Estimate.total`).

    t trainable parameters, n ranks. Stages 1 and 2 flatten the partition's gradients and cast that
    to the fp32 gradient partition at the step, and free both after: lp + 4 bytes a parameter over n
    with mixed precision, 4 in fp32 (the cast of an fp32 tensor is the tensor itself;
    deepspeed/runtime/zero/stage_1_and_2.py, `step`). Before that, the gradient norm casts each
    gradient to fp64 in turn (8 bytes an element of the largest tensor). Stage 3 does the same per
    sub-group (`zero_optimization.sub_group_size`, DeepSpeed's default 1e9 elements; stage3.py,
    `_prepare_fp32_grad_for_sub_group`). Stage 0 with mixed precision casts every gradient to fp32
    for its master weights (4 bytes a parameter); DeepSpeed's fused wrapper (FP16_Optimizer, taken
    with its FusedAdam, the GPU default) also flattens the copies into one buffer while they live
    (8); in fp32 there is no wrapper. With offload the gradients go to the host. `bench/step_memory.py`
    measures these on CPU (BENCHMARKS.md, "The optimizer step's own memory"); counted with the
    activations before, stage 2 on one rank was planned 17.5% over the H100's peak of a 1B Llama,
    which is stage 0's to the byte."""
    if c.offload != "none":
        return 0
    if c.stage == 0:
        return 0 if lp == 4 else (8 if fused_wrapper else 4) * t
    cast = lp + 4 if lp < 4 else 4
    if c.stage == 3:
        return cast * min(sub_group, math.ceil(t / n))
    return max(cast * t // n, 8 * min(largest_tensor, math.ceil(t / n)))
