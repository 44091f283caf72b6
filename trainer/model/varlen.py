"""model.attn_implementation: varlen, and the attention kernels of CUDA runs.

`varlen` is PyTorch's own FlashAttention-2 kernel (`aten::_flash_attention_forward`, no package to
install) called the way flash_attn_varlen_func is: the micro batch's rows end to end as one sequence
of tokens, cut into examples by cumulative lengths (cu_seqlens). A packed row's examples stay apart
in one call per layer (each example attends to itself only, causally), with no mask tensor and no
plan to build. `auto` picks it on CUDA in bf16/fp16 for the families in VARLEN_FAMILIES.

Why not plain sdpa on CUDA: torch 2.10+ prefers cuDNN's attention on Hopper, whose execution plans are
built on the host per shape and mask and cached per thread; a LoRA step of an 8B spent half its host
time there (aten::_cudnn_attention_backward 20.8 ms of CPU a call; issue 55), and a packed row's
block-diagonal mask ruled out the flash kernel entirely. Runs that keep sdpa on CUDA get cuDNN's
kernel turned off (flash for causal rows, memory-efficient for masked ones) unless
model.cudnn_attention is true.

The cumulative lengths come from the engine (trainer/engine.py: `varlen_lengths`, computed on the host
from the batch's position ids, no device synchronisation); without them they are derived from the
position ids (which restart at each example), and without those each row is one sequence. What the
kernel cannot do (a padding mask, attention dropout, a key/value cache longer than the queries,
soft-capping, CPU tensors, head sizes over 256) runs through transformers' sdpa with the same
examples kept apart by an explicit mask: slower, never different.
"""

from __future__ import annotations

import functools
from typing import Any

NAME = "varlen"
# Families whose attention is plain causal softmax attention (optionally over a sliding window), which
# the kernel computes exactly; checked packed = one by one on CPU through the fallback, with and without a
# padding mask (tests/unit/test_varlen.py), and on CUDA through the kernel (tests/unit/test_gpu_finetune.py,
# bench/finetune.py's device checks).
VARLEN_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def family_problem(model_type: str | None) -> str | None:
    """Why model.attn_implementation: varlen cannot serve this model type, None: it can."""
    if model_type in VARLEN_FAMILIES:
        return None
    return (
        f"varlen attention is verified for {', '.join(VARLEN_FAMILIES)}, not '{model_type}' (its attention may "
        "add soft-capping, sinks or position biases the kernel does not compute); use sdpa"
    )


def register() -> None:
    """Make `varlen` an attention implementation transformers knows (idempotent). Its mask function is
    FlashAttention's: None unless a row has padding (then the 2-D padding mask)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    AttentionInterface.register(NAME, varlen_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, flash_attention_mask)


def no_cudnn(enabled: bool) -> None:
    """model.cudnn_attention: false turns cuDNN's SDPA kernel off for this process (CUDA only)."""
    import torch

    if torch.cuda.is_available():
        torch.backends.cuda.enable_cudnn_sdp(enabled)


def lengths_from_positions(position_ids: Any) -> tuple[Any, int]:
    """(cumulative lengths as int32, the longest example) of the rows of `position_ids` laid end to
    end: an example starts where the position is 0 (and each row starts one). On the tensor's device:
    a CPU tensor costs no device synchronisation."""
    import torch

    pos = position_ids.reshape(position_ids.shape[0], -1)
    starts = pos == 0
    starts[:, 0] = True
    flat = starts.reshape(-1)
    idx = torch.nonzero(flat).flatten()
    cu = torch.cat([idx, torch.tensor([flat.numel()], device=idx.device)]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


@functools.lru_cache(maxsize=16)
def _uniform(rows: int, seq: int, device: Any) -> Any:
    import torch

    return torch.arange(0, (rows + 1) * seq, seq, dtype=torch.int32, device=device)


@functools.cache
def _flash_varlen() -> Any:
    """FlashAttention-2 over cumulative lengths, forward and backward (PyTorch's aten kernels; GQA's
    fewer key/value heads are the kernel's own)."""
    import torch

    class FlashVarlen(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any, cu: Any, longest: int, scale: float, left: Any) -> Any:
            right = None if left is None else 0
            out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
                q, k, v, cu, cu, longest, longest, 0.0, True, False,
                scale=scale, window_size_left=left, window_size_right=right,
            )  # fmt: skip
            ctx.save_for_backward(q, k, v, out, lse, cu, seed, offset)
            ctx.longest, ctx.scale, ctx.left, ctx.right = longest, scale, left, right
            return out

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            q, k, v, out, lse, cu, seed, offset = ctx.saved_tensors
            dq, dk, dv = torch.ops.aten._flash_attention_backward(
                grad.contiguous(), q, k, v, out, lse, cu, cu, ctx.longest, ctx.longest, 0.0, True, seed, offset,
                scale=ctx.scale, window_size_left=ctx.left, window_size_right=ctx.right,
            )  # fmt: skip
            return dq, dk, dv, None, None, None, None

    return FlashVarlen


def _lengths(kwargs: dict[str, Any], rows: int, seq: int, device: Any) -> tuple[Any, int]:
    cu, longest = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if cu is not None and longest is not None:
        return cu, int(longest)
    pos = kwargs.get("position_ids")
    if pos is not None:
        if pos.shape[0] != rows:
            pos = pos.expand(rows, -1)
        return lengths_from_positions(pos)  # a synchronisation: the engine passes them instead
    return _uniform(rows, seq, device), seq


def varlen_attention_forward(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    """transformers' attention interface: query (rows, heads, tokens, head size), key and value with
    their own (fewer, grouped) heads; returns (rows, tokens, heads, head size)."""
    import torch

    rows, heads, seq, size = query.shape
    fast = (
        query.is_cuda
        and attention_mask is None
        and not dropout
        and softcap is None
        and kwargs.get("s_aux") is None
        and kwargs.get("position_bias") is None
        and key.shape[2] == seq
        and query.dtype in (torch.bfloat16, torch.float16)
        and size <= 256
        and value.shape[-1] == size
    )
    if not fast:
        return _fallback(
            module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, **kwargs
        )
    cu, longest = _lengths(kwargs, rows, seq, query.device)
    q, k, v = (t.transpose(1, 2).reshape(rows * seq, t.shape[1], size) for t in (query, key, value))
    scale = scaling if scaling is not None else size**-0.5
    left = None if sliding_window is None else int(sliding_window) - 1
    out = _flash_varlen().apply(q, k, v, cu, longest, scale, left)
    return out.view(rows, seq, heads, size), None


def _fallback(
    module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float, scaling: Any,
    sliding_window: Any, softcap: Any, **kwargs: Any,
) -> tuple[Any, None]:  # fmt: skip
    """transformers' sdpa with the examples apart by an explicit boolean mask (rows, 1, queries, keys):
    causal from the bottom right (a key/value cache ahead of the queries), within each example of a
    packed row (the cumulative lengths, else the position ids, whether or not a padding mask comes too:
    generate's padding has positions of its own, 1, and the first real token 0), within the sliding
    window, and over the unpadded keys of a 2-D padding mask."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows, _, seq, _ = query.shape
    keys = key.shape[2]
    q_pos = torch.arange(keys - seq, keys, device=query.device)[:, None]
    k_pos = torch.arange(keys, device=query.device)[None, :]
    mask = (k_pos <= q_pos)[None, None].expand(rows, 1, seq, keys)
    if sliding_window is not None:
        mask = mask & (k_pos > q_pos - int(sliding_window))[None, None]
    if keys == seq:  # a packed row's examples apart, with or without a padding mask beside them
        cu, _ = _lengths(kwargs, rows, seq, query.device)
        cu = cu.to(query.device).long()
        example = torch.zeros(rows * seq, dtype=torch.long, device=query.device)
        example[cu[1:-1]] = 1
        example = example.cumsum(0).view(rows, seq)
        mask = mask & (example[:, None, :, None] == example[:, None, None, :])
    if attention_mask is not None:
        pad = attention_mask[:, -keys:].bool() if attention_mask.dim() == 2 else attention_mask.bool()
        mask = mask & (pad[:, None, None, :] if pad.dim() == 2 else pad)
    # a left-padded row's padding queries see no key at all: let them see themselves (their outputs are
    # never used) rather than turn softmax over nothing into NaN
    if keys == seq:
        mask = mask | (~mask.any(-1, keepdim=True) & torch.eye(seq, dtype=torch.bool, device=query.device))
    for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(name, None)
    if softcap is not None:
        kwargs["softcap"] = softcap
    return sdpa_attention_forward(
        module, query, key, value, mask, dropout=dropout, scaling=scaling, is_causal=False, **kwargs
    )
