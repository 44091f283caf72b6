"""One decoder layer of each family, counted from the model's shape (ModelInfo, read from its config and module
by trainer/model/shape.py): what it keeps for backward a token (`saved`), what its key/value cache holds a
token (`cache_per_token`), and the FLOPs a token costs (`flops_per_token`).

A layer keeps, a token (lp bytes a value in the compute precision, 4 in fp32):

- the tensor its projections read, before attention and before the MLP (a norm's output, or the residual
  stream where the norms come after the blocks: OLMo 2), lp x hidden each;
- each RMSNorm its input in fp32 (4 a value), one fp32 factor a row, and its normalised value for the weight's
  gradient: in the compute precision (Llama's), in fp32 where the family scales in fp32 (Gemma 3, OLMo 2), none
  where the weight is frozen (LoRA); Liger's keeps its input alone; GPT-2's LayerNorm its input and two
  statistics a row. Query and key norms (Qwen3, Gemma 3: over each head; OLMo 2: over the projection) count
  over the queries' and keys' widths (heads x head_dim, the config's own head size);
- attention (`attention_bytes`): the kernels that never form the scores (sdpa's flash and memory-efficient
  kernels, the CPU's flash kernel, varlen, flash_attention_2) keep queries, keys, values, their output and a
  log-sum-exp a head; where sdpa gets a mask (a sliding window no longer than the sequence, packed or padded
  rows) the float copy of it each call makes (a row of the sequence a token and layer), and keys and values
  repeated to every query head where they are grouped (transformers' repeat_kv); on CUDA sdpa's output is copied
  once more for the output projection. Eager attention keeps the scores a query head sees (the whole
  sequence, windows or not: the window is a mask on them): its fp32 softmax and the copy in the compute
  precision, each query head's keys and values, and the output's copy the output projection reads. On CPU,
  sdpa with value heads of another size (DeepSeek's latent attention) runs the math kernel: the scores and
  its operands in fp32;
- a gated MLP: gate, up, the activation's output and their product (4 x intermediate); GPT-2's MLP: its
  input to the activation and its output (gelu_new: three more temporaries). With LoRA a frozen projection
  keeps no input for its weight's gradient unless an adapter reads it (`keeps`);
- a mixture of experts (transformers' grouped_mm experts, its default): the router's input and scores (fp32,
  a value an expert), the top-k's indices and their sort (int64), and for each of a token's k experts its
  copy of the input, the gate/up output, the activation's output and the product (gpt-oss's clamped GLU: five
  temporaries), the weighted output; shared experts as a gated MLP of their width.

Every term was held against a census of what autograd saves (saved-tensor hooks, each storage once) for each
family of the family matrix, in bf16 and fp32, with sdpa and eager attention (tests/unit/test_plan_census.py).
What a family does differently from Llama is `FAMILIES`' (transformers' modeling code, read and measured); a
family not listed is counted as Llama's layout (the plan says so: `family_note`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

F32 = 4


@dataclass(frozen=True)
class Family:
    """What a family's transformers code keeps differently from Llama's (each checked by the census)."""

    # rms: normalised in fp32, scaled in the compute precision; rms32: scaled in fp32; layer: LayerNorm
    norm: str = "rms"
    linear_norms: int = 2  # norms a projection reads the output of (before attention, before the MLP)
    residual_norms: int = 0  # norms of a block's output, added to the residual stream (Gemma 3, OLMo 2)
    fused_values: bool = False  # the values a view of the fused q/k/v projection's output, kept whole (Phi-3)
    attention_copy: bool = False  # sdpa's output copied before the output projection reads it (Phi-3)
    softmax32: bool = True  # eager attention's softmax in fp32, then cast to the compute precision
    sinks: bool = False  # eager attention over one more column a head (gpt-oss), softmax as computed
    gate_temps: int = 2  # a gated MLP's tensors beside gate and up: the activation's output and the product
    router32: bool = False  # the router reads an fp32 copy of its input (DeepSeek-V3)
    local_rope: bool = False  # sliding layers rotate by a rotary table of their own (Gemma 3's local base)


FAMILIES: dict[str, Family] = {
    **dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe"), Family()),
    "phi3": Family(fused_values=True, attention_copy=True),
    "gemma3_text": Family(norm="rms32", residual_norms=2, local_rope=True),
    "olmo2": Family(norm="rms32", linear_norms=0, residual_norms=2),
    "gpt2": Family(norm="layer", softmax32=False),
    "gpt_oss": Family(norm="rms32", sinks=True, softmax32=False, gate_temps=5),
    "deepseek_v3": Family(router32=True),
}
LLAMA = Family()
# Activation functions that keep temporaries of the MLP's width beside their input (GPT-2's gelu_new: 8
# elementwise operations, three of whose results backward reads)
ACTIVATION_TEMPS = {"gelu_new": 3}


def family(info: Any) -> Family:
    return FAMILIES.get(info.model_type or "", LLAMA)


def family_note(info: Any) -> str | None:
    """Why the plan's layer count may be off for this model: a family the census has not held (None: it has)."""
    if info.model_type in FAMILIES or not info.hidden:
        return None
    what = f"model type '{info.model_type}'" if info.model_type else "a model without a model type"
    return (
        f"{what}: its layers' activations are counted as a Llama layer of its shape (a family not held against "
        "a census here)"
    )


def describe_shape(info: Any) -> str:
    """--plan's line: the shape the plan counts the layers from, and the note of a family it has not verified."""
    if not (info.hidden and info.layers):
        return ""
    parts = [f"{info.layers} layers of hidden {info.hidden}", f"{info.heads} heads of {info.qk_head_dim}"
             + (f" (values {info.value_head_dim})" if info.value_head_dim != info.qk_head_dim else "")
             + (f", {info.kv_count} key/value heads" if info.kv_count != info.heads else "")]  # fmt: skip
    if info.latent:
        parts.append(f"latent attention (q rank {info.latent[0]}, kv rank {info.latent[1]})")
    if info.qk_norm:
        parts.append(f"query/key norms per {info.qk_norm}")
    windows = [w for w in info.windows if w]
    if windows:
        sizes = ", ".join(str(w) for w in sorted(set(windows)))
        parts.append(f"{len(windows)} of {len(info.windows)} layers windowed ({sizes} tokens)")
    e = info.experts
    if e:
        parts.append(f"experts: {e.per_token} of {e.routed} (width {e.width}) in {e.layers} layers"
                     + (f", shared width {e.shared_width}" if e.shared_width else ""))  # fmt: skip
    elif info.intermediate:
        parts.append(f"gated MLP of {info.intermediate}")
    if info.tied:
        parts.append("tied embeddings")
    note = family_note(info)
    return "shape: " + "; ".join(parts) + (f" ({note})" if note else "")


def _norm(f: Family, width: float, rows: float, lp: int, frozen: bool, kernels: str) -> float:
    """What one norm over `width` values keeps a token (`rows` of them a token: heads for a per-head norm)."""
    if f.norm == "layer":
        return lp * width + 2 * F32 * rows
    if kernels == "liger":
        return lp * width + F32 * rows
    scaled = 0 if frozen else (F32 if f.norm == "rms32" else lp) * width
    return F32 * width + scaled + F32 * rows


def masked(info: Any, window: int, seq_len: int, packed: bool, ulysses: bool = False) -> bool:
    """Whether sdpa gets a mask on a layer: a window no longer than the sequence (transformers skips it only for
    a sequence shorter than the window), or packed rows' examples (not under sequence parallelism, whose
    attention keeps examples and windows apart itself: model/sequence.py)."""
    return (
        not ulysses and (info.attn_implementation or "sdpa") == "sdpa" and (packed or 0 < window <= seq_len)
    )


# the projections whose inputs a layer keeps for their weights' gradients, by the leaf names LoRA targets: a frozen
# projection keeps its input only where an adapter reads it (model.lora; every weight trains without it)
READS_LAYER_INPUT = ("q_proj", "k_proj", "v_proj", "qkv_proj", "c_attn", "q_a_proj", "kv_a_proj_with_mqa")
READS_ATTENTION = ("o_proj", "c_proj")
READS_MLP_INPUT = ("gate_proj", "up_proj", "gate_up_proj", "c_fc", "gate", "router")
READS_PRODUCT = ("down_proj", "c_proj")


def keeps(adapted: frozenset[str] | None, names: tuple[str, ...]) -> bool:
    """Whether the input these projections read is kept: every weight trains (`adapted` None), or an adapter
    (or model.lora.train_modules) reads it."""
    return adapted is None or any(n in adapted for n in names)


def attention_bytes(
    info: Any, lp: int, seq_len: int, window: int, *, frozen: bool = False, kernels: str = "none",
    packed: bool = False, device: str = "cuda", ulysses: bool = False, adapted: frozenset[str] | None = None,
) -> float:  # fmt: skip
    """What one layer's attention keeps a token: its input, its norms, the kernel's (module doc). `ulysses`:
    under sequence parallelism, the output the all-to-all brings back is the copy the output projection reads.
    `adapted` (LoRA): the projections an adapter reads the input of (frozen ones keep none)."""
    f, h, heads = family(info), info.hidden or 0, info.heads or 1
    kv, hd, vd = info.kv_count, info.qk_head_dim, info.value_head_dim
    q, kw, vw, o = heads * hd, kv * hd, kv * vd, heads * vd
    total = lp * h if keeps(adapted, READS_LAYER_INPUT) else 0.0  # what the projections read
    total += _norm(f, h, 1, lp, frozen, kernels) * (min(f.linear_norms, 1) + min(f.residual_norms, 1))
    if info.qk_norm == "head":
        total += _norm(f, q, heads, lp, frozen, kernels) + _norm(f, kw, kv, lp, frozen, kernels)
    elif info.qk_norm == "projection":
        total += _norm(f, q, 1, lp, frozen, kernels) + _norm(f, kw, 1, lp, frozen, kernels)
    if info.latent:  # DeepSeek: the compressed queries and keys/values, normed, read by their up-projections
        q_rank, kv_rank, _ = info.latent
        for rank, reader in ((q_rank, "q_b_proj"), (kv_rank, "kv_b_proj")):
            if rank:
                total += _norm(f, rank, 1, lp, frozen, kernels) + (
                    lp * rank if keeps(adapted, (reader,)) else 0
                )
    out = lp * o if keeps(adapted, READS_ATTENTION) else 0.0  # the output's copy the output projection reads
    implementation = info.attn_implementation
    grouped = 1 < kv < heads  # repeat_kv copies (one key/value head: a view of it)
    if implementation == "eager" or (device == "cpu" and implementation in (None, "sdpa") and hd != vd):
        math = implementation != "eager"  # sdpa's math kernel on CPU: operands and scores in fp32
        width = F32 if math else lp
        k_kept, v_kept = (q, o) if grouped or math else (kw, vw)
        keys = seq_len + (1 if f.sinks else 0)
        score = F32 if math else (F32 + (lp if lp < F32 else 0) if f.softmax32 else lp)
        total += heads * keys * score + (8 * heads if f.sinks else 0)
        total += width * (q + k_kept + v_kept) + (lp * (q + kw) if f.fused_values and not grouped else 0)
        return total + out  # the output, transposed into the copy the output projection reads
    mask = masked(info, window, seq_len, packed, ulysses)
    expand = grouped and mask
    # sdpa's float copy of the mask, a row a token, made and kept each call; q, k and v (repeated where masked)
    total += (lp * seq_len if mask else 0) + lp * (q + (q if expand else kw) + (o if expand else vw))
    # the rest of the fused projection's output the values' view keeps
    total += lp * (q + kw) if f.fused_values and not expand else 0
    # the output (a view of it is what the projection reads) and a log-sum-exp a head
    total += lp * o + F32 * heads
    # the output copied before the output projection reads it: on CUDA sdpa's kernels leave it head by head
    # (an H100's peaks: Llama 1B); on CPU its flash kernel leaves it token by token, but for Phi-3's layout
    copied = f.attention_copy or ulysses or (device == "cuda" and implementation in (None, "sdpa"))
    return total + (out if copied else 0)


def mlp_norms(info: Any, lp: int, *, frozen: bool = False, kernels: str = "none") -> float:
    """What the norms around a layer's MLP keep a token (before it, and of its output where the family has one)."""
    f = family(info)
    count = max(f.linear_norms - 1, 0) + max(f.residual_norms - 1, 0)
    return count * _norm(f, info.hidden or 0, 1, lp, frozen, kernels)


def mlp_bytes(
    info: Any, lp: int, moe: bool, *, kernels: str = "none", adapted: frozenset[str] | None = None
) -> float:
    """What one layer's MLP module (or mixture of experts) keeps a token: the tensor it reads and its own (what
    the tiled MLP keeps only the input of). The activation's output and the product are its `gate_temps`; the
    product and the input are kept for the weights' gradients only, so a frozen MLP (LoRA's, unless adapted; a
    mixture's experts and router under LoRA) keeps neither."""
    f, h, e = family(info), info.hidden or 0, info.experts
    total = lp * h if keeps(adapted, READS_MLP_INPUT) else 0.0
    product = keeps(adapted, READS_PRODUCT)
    if moe and e:
        k, trains = e.per_token, adapted is None  # the experts' 3-D weights: adapted by no LoRA here
        total += (F32 * h if f.router32 and trains else 0) + F32 * e.routed  # the router's input and scores
        total += 32 * k + 2 * F32 * k  # the top-k's indices, their sort and its inverse; the weights
        # each of a token's experts: its copy of the input, gate/up, the activation's temporaries, the product, the
        # output (read by the weighting)
        each = 2 * e.width + (f.gate_temps - (0 if trains else 1)) * e.width + h + (h if trains else 0)
        return total + k * lp * each + lp * e.shared_width * (2 + f.gate_temps - (0 if product else 1))
    if info.intermediate:
        temps = (1 if kernels == "liger" else f.gate_temps) - (0 if product else 1)
        return total + lp * info.intermediate * (2 + temps)
    width = 4 * h  # GPT-2's MLP: its input to the activation, the activation's temporaries and output
    return total + lp * width * (1 + ACTIVATION_TEMPS.get(info.activation or "", 0) + (1 if product else 0))


@dataclass(frozen=True)
class Saved:
    """What the layers keep for backward a token (training forward, no lever on)."""

    layers: tuple[float, ...]  # each layer's bytes a token
    mlp: tuple[float, ...]  # of which its MLP module's (the tiled MLP keeps its input instead)
    shared: float = 0.0  # bytes a token beside the layers': rotary tables, boolean masks, the routers' logits

    @property
    def total(self) -> float:
        return sum(self.layers) + self.shared


def moe_layers(info: Any) -> tuple[bool, ...]:
    """Which layers have experts: the last `experts.layers` of them (DeepSeek's dense layers come first)."""
    n = info.layers or 0
    moe = info.experts.layers if info.experts else 0
    return tuple(i >= n - moe for i in range(n))


@functools.lru_cache(maxsize=4096)
def saved(
    info: Any, lp: int, seq_len: int, *, frozen: bool = False, kernels: str = "none", packed: bool = False,
    device: str = "cuda", ulysses: bool = False, adapted: frozenset[str] | None = None,
) -> Saved:  # fmt: skip
    """Each layer's bytes a token at `seq_len` tokens a row (see the module's doc); counted once a kind of layer
    (its window, experts or not), the planner asking for thousands of settings of one model. `frozen`: the norms'
    weights are frozen; `adapted`: LoRA's, the projections an adapter reads (None: every weight trains)."""
    windows = info.windows or (0,) * (info.layers or 0)
    moe = moe_layers(info) + (False,) * max(0, len(windows) - (info.layers or 0))
    norms = mlp_norms(info, lp, frozen=frozen, kernels=kernels)
    kinds: dict[tuple[int, bool], tuple[float, float]] = {}
    for kind in set(zip(windows, moe, strict=False)):
        m = mlp_bytes(info, lp, kind[1], kernels=kernels, adapted=adapted)
        a = attention_bytes(info, lp, seq_len, kind[0], frozen=frozen, kernels=kernels, packed=packed, device=device,
                            ulysses=ulysses, adapted=adapted)  # fmt: skip
        kinds[kind] = (a + norms + m, m)
    each = [kinds[kind] for kind in zip(windows, moe, strict=False)]
    # transformers' boolean masks (a byte a row of the sequence a token), one a kind of masked layer: kept from the
    # forward through the backward where activation checkpointing recomputes the layers from them
    masks = {w if 0 < w <= seq_len else 0 for w in windows if masked(info, w, seq_len, packed, ulysses)}
    return Saved(
        tuple(x for x, _ in each), tuple(m for _, m in each),
        rotary(info, lp) + len(masks) * seq_len + router_logits(info, lp),
    )  # fmt: skip


def router_logits(info: Any, lp: int) -> float:
    """output_router_logits (the auxiliary loss): each expert layer's router logits returned with the output, and
    the loss's softmax of them and its top-k indices kept for backward (transformers' load_balancing_loss_func, a
    layer at a time), a token."""
    e = info.experts
    return float(e.layers * (2 * lp * e.routed + 8 * e.per_token)) if e and info.router_logits else 0.0


def rotary(info: Any, lp: int) -> float:
    """The rotary tables (cos and sin, a head's width a token), once a forward for every layer: one table, or
    one for the sliding layers and one for the full ones (Gemma 3); none for GPT-2's learned positions."""
    if info.model_type == "gpt2" or info.latent:
        return 0.0
    kinds = len({w > 0 for w in info.windows}) if family(info).local_rope else 1
    return float(kinds * 2 * info.qk_head_dim * lp)


def cache_per_token(info: Any, lp: int, length: int, windowed: bool = True) -> float:
    """The key/value cache of one row of `length` tokens, a token: every layer's keys and values (kv heads x
    the config's head sizes), a sliding or chunked layer's for its window once decoding has begun
    (transformers' DynamicSlidingWindowLayer keeps a view of the last window - 1 tokens of a window's
    storage); not `windowed`: right after the prompt's forward, when that view still holds the whole prompt.
    DeepSeek's latent attention caches the compressed keys/values and the rotary keys, one head's worth."""
    per = layer_cache_per_token(info, lp)
    windows = info.windows or (0,) * (info.layers or 0)
    held = sum(min(length, w) if w and windowed else length for w in windows)
    return per * held / max(length, 1)


# kernels that skip the blocks a sliding window masks (eager and sdpa compute every score, then mask them)
WINDOWED = {"varlen", "flash_attention_2", "flash_attention_3"}


def layer_cache_per_token(info: Any, lp: int) -> float:
    """One layer's cache a token: its keys and values (or DeepSeek's latent and rotary keys)."""
    if info.latent:
        return (info.latent[1] + info.latent[2]) * lp
    return info.kv_count * (info.qk_head_dim + info.value_head_dim) * lp


@functools.lru_cache(maxsize=4096)
def attention_flops(info: Any, seq_len: int) -> float:
    """Attention's score and output products a token, forward and backward (the PaLM paper's 12 L H Q T):
    6 x heads x (the query/key head + the value head) x the keys a query is scored against, a layer: the whole
    sequence, or a sliding window's at most with the kernels that skip what it masks (`WINDOWED`)."""
    heads, hd, vd = info.heads or 0, info.qk_head_dim, info.value_head_dim
    windows = info.windows or (0,) * (info.layers or 0)
    skips = info.attn_implementation in WINDOWED
    return sum(6 * heads * (hd + vd) * (min(seq_len, w) if w and skips else seq_len) for w in windows)


@functools.lru_cache(maxsize=4096)
def flops_per_token(info: Any, seq_len: int) -> float:
    """The FLOPs a token of a training step: 2 N forward, 2 N for the activations' gradients, 2 N_trainable for
    the weights' (N: the parameters a token multiplies by: a mixture of experts' top-k of its experts, not all of
    them, and no embedding that is only looked up: an untied input embedding, GPT-2's positions), and attention
    (`attention_flops`). LoRA: only the adapters get weight gradients. Within 0.3% of torch's FlopCounterMode
    over every family (eager attention, eager experts: tests/unit/test_plan_census.py)."""
    n = (info.active or info.params) - info.idle
    trainable = n if info.trainable is None else info.trainable
    return 4 * n + 2 * trainable + attention_flops(info, seq_len)


@functools.lru_cache(maxsize=256)
def mlp_flops(info: Any) -> float:
    """A token's forward FLOPs in the MLPs (what the tiled MLP computes again): a gated MLP's three products, GPT-2's
    two, a mixture of experts' router and the top-k experts' (and the shared ones')."""
    h, total = info.hidden or 0, 0.0
    for moe in moe_layers(info):
        e = info.experts
        if moe and e:
            total += 2 * h * (e.routed + 3 * (e.per_token * e.width + e.shared_width))
        else:
            total += 2 * h * (3 * info.intermediate if info.intermediate else 8 * h)
    return total
