"""The memory planner: which ZeRO stage and offload, and why.

`plan()` estimates per-rank memory (model states, activations, buffers; host memory per node for
offload) for every candidate and applies the escalation rules: the first of 0 -> 2 -> 3 -> 3+cpu ->
3+nvme (`LADDER`) that fits `device memory x headroom`; stage 1 only when asked for; a pinned stage
or offload above the rules' choice needs a justification. The run-time escalation climbs the same
ladder (`next_rung`).

Nothing here imports torch or deepspeed: planning runs anywhere, in well under a second.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainer.config import Experiment, chunked_loss_problem, format_size, loss_chunk_rows
from trainer.errors import ConfigError, Problem, UserError
from trainer.optimizers import OPTIMIZERS

# ----------------------------------------------------------------------------- model facts


@dataclass(frozen=True)
class ModelInfo:
    """What the planner needs to know about a model, counted without allocating its weights."""

    params: int  # unique parameters (tied weights once)
    largest_layer: int  # most parameters held directly by one module (ZeRO-3 gathers it whole)
    trainable: int | None = None  # those that train (model.lora: the adapters); None = all
    param_sizes: tuple[int, ...] = ()  # elements of each parameter tensor, ascending (ZeRO-3 persistence)
    hidden: int | None = None
    layers: int | None = None
    heads: int | None = None
    vocab: int | None = None
    positions: int | None = None
    attn_implementation: str | None = None  # eager materialises attention scores; sdpa/flash do not
    model_type: str | None = None
    intermediate: int | None = None  # a gated MLP's width (gate_proj/up_proj), None for GPT-style MLPs
    kv_heads: int | None = None  # grouped-query attention's key/value heads (None: as many as heads)


def describe_params(info: ModelInfo, lora: Any = None) -> str:
    """'N parameters', and with LoRA how many train and how many are frozen."""
    if info.trainable is None:
        return f"{info.params:,} parameters"
    what = f"LoRA r={lora.r}: " if lora is not None else ""
    return (
        f"{info.params:,} parameters ({what}{info.trainable:,} trainable = {info.trainable / info.params:.2%}, "
        f"{info.params - info.trainable:,} frozen)"
    )


# ----------------------------------------------------------------------------- candidates


@dataclass(frozen=True, order=True)
class Candidate:
    """A ZeRO stage plus where optimizer states (and, at stage 3, parameters) live."""

    stage: int
    offload: str = "none"  # none | cpu | nvme
    offload_params: bool = False  # stage 3 only: parameters offloaded too

    @property
    def name(self) -> str:
        if self.offload == "none":
            return f"zero{self.stage}"
        what = "" if self.offload_params or self.stage < 3 else " (optimizer only)"
        return f"zero{self.stage}+{self.offload}{what}"

    @property
    def cost(self) -> int:
        """Position on the escalation ladder: higher = more communication or slower memory."""
        if self.offload == "none":
            return self.stage
        return {"cpu": 4, "nvme": 6}[self.offload] + (self.stage == 3)

    @property
    def template(self) -> str:
        suffix = {"none": "", "cpu": "_offload", "nvme": "_nvme"}[self.offload]
        return f"zero{self.stage}{suffix}.json"


def _c(stage: int, offload: str = "none") -> Candidate:
    return Candidate(stage, offload, offload_params=(stage == 3 and offload != "none"))


LADDER = (_c(0), _c(2), _c(3), _c(3, "cpu"), _c(3, "nvme"))
TABLE = (_c(0), _c(1), _c(2), _c(2, "cpu"), _c(3), _c(3, "cpu"), _c(3, "nvme"))

# ----------------------------------------------------------------------------- memory model

GiB = 2**30
CUDA_CONTEXT = 1 * GiB  # CUDA context, NCCL and allocator slack on a GPU (not counted on CPU)
HOST_BUFFER_FACTOR = 1.5  # DeepSpeed estimators' additional_buffer_factor
# torch.compile's layers keep more for backward than eager's (AOTAutograd's partitioner saves what
# it chose not to recompute): GPT-2 124M on an H100, bf16, micro 64 and 128 (BENCHMARKS.md), the
# measured peaks fit 1.21-1.36x the eager count; 1.3 keeps both within 10% and over.
COMPILED_LAYERS = 1.3


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

    gather: int = 0  # stage 3: the gathered layer inside `params` (transient, 4 x largest layer)
    step: int = 0  # allocated only during the optimizer step, when the activations are freed (`step_bytes`)
    snapshot: int = 0  # checkpoint.async: the host copy of a save, per node (counted in `host`)

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        # The step's fp32 gradients are made after the backward pass has freed the activations: the
        # peak is the larger of the two, not their sum.
        return self.model_states + max(self.activations, self.step) + self.buffers

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host


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
) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes per rank for Adam that live through the backward pass,
    following DeepSpeed's estimators, less the fp32 gradient partitions ZeRO makes only at the step
    (`step_bytes`).

    p parameters, n data-parallel ranks, lp bytes per low-precision value (2 for bf16/fp16, 4 for
    fp32). Mixed precision keeps an fp32 master copy (4), the optimizer its state (`state_bytes`: Adam's
    two fp32 moments, 8; see trainer/optimizers.py) and the gradients in the training precision. With
    lp=2: stage 0: 16P, stage 2: 2P + 14P/N, stage 3: 16P/N + 4 x largest layer (a gathered layer,
    counted with the parameters as DeepSpeed does); DeepSpeed's estimators count an fp32 gradient
    partition beside these (4P/N more at stages 2 and 3), which exists only during the step.
    Offload moves the optimizer (and at stage 3 the parameters) off the device. Stage 1 keeps full
    gradients only between micro steps (grad_accum > 1); at the accumulation boundary DeepSpeed
    reduces them into partitions during backward, as stage 2 does. Stage 2 with grad_accum > 1 holds
    two partitions of gradients during every backward pass but the first: the accumulated one and the
    buffer the new micro batch's reduced gradients land in (stage_1_and_2.py: `_release_ipg_buffers`
    drops the buffer, `all_grad_tensors` keeps its views, the next backward allocates another).
    `trainable` (model.lora): only these have gradients, master weights and optimizer state; the frozen
    rest are weights in the training precision (partitioned at stage 3 like the others).
    `persistent`: at stage 3, the elements of the tensors small enough to be kept whole on every rank
    (stage3_param_persistence_threshold).
    """
    t = p if trainable is None else trainable
    master = 4  # fp32 master weights (a separate fp32 copy in DeepSpeed's ZeRO even for fp32 models)
    moments = state_bytes
    if c.stage == 0:
        params, grads, optim = lp * p, lp * t, (master if lp < 4 else 0) * t + moments * t
    elif c.stage == 1:
        full = lp * t if grad_accum > 1 else lp * t / n
        params, grads, optim = lp * p, full, (master + moments) * t / n
    elif c.stage == 2:
        params, grads, optim = lp * p, (2 if grad_accum > 1 else 1) * lp * t / n, (master + moments) * t / n
    else:
        # own shard, the persistent small tensors also whole, one gathered layer (DeepSpeed: 4 x largest);
        # the gradient partitions in the training precision (stage3.py: grad_partitions_flat_buffer)
        params = lp * p / n + lp * persistent + 4 * largest
        grads = lp * t / n
        optim = (master + moments) * t / n
    if c.offload != "none":
        optim = 0
        grads = 0 if c.stage == 2 else grads / 2
        if c.offload_params:
            params = 4 * largest
            grads = 0
    return int(params), int(grads), int(optim)


def optimizer_implementation(choice: str, device_type: str, offload: str) -> str:
    """auto: DeepSpeed's fused Adam on GPU and DeepSpeedCPUAdam with offload (the fast paths); torch's
    AdamW on a CPU device, where DeepSpeed's SIMD kernel rounds differently depending on where a
    reloaded tensor lands in memory, which would make resumed runs differ in the last bit."""
    if choice != "auto":
        return choice
    return "deepspeed" if device_type == "cuda" or offload != "none" else "torch"


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


def host_needs(
    c: Candidate, p: int, largest: int, n: int, gpus_per_node: int, trainable: int | None = None
) -> int:
    """Host bytes per node, DeepSpeed's estimator formulas (zero_init for stage 3); with offload the
    optimizer's part counts the `trainable` parameters only."""
    t = p if trainable is None else trainable
    nodes = max(1, n // max(1, gpus_per_node))
    f = HOST_BUFFER_FACTOR
    if c.stage == 3:
        if c.offload == "none":
            return int(largest * 4 * gpus_per_node * f)
        if c.offload == "nvme":  # states live on NVMe; the host keeps pinned swap buffers
            return int(largest * 4 * gpus_per_node * f + 2 * GiB)
        return int((16 * t + (2 * p if c.offload_params else 0)) / nodes * f)
    if c.offload != "none":
        return int(t * max(4 * n, 16) * f / nodes)
    return int(p * 4 * gpus_per_node * f)


def snapshot_bytes(
    c: Candidate,
    p: int,
    n: int,
    gpus_per_node: int,
    lp: int,
    state_bytes: int = 8,
    trainable: int | None = None,
    frozen_saved: bool = True,
) -> int:
    """Host bytes per node for the copy an asynchronous save takes (checkpoint.async): what the
    node's ranks write. Rank 0 writes the module (low-precision values) at stages 0-2, every rank
    its shard at stage 3; the optimizer (fp32 masters and moments) goes whole in rank 0's file at
    stage 0, a partition per rank at stages 1-3 (offloaded or not: the copy is taken either way).
    `frozen_saved=False` (LoRA on a pretrained model): the module holds the trainable ones only."""
    g = max(1, min(gpus_per_node, n))
    master = 4 if (lp < 4 or c.stage > 0) else 0  # fp32 at stage 0 has no separate master copy
    t = p if trainable is None else trainable
    saved = p if frozen_saved else t
    module = lp * saved if c.stage < 3 else lp * saved * g / n
    optim = (master + state_bytes) * t * (1 if c.stage == 0 else g / n)
    return int(module + optim)


def layer_bytes_per_token(info: ModelInfo, lp: int, kernels: str = "none") -> float:
    """Activation bytes one transformer layer keeps per token for backward, 16-bit.

    GPT-style layers (an MLP of 4h with GELU): Korthikanti et al. (2022), 34h. Llama-style layers (a
    gated MLP of width I and RMSNorm, `info.intermediate`), counted from what autograd saves, then
    checked on an H100 (Llama 1B, BENCHMARKS.md: 51-54h measured against 55h here):
    each RMSNorm its fp32 input (4h), the normalised value (2h) and its output (2h, read by the next
    projections); attention q, k and v as SDPA saves them (2h + 4h x kv_heads / heads), its output and
    the copy that o_proj reads (4h); the MLP gate, silu(gate), up and their product (8I).
    `kernels="liger"`: Liger's RMSNorm keeps only its 16-bit input (2h + 2h per norm) and its SwiGLU
    recomputes silu in backward (6I): 39h for the 1B, 32-35h measured."""
    h = info.hidden or 0
    if not info.intermediate:
        return 34 * h * lp / 2
    kv = (info.kv_heads or info.heads or 1) / (info.heads or 1)
    norms = 2 * (4 if kernels == "liger" else 8) * h
    attention = 2 * h + 4 * h * kv + 4 * h
    mlp = (6 if kernels == "liger" else 8) * info.intermediate
    return (norms + attention + mlp) * lp / 2


def activations(
    info: ModelInfo,
    micro_batch: int,
    seq_len: int,
    lp: int,
    checkpointing: bool,
    chunked_loss: bool = False,
    kernels: str = "none",
    compiled: bool = False,
) -> int:
    """Activation bytes per rank: per layer s*b*`layer_bytes_per_token`, plus 5*a*s/h x s*b*h
    attention scores with eager attention; with activation checkpointing the layer inputs (2sbh per
    layer) plus one layer's full activations. Plus the logits for the loss: b*s*V*3*(lp + 4) bytes,
    that is the logits, their fp32 copy and its log-softmax, then in backward their gradients (18
    bytes per logit in bf16; measured on a GPU in BENCHMARKS.md). With `model.chunked_loss`, one chunk
    of rows instead: its fp32 logits and their low-precision gradient (twice, for the allocator), plus
    the saved gradients towards the hidden states (lp) and the head's weight (fp32); with
    `model.kernels: liger` the chunked loss is Liger's fused linear cross-entropy: chunks of 16-bit
    logits (about V/h times fewer rows than tokens) and a 16-bit gradient of the head's weight.
    `compiled` (train.compile): each layer's activations `COMPILED_LAYERS` times eager's, and the whole
    logits' loss only the logits in the training precision (Inductor fuses the fp32 log-softmax and
    its gradient into the loss's kernels: 32.39 GiB measured where the eager count, 18 bytes a logit,
    gave 76 and refused the run)."""
    h, layers, a, v = info.hidden, info.layers, info.heads, info.vocab
    if not (h and layers):
        return 0
    s, b = seq_len, micro_batch
    scale = lp / 2
    attn = 5 * (a or 1) * s / h if (info.attn_implementation or "eager") == "eager" else 0
    per_layer = s * b * (layer_bytes_per_token(info, lp, kernels) + h * attn * scale)
    if compiled:
        per_layer *= COMPILED_LAYERS
    if checkpointing:
        total = 2 * s * b * h * scale * layers + per_layer
    else:
        total = per_layer * layers
    if v and chunked_loss and kernels == "liger":
        rows = min(b * s, 1 << max(0, math.ceil(math.log2(max(1, b * s / math.ceil(v / h))))))
        total += 2 * rows * v * lp + b * s * h * lp + v * h * lp
    elif v and chunked_loss:
        rows = min(b * s, loss_chunk_rows(v))
        total += 2 * rows * v * (4 + lp) + b * s * h * lp + v * h * 4
    elif v and compiled:
        total += b * s * v * lp
    elif v:
        total += 3 * b * s * v * (lp + 4)
    return int(total)


def buffers(c: Candidate, info: ModelInfo, lp: int, on_gpu: bool, template: Mapping[str, Any] | None) -> int:
    """Fixed per-rank buffers: CUDA context on a GPU plus ZeRO's communication buckets."""
    zero = zero_section(template)
    sizes = zero_sizes(info, zero)
    out = CUDA_CONTEXT if on_gpu else 0
    if c.stage in (1, 2):  # the reduce bucket, double-buffered with overlap_comm
        out += int((2 if overlap_comm(zero, on_gpu) else 1) * sizes["reduce_bucket_size"] * lp)
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


# ----------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Plan:
    """The decision and the evidence for it."""

    candidate: Candidate
    reason: str
    estimates: tuple[Estimate, ...]
    budget: int  # device bytes the plan may use (device memory x headroom)
    device_memory: int
    host_memory: int | None  # None: planning for another machine whose host memory was not given
    world_size: int
    gpus_per_node: int
    precision: str
    device_type: str
    pinned: bool = False
    justification: str = ""
    auto_choice: Candidate | None = None

    @property
    def estimate(self) -> Estimate:
        return next(e for e in self.estimates if e.candidate == self.candidate)

    def checkpoint_async(self, setting: Any) -> tuple[bool, str]:
        """checkpoint.async for the chosen candidate: (on, why). auto is on unless the host copy does
        not fit in host memory beside what the candidate needs there."""
        e = self.estimate
        copy = f"a host copy of {format_size(e.snapshot)} per node"
        if setting is False:
            return False, "checkpoint.async: false"
        if setting is True:
            return True, copy
        if self.host_memory is not None and e.host > self.host_memory:
            return False, (
                f"checkpoint.async: auto: {copy} does not fit beside the rest in host memory "
                f"({format_size(e.host)} of {format_size(self.host_memory)}); saving synchronously"
            )
        return True, copy

    def table(self) -> str:
        head = (
            "candidate",
            "params",
            "grads",
            "optimizer",
            "activations",
            "step",
            "buffers",
            "total/rank",
            "host/node",
            "fits",
        )
        rows = [head]
        for e in self.estimates:
            mark = " <-" if e.candidate == self.candidate else ""
            fits = "yes" if e.fits else ("no (host)" if e.fits_device else "no")
            if e.candidate.offload == "nvme" and not e.fits and e.total <= self.budget:
                fits = "no (needs strategy.nvme_path)"
            rows.append(
                (
                    e.candidate.name,
                    *(
                        format_size(x)
                        for x in (
                            e.params,
                            e.grads,
                            e.optimizer,
                            e.activations,
                            e.step,
                            e.buffers,
                            e.total,
                            e.host,
                        )
                    ),
                    fits + mark,
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        last = len(head) - 1
        lines = [
            "  ".join(
                c.ljust(w) if i in (0, last) else c.rjust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            ).rstrip()
            for r in rows
        ]
        lines.insert(1, "-" * len(lines[0]))
        return "\n".join(lines)

    def summary(self) -> dict[str, Any]:
        """What goes into logs and trainer_state.json."""
        e = self.estimate
        return {
            "stage": self.candidate.stage,
            "offload": self.candidate.offload,
            "offload_params": self.candidate.offload_params,
            "reason": self.reason,
            "pinned": self.pinned,
            "justification": self.justification,
            "estimate_bytes": {
                "params": e.params,
                "grads": e.grads,
                "optimizer": e.optimizer,
                "activations": e.activations,
                "step": e.step,
                "buffers": e.buffers,
                "total": e.total,
                "host_per_node": e.host,
                "checkpoint_snapshot_per_node": e.snapshot,
                "gathered_layer": e.gather,
            },
            "budget_bytes": self.budget,
            "device_memory_bytes": self.device_memory,
            "world_size": self.world_size,
            "precision": self.precision,
        }


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


def plan(
    exp: Experiment,
    info: ModelInfo,
    *,
    world_size: int,
    gpus_per_node: int,
    device_type: str,
    device_memory: int,
    host_memory: int | None,
    precision: str,
    template: Mapping[str, Any] | None = None,
    force: bool = False,
) -> Plan:
    """Estimate every candidate and choose by the escalation rules (see module docstring).

    Raises UserError when a pinned candidate is above the rules' choice without a justification,
    or is predicted not to fit (unless `force`), or when nothing fits."""
    s = exp.strategy
    lp = low_precision_bytes(precision)
    budget = int(device_memory * s.headroom)
    pinned = pinned_choice(exp, template)
    act = activations_for(exp, info, lp, exp.model.chunked_loss)
    estimates = estimate_all(
        exp, info, pinned, act=act, lp=lp, world_size=world_size, gpus_per_node=gpus_per_node,
        on_gpu=device_type == "cuda", budget=budget, host_memory=host_memory, template=template,
    )  # fmt: skip
    by = {e.candidate: e for e in estimates}
    auto_choice = next((c for c in LADDER if by[c].fits), None)
    is_pinned = pinned[0] is not None or pinned[1] is not None
    options = _options(by, pinned)
    chosen = next((c for c in options if by[c].fits), None)
    hint = _chunked_loss_hint(
        exp, info, act - activations_for(exp, info, lp, True), budget, [by[c] for c in LADDER]
    )
    if chosen is None:
        if not (is_pinned and force and options):
            raise _no_fit(
                exp, by, options if is_pinned else [], auto_choice, hint, budget, device_memory, world_size
            )
        chosen = options[0]
    return Plan(
        candidate=chosen,
        reason=_reason(exp, by, chosen, auto_choice, is_pinned, hint, budget),
        estimates=tuple(estimates),
        budget=budget,
        device_memory=device_memory,
        host_memory=host_memory,
        world_size=world_size,
        gpus_per_node=gpus_per_node,
        precision=precision,
        device_type=device_type,
        pinned=is_pinned,
        justification=s.justification.strip(),
        auto_choice=auto_choice,
    )


def activations_for(exp: Experiment, info: ModelInfo, lp: int, chunked_loss: bool) -> int:
    m = exp.model
    return activations(
        info, exp.train.micro_batch_size, exp.data.seq_len, lp, m.activation_checkpointing, chunked_loss,
        m.kernels, compiled=exp.train.compile,
    )  # fmt: skip


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
) -> list[Estimate]:
    """An estimate per candidate of the table (plus stage 3 with only the optimizer offloaded, when
    the experiment pins that)."""
    want_stage, want_offload, offload_params = pinned
    state_bytes = OPTIMIZERS[exp.optim.name].state_bytes
    table = list(TABLE)
    if want_stage == 3 and want_offload not in (None, "none") and not offload_params:
        table.insert(table.index(_c(3, want_offload)), Candidate(3, want_offload, False))
    out = []
    # what the optimizer step allocates (`step_bytes`) depends on the candidate through its offload
    sub_group = _number(zero_section(template).get("sub_group_size"), SUB_GROUP_SIZE)
    adam = OPTIMIZERS[exp.optim.name].adam
    trainable = info.params if info.trainable is None else info.trainable
    largest_tensor = max(info.param_sizes, default=info.largest_layer)
    for c in table:
        persistent = 0
        if c.stage == 3:
            threshold = zero_sizes(info, zero_section(template))["stage3_param_persistence_threshold"]
            persistent = sum(x for x in info.param_sizes if x <= threshold)
        par, grad, opt = model_states(
            c,
            info.params,
            info.largest_layer,
            world_size,
            lp,
            exp.train.grad_accum,
            state_bytes,
            info.trainable,
            persistent,
        )
        buf = buffers(c, info, lp, on_gpu, template)
        impl = optimizer_implementation(exp.optim.implementation, "cuda" if on_gpu else "cpu", c.offload)
        fused_wrapper = adam and impl == "deepspeed"  # DeepSpeed's FusedAdam
        step = step_bytes(c, trainable, world_size, lp, fused_wrapper, largest_tensor, sub_group)
        host = host_needs(c, info.params, info.largest_layer, world_size, gpus_per_node, info.trainable)
        snap = 0
        if exp.checkpoint.async_ is not False:
            snap = snapshot_bytes(c, info.params, world_size, gpus_per_node, lp, state_bytes, info.trainable,
                                  exp.model.checkpoints_hold_frozen)  # fmt: skip
        # checkpoint.async: true needs the copy's room; auto goes synchronous where it would not fit
        need = host + snap if exp.checkpoint.async_ is True else host
        nvme_ok = c.offload != "nvme" or bool(exp.strategy.nvme_path) or want_offload == "nvme"
        e = Estimate(
            c, par, grad, opt, act, buf, host + snap,
            fits_host=host_memory is None or need <= host_memory,  # None: a target machine, not known
            gather=4 * info.largest_layer if c.stage == 3 else 0,
            snapshot=snap,
            step=step,
        )  # fmt: skip
        out.append(dataclasses.replace(e, fits_device=e.total <= budget and nvme_ok))
    return out


def _options(by: dict[Candidate, Estimate], pinned: tuple[int | None, str | None, bool]) -> list[Candidate]:
    """The candidates to choose from, cheapest first: the ladder; or, when the experiment pins a
    stage or an offload, the candidates with that part fixed (stage 1 only when named)."""
    want_stage, want_offload, offload_params = pinned
    if want_stage is None and want_offload is None:
        return list(LADDER)
    return sorted(
        (
            c
            for c in by
            if (want_stage is None or c.stage == want_stage)
            and (want_offload is None or c.offload == want_offload)
            and (c.stage != 1 or want_stage == 1)
            and (c.stage < 3 or c.offload == "none" or c.offload_params == offload_params)
        ),
        key=lambda c: c.cost,
    )


def _no_fit(
    exp: Experiment,
    by: dict[Candidate, Estimate],
    pinned_options: list[Candidate],
    auto_choice: Candidate | None,
    hint: str,
    budget: int,
    device_memory: int,
    world_size: int,
) -> UserError:
    """The error when the pinned candidate (`pinned_options[0]`), or anything at all, does not fit."""
    headroom = exp.strategy.headroom
    if pinned_options:
        c, e = pinned_options[0], by[pinned_options[0]]
        msg = (
            f"strategy: the pinned {c.name} is predicted not to fit: {format_size(e.total)} per rank "
            f"(host {format_size(e.host)}) against {format_size(budget)} usable of {format_size(device_memory)}. "
            + (
                f"The rules would pick {auto_choice.name}; set strategy.zero_stage/offload: auto. "
                if auto_choice
                else ""
            )
            + "Pass --force to run anyway."
        )
    else:
        msg = (
            f"strategy: nothing fits in {format_size(budget)} per rank ({format_size(device_memory)} x headroom "
            f"{headroom}) on {world_size} rank(s): lower train.micro_batch_size or data.seq_len, set "
            "model.activation_checkpointing: true, add ranks, or give strategy.nvme_path for NVMe offload."
        )
    return UserError(
        msg
        + (f" Or {hint}." if hint else "")
        + "\n\n"
        + _table_for(by, budget, device_memory, headroom, world_size)
    )


def _reason(
    exp: Experiment,
    by: dict[Candidate, Estimate],
    chosen: Candidate,
    auto_choice: Candidate | None,
    is_pinned: bool,
    hint: str,
    budget: int,
) -> str:
    """Why `chosen`: the first rung that fits (and what the rungs below need), or pinned (and, above
    the rules' choice, the justification it requires)."""
    s = exp.strategy
    e = by[chosen]
    use = f"{format_size(e.total)} of {format_size(budget)} per rank"
    if not is_pinned:
        skipped = LADDER[: LADDER.index(chosen)]
        why = "; ".join(
            f"{c.name} needs {format_size(by[c].total)}" + (" (host)" if by[c].fits_device else "")
            for c in skipped
        )
        return (
            f"{chosen.name} is the first rung that fits ({use})"
            + (f"; {why}" if why else "")
            + (f"; {hint}" if hint else "")
        )
    reason = f"{chosen.name} pinned by the experiment ({use})"
    if auto_choice is not None and chosen.cost > auto_choice.cost:
        if not s.justification.strip():
            raise UserError(
                f"strategy: {chosen.name} is pinned, but the cheaper {auto_choice.name} fits "
                f"({format_size(by[auto_choice].total)} of {format_size(budget)} per rank). Set "
                f"strategy.zero_stage/offload to auto to use {auto_choice.name}, or say why in "
                "strategy.justification."
            )
        reason += f"; the rules would pick {auto_choice.name}; justification: {s.justification.strip()}"
    if not e.fits:
        reason += "; predicted NOT to fit (--force)"
    return reason


def _chunked_loss_hint(
    exp: Experiment, info: ModelInfo, saved: int, budget: int, ladder: list[Estimate]
) -> str:
    """When the whole logits cost a rung of the ladder (or every rung): what model.chunked_loss
    would save (`saved` bytes per rank), and the rung that would then fit. Empty when it would
    change nothing."""
    if exp.model.chunked_loss or exp.model.factory is not None or chunked_loss_problem(info.model_type):
        return ""
    for e in ladder:
        if e.fits or e.candidate.offload == "nvme":
            return ""  # the rungs below the chosen one would not fit even without the logits
        if e.fits_host and dataclasses.replace(e, activations=e.activations - saved).total <= budget:
            return (
                f"set model.chunked_loss: true (no whole logits: {format_size(saved)} less per rank) "
                f"and {e.candidate.name} fits"
            )
    return ""


def _table_for(
    by: dict[Candidate, Estimate], budget: int, device_memory: int, headroom: float, world: int
) -> str:
    plan_ = Plan(
        candidate=Candidate(-1),
        reason="",
        estimates=tuple(by.values()),
        budget=budget,
        device_memory=device_memory,
        host_memory=0,
        world_size=world,
        gpus_per_node=1,
        precision="",
        device_type="",
    )
    return (
        plan_.table()
        + f"\nusable per rank: {format_size(budget)} ({format_size(device_memory)} x {headroom})"
    )


def pinned_choice(exp: Experiment, template: Mapping[str, Any] | None) -> tuple[int | None, str | None, bool]:
    """(stage, offload, offload_params) that the experiment or its template fixes; None = free."""
    s = exp.strategy
    stage = None if s.zero_stage == "auto" else s.zero_stage
    offload = None if s.offload == "auto" else s.offload
    offload_params = True
    zero = (template or {}).get("zero_optimization")
    if isinstance(zero, Mapping):
        t_stage = zero.get("stage")
        if stage is None and isinstance(t_stage, int) and not isinstance(t_stage, bool):
            stage = t_stage
        opt_dev = device_of(zero.get("offload_optimizer"))
        par_dev = device_of(zero.get("offload_param"))
        if offload is None and opt_dev is not None:
            offload = opt_dev
        if par_dev in (None, "none") and opt_dev not in (None, "none"):
            offload_params = False
    return stage, offload, offload_params


def device_of(section: Any) -> str | None:
    """The device an offload section of a DeepSpeed JSON names (None: none given, or "auto")."""
    if isinstance(section, Mapping):
        dev = section.get("device")
        return dev if isinstance(dev, str) and dev != "auto" else None
    return None


def describe_plan(plan_: Plan) -> str:
    mem = f"{format_size(plan_.device_memory)} {plan_.device_type} memory x headroom -> {format_size(plan_.budget)} usable per rank"
    host = (
        f"host memory {format_size(plan_.host_memory)} per node"
        if plan_.host_memory is not None
        else "host memory not checked (set strategy.host_memory for the target machine)"
    )
    snap = plan_.estimate.snapshot
    if snap:
        host += (
            f" (host/node counts the copy an asynchronous save takes, checkpoint.async: {format_size(snap)})"
        )
    return (
        f"{plan_.table()}\n\n{mem}; {host}; world size {plan_.world_size} ({plan_.gpus_per_node} per node); "
        f"precision {plan_.precision}\ndecision: {plan_.candidate.name}: {plan_.reason}"
    )


def next_rung(stage: int, offload: str) -> tuple[int, str] | None:
    """(stage, offload) of the rung above a failed candidate, for the run-time escalation (stage 1,
    not a rung, escalates to 2; 2+cpu to 3+cpu). None on the last rung."""
    off_ladder = {(1, "none"): (2, "none"), (2, "cpu"): (3, "cpu")}
    if (stage, offload) in off_ladder:
        return off_ladder[(stage, offload)]
    rungs = [(c.stage, c.offload) for c in LADDER]
    if (stage, offload) not in rungs:
        return None
    i = rungs.index((stage, offload)) + 1
    return rungs[i] if i < len(rungs) else None
