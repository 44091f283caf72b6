"""One estimate per candidate: its model states, activations, step, buffers and host memory put
together (`estimate_all`), and whether that fits the device and the host (`Estimate`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainer.common.optimizers import OPTIMIZERS
from trainer.config import Experiment
from trainer.config.rl_schema import static_generation
from trainer.strategy.planning.buffers import _number, buffers, zero_section, zero_sizes
from trainer.strategy.planning.candidates import TABLE, Candidate, ModelInfo
from trainer.strategy.planning.generation import reward_model_bytes
from trainer.strategy.planning.host import host_needs, snapshot_bytes
from trainer.strategy.planning.states import model_states, optimizer_implementation
from trainer.strategy.planning.step import SUB_GROUP_SIZE, step_bytes
from trainer.strategy.planning.teacher import teacher_bytes, teacher_host_bytes


@dataclass(frozen=True)
class Estimate:
    """Bytes per rank for one candidate (host figures per node)."""

    candidate: Candidate
    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    host: int  # host memory needed per node
    fits_device: bool = False
    fits_host: bool = True

    # inside `params` and transient: stage 3's gathered layer (4 x the largest), model.lora.quantization's
    # dequantized layer (the largest quantized one in the compute precision)
    gather: int = 0
    step: int = 0  # allocated only during the optimizer step, when the activations are freed (`step_bytes`)
    generation: int = 0  # grpo: held while sampling, between steps (planning/generation.py)
    snapshot: int = 0  # checkpoint.async: the host copy of a save, per node (counted in `host`)
    refused: str = ""  # why this candidate cannot run this job whatever its bytes
    usable: bool = True  # False: NVMe offload without strategy.nvme_path

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        # The step's fp32 gradients are made after the backward pass has freed the activations, and
        # generation (grpo) runs between steps: the peak is the largest of the three, not their sum.
        return self.model_states + max(self.activations, self.step, self.generation) + self.buffers

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host


def stored_sizes(info: ModelInfo, lp: int) -> list[int]:
    """The elements ZeRO-3 sees in each parameter tensor: a quantized weight (model.lora.quantization)
    is stored packed in a tensor of the compute precision (4-bit: an element of bf16 holds 4), so that
    it is its packed bytes / lp elements against stage3_param_persistence_threshold."""
    sizes = list(info.param_sizes)
    if info.quantized:
        packed = info.quantized.packed
        for e in info.quantized.sizes:
            with contextlib.suppress(ValueError):
                sizes.remove(e)
                sizes.append(int(e * packed / lp))
    return sizes


@functools.lru_cache(maxsize=64)
def _persistent(info: ModelInfo, lp: int, threshold: float) -> int:
    """Elements of the tensors ZeRO-3 keeps whole on every rank (at most `threshold` elements each)."""
    return sum(x for x in stored_sizes(info, lp) if x <= threshold)


def estimate_all(
    exp: Experiment,
    info: ModelInfo,
    pinned: tuple[int | None, str | None, bool],
    *,
    act: int,
    lp: int,
    world_size: int,
    gpus_per_node: int,
    on_gpu: bool,
    budget: int,
    host_memory: int | None,
    template: Mapping[str, Any] | None,
    host_activations: int = 0,
    generation: int = 0,
    states: tuple[ModelInfo, float] | None = None,
) -> list[Estimate]:
    """An estimate per candidate of the table. `states`: one rank's model and the ranks ZeRO partitions it
    over, under tensor or expert parallelism (axes.py; None: the model over the world)."""
    local, n = states or (info, world_size)
    want_offload = pinned[1]
    state_bytes = OPTIMIZERS[exp.optim.name].state_bytes
    table = list(TABLE)
    out = []
    # what the optimizer step allocates (`step_bytes`) depends on the candidate through its offload
    sub_group = _number(zero_section(template).get("sub_group_size"), SUB_GROUP_SIZE)
    adam = OPTIMIZERS[exp.optim.name].adam
    trainable = local.params if local.trainable is None else local.trainable
    largest_tensor = max(local.param_sizes, default=local.largest_layer)
    for c in table:
        persistent = 0
        if c.stage == 3:
            threshold = zero_sizes(info, zero_section(template))["stage3_param_persistence_threshold"]
            persistent = _persistent(local, lp, threshold)
        par, grad, opt = model_states(
            c,
            local.params,
            local.largest_layer,
            n,
            lp,
            exp.train.grad_accum,
            state_bytes,
            local.trainable,
            persistent,
            local.quantized,
        )
        # grpo's reward models, distill's teacher
        buf = buffers(c, info, lp, on_gpu, template) + reward_model_bytes(exp, lp) + teacher_bytes(exp, lp, c.stage, n, c.offload_params)  # fmt: skip
        impl = optimizer_implementation(exp.optim.implementation, "cuda" if on_gpu else "cpu", c.offload)
        fused_wrapper = adam and impl == "deepspeed"  # DeepSpeed's FusedAdam
        step = step_bytes(c, trainable, n, lp, fused_wrapper, largest_tensor, sub_group)
        host = host_needs(c, info.params, info.largest_layer, world_size, gpus_per_node, info.trainable,
                          info.quantized)  # fmt: skip
        host += host_activations  # model.offload_activations: the checkpointed layer inputs, per node
        host += teacher_host_bytes(exp, lp, gpus_per_node) if on_gpu else 0  # distill: its load, each rank's
        snap = 0
        if exp.checkpoint.async_ is not False:
            snap = snapshot_bytes(c, info.params, world_size, gpus_per_node, lp, state_bytes, info.trainable,
                                  exp.model.checkpoints_hold_frozen)  # fmt: skip
        # checkpoint.async: true needs the copy's room; auto goes synchronous where it would not fit
        need = host + snap if exp.checkpoint.async_ is True else host
        nvme_ok = c.offload != "nvme" or bool(exp.strategy.nvme_path) or want_offload == "nvme"
        # LLM.int8 keeps each layer's whole int8 weight in its state after a forward: ZeRO-3 cannot shard it
        refused = (
            "8bit: ZeRO-3 cannot shard it"
            if c.stage == 3 and info.quantized and info.quantized.packed >= 1
            else "train.rl.generation_cache static: the weights must stay in place"
            if c.stage == 3 and static_generation(exp)
            else ""
        )
        e = Estimate(
            c, par, grad, opt, act, buf, host + snap,
            fits_host=host_memory is None or need <= host_memory,  # None: a target machine, not known
            gather=(4 * local.largest_layer if c.stage == 3 else 0) + (lp * info.quantized.largest if info.quantized else 0),
            snapshot=snap,
            step=step, generation=generation, refused=refused, usable=nvme_ok,
        )  # fmt: skip
        out.append(dataclasses.replace(e, fits_device=e.total <= budget and nvme_ok and not refused))
    return out


def with_activations(
    base: list[Estimate], act: int, host_activations: int, budget: int, host_memory: int | None, copy: bool
) -> list[Estimate]:
    """`base` (estimate_all's with no activations and no host copies of them) under one setting of the
    levers: its activations on the device, `host_activations` more a node on the host. `copy`
    (checkpoint.async: true): the host must hold the checkpoint copy too."""
    out = []
    for b in base:
        host = b.host + host_activations
        need = host if copy else host - b.snapshot
        total = b.model_states + max(act, b.step, b.generation) + b.buffers  # Estimate.total
        e = object.__new__(Estimate)  # a copy with these fields changed (dataclasses.replace: 10x slower)
        e.__dict__.update(b.__dict__, activations=act, host=host, fits_host=host_memory is None or need <= host_memory,
                          fits_device=total <= budget and b.usable and not b.refused)  # fmt: skip
        out.append(e)
    return out
