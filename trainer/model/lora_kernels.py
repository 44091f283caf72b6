"""model.lora.kernels: fused (the default) -- each LoRA layer's adapter branch as one autograd function.

peft computes an adapter as `result + lora_B(lora_A(dropout(x))) * scaling`, module by module: the
dropout's mask and its product, two matmuls, the scaling, the sum, dtype casts, and for bitsandbytes'
4-bit layers a defensive copy of the base's output; each a kernel launch and an autograd node, seven
adapters a layer, again in the recompute and in backward. On one GPU that host work, not the matmuls,
set the pace of a LoRA step of an 8B (issue 55). Here the branch is

    h = dropout(x) @ A^T                  (one fused dropout kernel, one matmul)
    out = addmm(result, h, B^T, alpha=s)  (the second matmul, the scaling and the sum in one kernel)

and backward is its five matmuls and the dropout's backward, by hand. Memory: the layer input is kept
once however many adapters read it (peft keeps each adapter's dropped-out copy), with one byte a
element of mask per adapter when dropout is on, and h (rank columns).

The math is peft's: dropout with lora.dropout's rate on the adapter's input (a mask of its own per
adapter, in training mode only), the same scaling. Rounding differs in one place: the sum is rounded
once (addmm) where peft rounds the product, the scaled product and the sum (bf16: within one unit in
the last place; tests compare with peft's layer in fp32).

Layers that need more than this fall back to peft's own forward, call by call: an adapter variant
(DoRA...), a bias on the adapter (peft's lora_bias), several or disabled adapters, merged weights, mixed
adapter batches, autocast, and ZeRO-3, whose parameter gathering hangs on each submodule's own forward.
"""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def _lora_function() -> Any:
    import torch

    class LoraBranch(torch.autograd.Function):
        """out = result + scaling * dropout(x) @ A^T @ B^T; `result` is the base layer's output."""

        @staticmethod
        def forward(ctx: Any, x: Any, result: Any, a: Any, b: Any, scaling: float, p: float) -> Any:
            x2 = x.reshape(-1, x.shape[-1])
            if p > 0:
                xd, mask = torch.native_dropout(x2, p, True)
            else:
                xd, mask = x2, None
            h = torch.mm(xd, a.t())
            out = torch.addmm(result.reshape(-1, result.shape[-1]), h, b.t(), alpha=scaling)
            ctx.save_for_backward(x2, mask, h, a, b)
            ctx.scaling, ctx.p, ctx.x_shape = scaling, p, x.shape
            return out.view(result.shape)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            x2, mask, h, a, b = ctx.saved_tensors
            s, p = ctx.scaling, ctx.p
            g2 = grad.reshape(-1, grad.shape[-1])
            gh = torch.mm(g2, b).mul_(s)
            ga = gb = gx = None
            if ctx.needs_input_grad[3]:
                gb = torch.mm(g2.t(), h).mul_(s)
            if ctx.needs_input_grad[2]:
                xd = x2 if mask is None else torch.ops.aten.native_dropout_backward(x2, mask, 1.0 / (1.0 - p))
                ga = torch.mm(gh.t(), xd)
            if ctx.needs_input_grad[0]:
                gx = torch.mm(gh, a)
                if mask is not None:
                    gx = torch.ops.aten.native_dropout_backward(gx, mask, 1.0 / (1.0 - p))
                gx = gx.view(ctx.x_shape)
            return gx, grad, ga, gb, None, None

    return LoraBranch


def _is_lora_layer(m: Any) -> bool:
    return hasattr(m, "lora_A") and hasattr(m, "base_layer") and hasattr(m, "lora_dropout")


def _fused_forward(self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
    import torch

    peft_forward = super(type(self), self).forward
    active = self.active_adapters
    name = active[0] if len(active) == 1 else None
    if (
        args
        or kwargs
        or name is None
        or self.disable_adapters
        or self.merged
        or name not in self.lora_A
        or name in getattr(self, "lora_variant", {})
        or torch.is_autocast_enabled()
    ):
        return peft_forward(x, *args, **kwargs)
    a, b = self.lora_A[name].weight, self.lora_B[name].weight
    if hasattr(a, "ds_id") or a.dtype != b.dtype:  # ZeRO-3 gathers on the submodules' own forward
        return peft_forward(x, *args, **kwargs)
    if self.lora_B[name].bias is not None or self.lora_A[name].bias is not None:  # peft's lora_bias: not here
        return peft_forward(x, *args, **kwargs)
    result = self.base_layer(x)
    drop = self.lora_dropout[name]
    p = float(getattr(drop, "p", 0.0)) if drop.training else 0.0
    xl = x if x.dtype == a.dtype else x.to(a.dtype)
    if result.dtype != a.dtype:  # peft: the branch in the adapter's dtype, added in the result's
        zero = torch.zeros(result.shape, dtype=a.dtype, device=result.device)
        return result + _lora_function().apply(xl, zero, a, b, self.scaling[name], p).to(result.dtype)
    return _lora_function().apply(xl, result, a, b, self.scaling[name], p)


@functools.cache
def _fused_class(cls: type) -> type:
    """`cls` (a peft LoRA layer class) with the fused forward; a subclass, so that isinstance and copies keep
    working. It is an attribute of this module under a name that says which class it extends (pickle and
    torch.save find a class by its module and name), and a process that has not made it yet makes it on
    the first lookup (`__getattr__`): a fused model pickles and loads anywhere."""
    key = ":".join(["Fused", *cls.__module__.split("."), cls.__name__])
    fused = type(f"Fused{cls.__name__}", (cls,), {"forward": _fused_forward, "__module__": __name__,
                                                  "__qualname__": key})  # fmt: skip
    globals()[key] = fused
    return fused


def __getattr__(name: str) -> Any:
    """A fused class by the name pickle recorded ('Fused:peft:tuners:lora:layer:Linear'), made if need be."""
    if name.startswith("Fused:"):
        import importlib

        *module, cls = name.split(":")[1:]
        return _fused_class(getattr(importlib.import_module(".".join(module)), cls))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def install(model: Any) -> int:
    """Give every peft LoRA linear layer of `model` (nn.Linear, GPT-2's Conv1D, bitsandbytes' 4- and
    8-bit layers) the fused branch. Returns how many layers got it."""
    n = 0
    for m in model.modules():
        cls = type(m)
        if _is_lora_layer(m) and cls.__name__ in ("Linear", "Linear4bit", "Linear8bitLt"):
            m.__class__ = _fused_class(cls)
            n += 1
    return n


def fused_layers(model: Any) -> int:
    """How many layers of `model` have the fused branch."""
    return sum(type(m).__name__.startswith("Fused") and _is_lora_layer(m) for m in model.modules())
