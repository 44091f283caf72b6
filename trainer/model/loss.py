"""`model.chunked_loss`: a causal LM's loss without its whole logits.

A transformers causal LM computes `logits = lm_head(hidden)` for every position (batch x seq x
vocab: 6.6 GB in bf16 for GPT-2 at micro batch 64 x 1024) and its loss upcasts them to fp32 (13 GB
more), keeps the log-softmax for backward and writes a gradient as large: about 18 bytes per logit
of memory and several passes over it. Here the LM head and the cross-entropy run in chunks of rows
(1 GiB of fp32 logits each, `trainer.config.schema.LOSS_CHUNK_BYTES`), and each chunk's gradients
(towards the hidden states and the head's weight) are computed right away, as Liger-Kernel's fused
linear cross-entropy does: no extra FLOPs, the loss's memory becomes one chunk, and backward only
scales the saved gradients.

The loss is the same as transformers' `ForCausalLMLoss` (labels shifted left, -100 ignored, mean
over the counted tokens, softmax in fp32); the hidden states and the weight keep their precision,
so bf16 results differ from the unchunked loss by rounding only.

On a CPU without AVX-512 (oneDNN has bf16 matrix kernels for AVX-512 and AMX only; on AVX2 a bf16
`torch.mm` takes a fallback 40-100x slower than fp32's, 2.6-10 GFLOP/s against 40-60 here), the
three products of a bf16 chunk run in fp32 on the bf16 values and are rounded to bf16 as a bf16
product's output is (`native_bf16_matmul`): the same math, up to the order of the fp32 sums.
Everywhere else (GPUs, AVX-512 hosts, fp32) the products are the operands' own `torch.mm`, unchanged.

It replaces the model's `forward` (an attribute of the instance: the class, the state dict and
checkpoints are untouched) by one that runs the base model and then this loss; with no labels
the original forward runs. Supported: transformers models whose logits are `lm_head(hidden)`
unscaled, uncapped and without bias (`trainer.config.schema.CHUNKED_LOSS_TYPES`). At ZeRO stage 3 the
head's weight is registered as an external parameter of the model, so that DeepSpeed gathers it
for the model's forward and backward.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import torch.nn.functional as F

from trainer.common.errors import UserError
from trainer.config import chunked_loss_problem, loss_chunk_rows
from trainer.data.pack import IGNORE  # transformers' ignore_index, defined once


@functools.cache
def native_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 matrices with oneDNN's own kernels: ATen's AVX-512 build
    (AVX-512 BW/VL/DQ; AMX where there is one) and oneDNN not capped below AVX-512 by
    ONEDNN_MAX_CPU_ISA. `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` (make test-avx2) makes an
    AVX-512 host answer as an AVX2-only one does."""
    capability = torch.backends.cpu.get_cpu_capability()
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "ALL")).upper()
    return capability.startswith("AVX512") and (cap == "ALL" or "AVX512" in cap or "AMX" in cap)


def _mm(a: Any, b: Any) -> Any:
    """a @ b in the operands' precision: bf16 on a CPU without native bf16 products as fp32 products
    of the same values, rounded to bf16 (see the module docstring)."""
    if a.dtype == torch.bfloat16 and a.device.type == "cpu" and not native_bf16_matmul():
        return torch.mm(a.float(), b.float()).to(torch.bfloat16)
    return torch.mm(a, b)


def _chunks(
    hidden: Any, weight: Any, targets: Any, rows: int, grads: bool, num_items: float | None = None,
    weight_grad: bool = True,
) -> tuple[Any, Any, Any]:  # fmt: skip
    """(mean loss, d loss / d hidden, d loss / d weight); the gradients are None without `grads`, the
    weight's without `weight_grad` too (a frozen head: LoRA's, no fp32 (vocab x hidden) buffer and no
    product for it). `num_items`: divide the sum by this instead of the count of targets here (transformers'
    num_items_in_batch: the targets of the whole step, for a loss normalized across micro batches).

    Per chunk, four passes over its logits in eager mode: the matmul writes them, log-softmax
    reads them and writes fp32, exp turns that into the softmax in place, and the cast to the
    operands' precision writes the gradient for the two matmuls. The 1/count of the mean and the
    mask of ignored rows scale the small outputs (rows x d, and the head's gradient once), not the
    logits."""
    n = hidden.shape[0]
    valid = targets != IGNORE
    denom = (
        valid.sum().clamp(min=1).to(torch.float32)
        if num_items is None
        else torch.tensor(float(num_items), dtype=torch.float32, device=hidden.device)
    )
    safe = torch.where(valid, targets, 0)[:, None]
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_h = torch.empty_like(hidden) if grads else None
    grad_w = (
        torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        if grads and weight_grad
        else None
    )
    for start in range(0, n, rows):
        h = hidden[start : start + rows]
        t = safe[start : start + rows]
        v = valid[start : start + rows, None]
        logp = torch.log_softmax(_mm(h, weight.t()), dim=1, dtype=torch.float32)
        total = total - torch.where(v, logp.gather(1, t), 0.0).sum()
        if grads:
            # d(loss of a row)/d logits = softmax - one_hot(target), in fp32, then in h's precision
            g = logp.exp_().scatter_add_(1, t, torch.full_like(t, -1.0, dtype=logp.dtype)).to(h.dtype)
            grad_h[start : start + rows] = _mm(g, weight).float().mul_(v / denom).to(h.dtype)
            if grad_w is not None:
                grad_w.add_(_mm(g.t(), h * v.to(h.dtype)))
    if grad_w is not None:
        grad_w.div_(denom)
    return total / denom, grad_h, grad_w


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: Any, weight: Any, targets: Any, rows: int, num_items: float | None) -> Any:
        weight_grad = ctx.needs_input_grad[1]  # a frozen head (LoRA) gets no gradient, so none is made
        loss, grad_h, grad_w = _chunks(hidden, weight, targets, rows, grads=True, num_items=num_items,
                                       weight_grad=weight_grad)  # fmt: skip
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(grad_h, grad_w)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_out: Any) -> tuple[Any, ...]:
        grad_h, grad_w = ctx.saved_tensors
        return (
            grad_h * grad_out.to(grad_h.dtype),
            None if grad_w is None else (grad_w * grad_out).to(ctx.weight_dtype),
            None,
            None,
            None,
        )


def linear_cross_entropy(
    hidden: Any, weight: Any, labels: Any, rows: int | None = None, num_items: float | None = None,
    shift_labels: Any = None,
) -> Any:  # fmt: skip
    """Mean cross-entropy of `hidden @ weight.T` against `labels` shifted left by one (transformers'
    causal LM loss), in chunks of `rows` tokens. hidden: (batch, seq, d); labels: (batch, seq);
    `num_items`: the sum divided by this instead of the number of targets; `shift_labels`: the
    targets already shifted (sequence parallelism shifts before it cuts the rows), as transformers takes."""
    shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE) if shift_labels is None else shift_labels
    targets = shifted.reshape(-1)
    flat = hidden.reshape(-1, hidden.shape[-1])
    rows = rows or loss_chunk_rows(weight.shape[0])
    if torch.is_grad_enabled() and (flat.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(flat, weight, targets, rows, num_items)
    return _chunks(flat, weight, targets, rows, grads=False, num_items=num_items)[0]


def attach(model: Any, zero3: bool = False) -> Any:
    """Give `model` (a transformers causal LM) the chunked loss; returns the model."""
    config = getattr(model, "config", None)
    problem = chunked_loss_problem(
        getattr(config, "model_type", None), getattr(config, "get_text_config", lambda: config)()
    )
    if problem:
        raise UserError(f"model.chunked_loss: {problem}")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    base = getattr(model, "base_model", None)
    if head is None or base is None or base is model or getattr(head, "bias", None) is not None:
        raise UserError(
            f"model.chunked_loss: {type(model).__name__} has no bias-free LM head over a base model; set it to false"
        )
    rows = loss_chunk_rows(int(getattr(head.weight, "ds_shape", head.weight.shape)[0]))
    if zero3:
        import deepspeed

        deepspeed.zero.register_external_parameter(model, head.weight)
    from transformers.modeling_outputs import CausalLMOutput

    original = model.forward

    def forward(input_ids: Any = None, labels: Any = None, **kwargs: Any) -> Any:
        if labels is None:
            return original(input_ids=input_ids, **kwargs)
        num_items = kwargs.pop("num_items_in_batch", None)
        shift_labels = kwargs.pop("shift_labels", None)
        hidden = base(input_ids=input_ids, **kwargs)[0]
        return CausalLMOutput(
            loss=linear_cross_entropy(hidden, head.weight, labels, rows, num_items, shift_labels)
        )

    model.forward = forward
    model.chunked_loss_rows = rows
    return model
