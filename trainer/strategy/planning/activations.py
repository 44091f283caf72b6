"""Activation memory per rank: what the layers and the loss keep for backward, whatever the ZeRO
candidate (the same on every rung).

The ZeRO ladder (candidates.py) is one axis of what a run can change to fit; the levers here, which
shrink the activations rather than the model states, are the other: activation checkpointing,
`model.chunked_loss`, `model.kernels` and `train.compile` (`activations`), read from the experiment
by `activations_for`. `layer_bytes_per_token` is one layer's share per token.
"""

from __future__ import annotations

import math
from typing import Any

from trainer.config import Experiment, loss_chunk_rows
from trainer.strategy.planning.candidates import ModelInfo
from trainer.strategy.planning.generation import row_length
from trainer.strategy.planning.images import experiment_budget
from trainer.strategy.planning.layers import F32, family, saved

# torch.compile's layers keep more for backward than eager's (AOTAutograd's partitioner saves what
# it chose not to recompute): GPT-2 124M on an H100, bf16, micro 64 and 128 (BENCHMARKS.md), the
# measured peaks fit 1.21-1.36x the eager count; 1.3 keeps both within 10% and over.
COMPILED_LAYERS = 1.3


def layer_bytes_per_token(
    info: ModelInfo, lp: int, kernels: str = "none", *, seq_len: int = 0, lora: Any = None,
    masks: bool = False, device: str = "cuda", sp: int = 1,
) -> float:  # fmt: skip
    """Activation bytes one transformer layer keeps per token for backward, on average over the layers
    (layers.py counts each layer from the model's shape: its norms, attention by kernel and window, its MLP or
    experts; a frozen norm keeps no normalised value), with LoRA's adapters (`lora_bytes_per_token`).
    `kernels="liger"`: Liger's RMSNorm keeps only its 16-bit input and its SwiGLU recomputes silu in backward
    (measured on an H100: 32-35h for a Llama 1B against 39h counted)."""
    kept = saved(info, lp, seq_len, frozen=frozen_norms(lora), kernels=kernels, packed=masks, device=device,
                 ulysses=sp > 1, adapted=adapted_inputs(info, lora))  # fmt: skip
    return kept.total / max(len(kept.layers), 1) + lora_bytes_per_token(info, lora, lp)


# an adapted module's input width, by its name (Llama-style projections and GPT-2's); others: the hidden size
_INPUT = {"down_proj": "intermediate", "o_proj": "attention"}


def lora_targets(info: ModelInfo, lora: Any) -> list[str]:
    """The modules model.lora adapts: its target_modules, else the family's default (adapters.py's)."""
    if lora.target_modules:
        return [lora.target_modules] if isinstance(lora.target_modules, str) else list(lora.target_modules)
    if info.model_type == "gpt2" or not info.intermediate and not info.experts:
        return ["c_attn", "c_proj", "c_fc"]
    return ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapted_inputs(info: ModelInfo, lora: Any) -> frozenset[str] | None:
    """LoRA: the projections whose inputs stay kept for backward (an adapter, or model.lora.train_modules, reads
    them: layers.py's `keeps`); None without LoRA (every weight trains) or where the targets are a pattern
    (peft's "all-linear", a regex) this count cannot resolve, which keeps every input."""
    if lora is None:
        return None
    names = [*lora_targets(info, lora), *(getattr(lora, "train_modules", None) or ())]
    if any(not n.replace("_", "").isalnum() for n in names) or "all-linear" in names:
        return None
    return frozenset(n.rsplit(".", 1)[-1] for n in names)


def lora_bytes_per_token(info: ModelInfo, lora: Any, lp: int) -> float:
    """What LoRA adapters keep for backward per token and layer beyond the layer's own count: each adapter's
    A-product (r values, for B's gradient) and, with lora.dropout on, its input dropped out. peft's modules
    (`kernels: peft`) keep a dropped-out copy of the input (lp bytes an element) and its mask (1 byte); the
    fused branch (trainer/model/lora_kernels.py) keeps the mask alone and recomputes the copy in backward (the
    input itself the layer's count holds: its projections read it). Without dropout neither keeps a copy
    (peft's dropout is then the identity). Measured on CPU (tests/dist/test_lora.py's activation census)."""
    if lora is None or not info.hidden:
        return 0.0
    targets = lora_targets(info, lora)
    per_element = (
        0.0 if lora.dropout == 0 else (1.0 if getattr(lora, "kernels", "fused") == "fused" else 1.0 + lp)
    )
    widths = {"intermediate": info.intermediate or info.hidden, "attention": info.heads * info.value_head_dim
              if info.heads else info.hidden}  # fmt: skip
    total = 0.0
    for name in targets:
        total += widths.get(_INPUT.get(name, ""), info.hidden) * per_element + lora.r * lp
    if not info.intermediate and "c_proj" in targets:  # GPT-2's MLP c_proj reads the 4h intermediate
        total += 3 * info.hidden * per_element
    return total


def head_trains(lora: Any) -> bool:
    """Whether the LM head gets a gradient: always without LoRA; with it, only when model.lora.train_modules
    trains the head (or the embedding, which a tied head is)."""
    if lora is None:
        return True
    return any("lm_head" in m or "embed" in m for m in (getattr(lora, "train_modules", None) or ()))


def frozen_norms(lora: Any) -> bool:
    """Whether the norms' weights are frozen (LoRA, unless model.lora.train_modules trains them)."""
    return lora is not None and not any("norm" in m for m in (getattr(lora, "train_modules", None) or ()))


def frozen_input_bytes(info: ModelInfo, lora: Any, lp: int) -> float:
    """Per token: what the first layer does not keep when the embeddings are frozen (LoRA): its input does not
    require a gradient, so its first norm keeps no copy of it (an RMSNorm's fp32 copy, a LayerNorm's input)."""
    f = family(info)
    if (
        lora is None
        or not f.linear_norms
        or any("emb" in m for m in (getattr(lora, "train_modules", None) or ()))
    ):
        return 0.0
    return (lp if f.norm == "layer" else F32) * (info.hidden or 0)


def activations(
    info: ModelInfo,
    micro_batch: int,
    seq_len: int,
    lp: int,
    checkpointing: bool,
    chunked_loss: bool = False,
    kernels: str = "none",
    compiled: bool = False,
    sp: int = 1,
    tiled_mlp: bool = False,
    offload: bool = False,
    lora: Any = None,
    head_grad: bool = True,
    masks: bool = False,
    device: str = "cuda",
) -> int:
    """Activation bytes per rank: each layer's count of what it keeps (layers.py: from the model's shape, its
    attention by kernel -- eager's scores, sdpa's masks where `masks`: packed or padded rows -- and its MLP or
    experts) over s*b tokens; with activation checkpointing the layer inputs (lp*h a token and layer) plus the
    largest layer's full activations. Plus the logits for the loss: b*s*V*3*(lp + 4) bytes,
    that is the logits, their fp32 copy and its log-softmax, then in backward their gradients (18
    bytes per logit in bf16; measured on a GPU in BENCHMARKS.md). With `model.chunked_loss`, one chunk
    of rows instead: its fp32 logits and their low-precision gradient (twice, for the allocator), plus
    the saved gradients towards the hidden states (lp) and, where the head trains (`head_grad`: not a
    LoRA's frozen head, `head_trains`), the head's weight (fp32); with
    `model.kernels: liger` the chunked loss is Liger's fused linear cross-entropy: chunks of 16-bit
    logits (about V/h times fewer rows than tokens) and a 16-bit gradient of the head's weight.
    `compiled` (train.compile): each layer's activations `COMPILED_LAYERS` times eager's, and the whole
    logits' loss only the logits in the training precision (Inductor fuses the fp32 log-softmax and
    its gradient into the loss's kernels: 32.39 GiB measured where the eager count, 18 bytes a logit,
    gave 76 and refused the run).

    The sequence levers (levers.py): with sequence parallelism of degree `sp` a rank holds s/sp of
    every sequence, so every term is over s*b/sp tokens, plus one layer's attention across the whole
    sequence (`sequence_attention_bytes`; its own kernel: no mask);
    the tiled MLP keeps only the MLP's input (lp*h a token) where the layer kept its MLP's or experts'
    intermediates (layers.py's `Saved.mlp`); `offload` keeps
    the checkpointed layer inputs on the host (`host_activations`), two layers' of them in flight. `lora`
    (model.lora): its adapters' share per layer (`lora_bytes_per_token`), its frozen norms' normalised values
    not kept."""
    h, layers, v = info.hidden, info.layers, info.vocab
    if not (h and layers):
        return 0
    s, b = seq_len / max(1, sp), micro_batch
    kept = saved(info, lp, seq_len, frozen=frozen_norms(lora), kernels=kernels, packed=masks, device=device,
                 ulysses=sp > 1, adapted=adapted_inputs(info, lora))  # fmt: skip
    adapters = lora_bytes_per_token(info, lora, lp)
    per_layer = [
        x + adapters - ((m - lp * h) if tiled_mlp else 0) for x, m in zip(kept.layers, kept.mlp, strict=True)
    ]
    factor = COMPILED_LAYERS if compiled else 1.0
    if checkpointing:
        inputs = 2 if offload else layers  # the layer inputs on the device: all, or two in flight
        total = s * b * (lp * h * inputs + factor * max(per_layer) + kept.shared)
    else:
        total = s * b * (factor * sum(per_layer) + kept.shared - frozen_input_bytes(info, lora, lp))
    if sp > 1:
        total += sequence_attention_bytes(info, micro_batch, seq_len, lp, sp)
    if v and chunked_loss and kernels == "liger":
        rows = min(b * s, 1 << max(0, math.ceil(math.log2(max(1, b * s / math.ceil(v / h))))))
        total += 2 * rows * v * lp + b * s * h * lp + v * h * lp
    elif v and chunked_loss:
        rows = min(b * s, loss_chunk_rows(v))
        total += 2 * rows * v * (4 + lp) + b * s * h * lp + (v * h * 4 if head_grad else 0)
    elif v and compiled:
        total += b * s * v * lp
    elif v:
        total += 3 * b * s * v * (lp + 4)
    return int(total)


# Sequence parallelism's attention over the whole sequence, in "contexts" (s*b*h/sp values: the rank's
# heads over every token), one layer at a time: the all-to-all buffers of its query, key, value and
# output (4), and the sdpa core's backward (trainer/model/sequence.py: each example in its own call,
# no n x n mask): the gradients of the gathered query, key, value and output and the kernels' buffers
# (4). A sliding window shorter than the sequence runs in blocks of WINDOW_BLOCK queries, each keeping
# a copy of the key and value blocks its window reaches (1 + window / WINDOW_BLOCK of them) for
# backward, counted with every query head's (on CUDA grouped key/value heads are repeated there: its
# kernels that take a mask take no groups). Measured on CPU (tests/unit/test_sequence.py, a row of 4 packed examples): 6.8 contexts
# without a window and 12.1 with one of 1,024 at 32,768 tokens in fp32, with the output the layers'
# count holds (2 contexts).
SEQUENCE_ATTENTION_CONTEXTS = 8
SEQUENCE_ATTENTION_BACKWARD = 6  # of which alive only in a layer's backward (autograd saves none of it)
WINDOW_BLOCK = 512  # sliding-window attention: queries a call, against the blocks of keys the window reaches


def sequence_attention_bytes(info: ModelInfo, micro_batch: int, seq_len: int, lp: int, sp: int) -> int:
    """Bytes of one layer's attention across the whole sequence under sequence parallelism of degree
    `sp` (see SEQUENCE_ATTENTION_CONTEXTS): no term grows with seq_len squared."""
    contexts = SEQUENCE_ATTENTION_CONTEXTS
    if info.window and info.window < seq_len:
        contexts += 2 * (1 + math.ceil((info.window - 1) / WINDOW_BLOCK))
    return int(contexts * seq_len / sp * micro_batch * (info.q_width if info.heads else 0) * lp)


def host_activations(info: ModelInfo, micro_batch: int, seq_len: int, lp: int, sp: int = 1) -> int:
    """model.offload_activations: the checkpointed layer inputs held in host memory, per rank."""
    if not (info.hidden and info.layers):
        return 0
    return int(2 * seq_len / max(1, sp) * micro_batch * info.hidden * lp / 2 * info.layers)


def rows_per_micro(exp: Experiment) -> int:
    """Sequences in one forward: the micro batch (grpo: its completions), or for a preference objective its
    pairs' chosen and rejected rows together (the reference's log-probs are precomputed: no reference
    model, no pass)."""
    return exp.train.micro_batch_size * (1 if exp.train.objective in ("sft", "grpo", "distill") else 2)


def masked_rows(exp: Experiment) -> bool:
    """Whether a micro batch's rows carry a mask (sdpa then gets one: layers.py): examples packed or padded
    (every kind but plain text run end to end; preference pairs and GRPO's completions padded)."""
    d = exp.data
    return exp.train.objective not in ("sft", "distill") or d.kind != "text" or d.separate_documents


def activations_for(exp: Experiment, info: ModelInfo, lp: int, levers: Any, device: str = "cuda") -> int:
    """The experiment's activation bytes per rank under one setting of the levers (levers.Levers)."""
    m = exp.model
    text = activations(
        info, rows_per_micro(exp), row_length(exp), lp, levers.checkpointing, levers.chunked_loss,
        m.kernels, compiled=exp.train.compile, sp=levers.sp, tiled_mlp=levers.tiled_mlp, offload=levers.offload,
        lora=m.lora, head_grad=head_trains(m.lora), masks=masked_rows(exp), device=device,
    )  # fmt: skip
    images = experiment_budget(exp, info.vision, lp, rows_per_micro(exp), row_length(exp),
                               info.attn_implementation == "eager", levers.checkpointing)  # fmt: skip
    return text + (images.total if images else 0)
