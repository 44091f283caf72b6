"""What is planned for: the model's facts (`ModelInfo`), the candidates (a ZeRO stage plus where
optimizer states and parameters live), the escalation ladder they are tried in (`LADDER`; `TABLE`,
every candidate the plan shows), the rung above a failed one (`next_rung`) and what the experiment or
its DeepSpeed template pins (`pinned_choice`). Also `GiB`, the unit the fixed sizes are written in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainer.config import Experiment
from trainer.strategy.planning.images import Vision

GiB = 2**30


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
    ulysses: str | None = None  # why DeepSpeed's Ulysses cannot wrap this family's attention (None: it can)
    window: int | None = None  # sliding-window attention's window (Mistral, Gemma 3's local layers...)
    active: int | None = None  # a mixture of experts: parameters a token runs through (None: dense, all)
    chunked_problem: str | None = None  # why model.chunked_loss cannot serve this model and config
    quantized: Quantized | None = None  # model.lora.quantization's layers
    # the shape of a layer, read from the config and the module (trainer/model/shape.py; layers.py counts from it)
    head_dim: int | None = None  # a query/key head's size: the config's own (Qwen3), else hidden / heads
    v_head_dim: int | None = None  # a value head's size where it differs (DeepSeek's latent attention)
    qk_norm: str | None = None  # query/key RMSNorm: "head" (each head: Qwen3, Gemma 3), "projection" (OLMo 2)
    layer_windows: tuple[int, ...] = ()  # each layer's sliding window or chunk, 0 for full attention
    experts: Experts | None = None  # a mixture of experts' layers
    tied: bool = False  # the LM head is the input embedding
    activation: str | None = None  # the MLP's activation function (hidden_act)
    latent: tuple[int, int, int] | None = None  # DeepSeek's latent attention: q and kv ranks, rotary dims
    router_logits: bool = False  # output_router_logits: the routers' logits kept for the auxiliary loss
    idle: int = 0  # parameters a text token never multiplies by: looked-up embeddings, a vision tower
    qkv_bias: int = (
        0  # a layer's query, key and value biases, elements (Qwen2's; tensor parallelism divides them)
    )
    vision: Vision | None = None  # a vision-language model's tower, measured (images.py's image budget)

    @property
    def q_width(self) -> int:
        """Elements of a token's queries (heads x head size; the hidden size only where the head size says so)."""
        return (self.heads or 1) * self.qk_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.head_dim or (self.hidden or 0) // (self.heads or 1)

    @property
    def kv_count(self) -> int:
        """Key/value heads (as many as query heads without grouped-query attention)."""
        return self.kv_heads or self.heads or 1

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim or self.qk_head_dim

    @property
    def windows(self) -> tuple[int, ...]:
        """Each layer's window (0: full attention): the layers' own, else `window` on every layer."""
        return self.layer_windows or (self.window or 0,) * (self.layers or 0)


@dataclass(frozen=True)
class Experts:
    """A mixture of experts (Mixtral, Qwen3-MoE, gpt-oss, DeepSeek-V3), read from the config and the module."""

    routed: int  # experts a layer routes among
    per_token: int  # experts a token runs through (top-k)
    width: int  # an expert's intermediate size (moe_intermediate_size, else intermediate_size)
    layers: int  # layers with experts (the others: a dense MLP of ModelInfo.intermediate)
    shared_width: int = 0  # the shared experts' intermediate size, all of them together (0: none)


@dataclass(frozen=True)
class Quantized:
    """The frozen linear layers model.lora.quantization stores quantized (bitsandbytes)."""

    elements: int  # of all of them
    packed: float  # bytes an element takes packed (4-bit: 0.5), partitioned at ZeRO-3
    state: float  # quantization state, bytes an element (block absmax), whole on every rank
    per_layer: int  # quantization state, bytes a layer (the code tables, the offset)
    sizes: tuple[int, ...]  # each layer's elements

    @property
    def largest(self) -> int:
        return max(self.sizes, default=0)

    def state_bytes(self) -> float:
        return self.state * self.elements + self.per_layer * len(self.sizes)


# bitsandbytes' 4-bit blocks: an absmax per 64 elements, a nested one per 256 of those
BNB_BLOCK, BNB_NESTED_BLOCK = 64, 256


def nf4(sizes: tuple[int, ...], double_quant: bool = True) -> Quantized:
    """Linear layers of `sizes` elements in 4 bits (bitsandbytes' NF4): half a byte an element and the state:
    with double quantization the absmax in 8 bits, an fp32 absmax per 256 of them, NF4's code, the offset and the
    8-bit code table in fp32 a layer; without, an fp32 absmax per block."""
    if double_quant:
        return Quantized(
            sum(sizes), 0.5, 1 / BNB_BLOCK + 4 / (BNB_BLOCK * BNB_NESTED_BLOCK), 16 * 4 + 4 + 256 * 4, sizes
        )
    return Quantized(sum(sizes), 0.5, 4 / BNB_BLOCK, 16 * 4, sizes)


def describe_params(info: ModelInfo, lora: Any = None) -> str:
    """'N parameters', and with LoRA how many train and how many are frozen."""
    active = f" ({info.active:,} active a token: its top-k experts)" if info.active else ""
    if info.trainable is None:
        return f"{info.params:,} parameters{active}"
    what = f"LoRA r={lora.r}: " if lora is not None else ""
    quantized = ""
    if info.quantized and lora is not None:
        kind = f"4-bit {lora.quant_type}" if info.quantized.packed < 1 else "8-bit"
        quantized = (
            f", {info.quantized.elements:,} of them in {kind} ({info.quantized.packed:g} bytes each, packed)"
        )
    return (
        f"{info.params:,} parameters ({what}{info.trainable:,} trainable = {info.trainable / info.params:.2%}, "
        f"{info.params - info.trainable:,} frozen{quantized})"
    )


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
        """Position on the escalation ladder (`LADDER`): the device-only rungs by their communication,
        then offload by what crosses the host link."""
        return _COST.get(self, len(LADDER))

    @property
    def template(self) -> str:
        suffix = {"none": "", "cpu": "_offload", "nvme": "_nvme"}[self.offload]
        if self.stage == 3 and self.offload == "cpu" and not self.offload_params:
            suffix += "_optimizer"
        return f"zero{self.stage}{suffix}.json"

    def overrides(self) -> list[str]:
        """The --set overrides that pin this candidate (the run-time escalation's next attempt)."""
        pins = [f"strategy.zero_stage={self.stage}"]
        if self.offload != "none":
            pins.append(f"strategy.offload={self.offload}")
        if self.stage == 3 and self.offload != "none":
            pins.append(f"strategy.offload_params={str(self.offload_params).lower()}")
        return pins


def _c(stage: int, offload: str = "none", params: bool | None = None) -> Candidate:
    return Candidate(stage, offload, offload_params=stage == 3 and offload != "none" and params is not False)


# The escalation ladder, cheapest first: the device-only rungs (ZeRO-1 partitions the optimizer states,
# ZeRO-2 the gradients too, reduced at every micro step, ZeRO-3 the parameters, gathered in every pass), then
# offload (the optimizer beside ZeRO-2: ZeRO-Offload; beside ZeRO-3; ZeRO-3's parameters too; NVMe). The plan
# takes the fastest setting that fits with offload only when no device-only one does (ladder.py); every rung
# is in the table.
LADDER = (_c(0), _c(1), _c(2), _c(3), _c(2, "cpu"), _c(3, "cpu", False), _c(3, "cpu"), _c(3, "nvme"))
TABLE = LADDER
_COST = {c: i for i, c in enumerate(LADDER)}


def next_rung(stage: int, offload: str, offload_params: bool = True) -> Candidate | None:
    """The rung above a failed candidate on the ladder, for the run-time escalation. None on the last rung."""
    c = _c(stage, offload, offload_params)
    if c not in LADDER:
        return None
    i = LADDER.index(c) + 1
    return LADDER[i] if i < len(LADDER) else None


def pinned_choice(
    exp: Experiment, template: Mapping[str, Any] | None
) -> tuple[int | None, str | None, bool | None]:
    """(stage, offload, offload_params) that the experiment or its template fixes; None = free."""
    s = exp.strategy
    stage = None if s.zero_stage == "auto" else s.zero_stage
    offload = None if s.offload == "auto" else s.offload
    offload_params = None if s.offload_params == "auto" else bool(s.offload_params)
    zero = (template or {}).get("zero_optimization")
    if isinstance(zero, Mapping):
        t_stage = zero.get("stage")
        if stage is None and isinstance(t_stage, int) and not isinstance(t_stage, bool):
            stage = t_stage
        opt_dev = device_of(zero.get("offload_optimizer"))
        par_dev = device_of(zero.get("offload_param"))
        if offload is None and opt_dev is not None:
            offload = opt_dev
        if offload_params is None and opt_dev not in (None, "none"):
            offload_params = par_dev not in (None, "none")
    return stage, offload, offload_params


def device_of(section: Any) -> str | None:
    """The device an offload section of a DeepSpeed JSON names (None: none given, or "auto")."""
    if isinstance(section, Mapping):
        dev = section.get("device")
        return dev if isinstance(dev, str) and dev != "auto" else None
    return None
