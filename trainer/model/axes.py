"""Tensor parallelism at run time (DeepSpeed's AutoTP; the plan's side: trainer/strategy/planning/axes.py): a
shard's tensor made whole again from its tensor-parallel group, for what must see the model whole (the tests'
gradient dumps, the weights' fingerprints)."""

from __future__ import annotations

from typing import Any


def shard_dims(model: Any) -> dict[str, int]:
    """Each parameter AutoTP divided, by name, and the dimension it divided: a row-parallel layer (AutoTP's
    LinearAllreduce: the output projections) its weight's inputs (1), a column-parallel one (LinearLayer: the
    queries, keys, values, the gate and up projections, the LM head) its outputs (0), its bias with it. A
    row-parallel layer's bias is whole."""
    from deepspeed.module_inject.layers import LinearAllreduce, TensorParallel_Layer

    out = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, TensorParallel_Layer):
            continue
        row = isinstance(module, LinearAllreduce)
        for name, p in module.named_parameters(recurse=False):
            if row and name != "weight":
                continue
            out[f"{prefix}.{name}" if prefix else name] = (
                1 if row and len(getattr(p, "ds_shape", p.shape)) > 1 else 0
            )
    return out


def whole(tensor: Any, dim: int) -> Any:
    """`tensor`'s shards from every rank of this rank's tensor-parallel group, joined along `dim` (AutoTP divides
    a size that does not divide by the group unevenly: a vocabulary of 257 as 129 and 128 rows)."""
    import torch
    import torch.distributed as dist
    from deepspeed.utils import groups

    group = groups.get_tensor_model_parallel_group()
    n = dist.get_world_size(group=group)
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([tensor.shape[dim]]), group=group)
    top = max(int(x) for x in sizes)
    pad = list(tensor.shape)
    pad[dim] = top - tensor.shape[dim]
    padded = torch.cat([tensor, tensor.new_zeros(pad)], dim=dim) if pad[dim] else tensor.contiguous()
    parts = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p.narrow(dim, 0, int(k)) for p, k in zip(parts, sizes, strict=True)], dim=dim)
