"""Correctness checks across ranks: parameter digests and consumed-sample records.

Used by `--check` and the preflight (identical weights on every rank), and by the tests (which
ask, through TRAINER_DEBUG_DIR, for every rank's digest and the samples it consumed).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Any


def param_digest(module: Any) -> str:
    """sha256 of every parameter's full value (gathered under ZeRO-3), in name order."""
    import torch

    params = list(module.named_parameters())
    ctx: Any = contextlib.nullcontext()
    if params and hasattr(params[0][1], "ds_id"):  # ZeRO-3 partitioned parameters
        import deepspeed

        ctx = deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None)
    h = hashlib.sha256()
    with ctx, torch.no_grad():
        for name, p in params:
            h.update(name.encode())
            h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def all_gather(obj: Any, world_size: int) -> list[Any]:
    """Every rank's `obj`, on every rank."""
    if world_size == 1:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def row_digest(row: Any) -> str:
    return hashlib.blake2b(row.numpy().tobytes(), digest_size=8).hexdigest()


def write_debug_report(
    directory: str, rank: int, world_size: int, module: Any, samples: list[str], extra: dict | None = None
) -> None:
    """Each rank writes rank<R>.json: its parameter digest, all ranks' digests, its consumed samples."""
    digest = param_digest(module)
    digests = all_gather(digest, world_size)
    out = {
        "rank": rank,
        "param_digest": digest,
        "all_param_digests": digests,
        "samples": samples,
        **(extra or {}),
    }
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"rank{rank}.json").write_text(json.dumps(out))
