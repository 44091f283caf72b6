"""The reference's log-probabilities for DPO and IPO, without a second copy of the weights.

The reference is the model as training starts: `model.pretrained` (or the model a config and the
seed build), and with LoRA the same, the adapters adding nothing before the first step. So its
log-probs of every response are computed once, by the engine itself before the first step and
before a checkpoint is loaded, and the policy then trains alone at every ZeRO stage (the planner
counts no reference copy). Each rank computes its share of the pairs (as many forwards on every
rank: ZeRO-3 gathers in each), one all-reduce gives every rank the whole table, and each node's first
rank writes it to the data cache, keyed by what determines the reference (`reference_key`): a resume
reads it and never recomputes it, and a checkpoint records the key, so that a changed reference is
refused like changed data (cache.data_changes).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("trainer")


def content_digests(root: Path, cache_dir: str | Path) -> list[tuple[str, str]]:
    """(file, digest of its bytes) for every file under `root`, each digest computed once and kept in
    `cache_dir/digests/` by the file's path, size and modification time: a copy of the directory
    elsewhere (another path and time) has the same digests, an edit in place another."""
    from trainer.checkpoint.writer import file_digest
    from trainer.common.files import write_atomic

    out = []
    memo_dir = Path(cache_dir).expanduser() / "digests"
    for p in sorted(x for x in root.rglob("*") if x.is_file()):
        st = p.stat()
        stamp = json.dumps([str(p.resolve()), st.st_size, st.st_mtime_ns])
        memo = memo_dir / f"{hashlib.sha256(stamp.encode()).hexdigest()[:32]}.json"
        try:
            digest = json.loads(memo.read_text())["digest"]
        except (OSError, ValueError, KeyError):
            digest = file_digest(p)
            try:
                memo_dir.mkdir(parents=True, exist_ok=True)
                write_atomic(memo, json.dumps({"file": str(p), "digest": digest}), writer=_writer())
            except OSError:
                pass
        out.append((str(p.relative_to(root)), digest))
    return out


def _writer() -> str:
    """A temporary file's name part unique to this process on this host (containers on two nodes
    give their processes the same pid)."""
    import socket

    return f"{socket.gethostname()}.{os.getpid()}"


def reference_key(exp: Any, data: Any, precision: str, stage: int, world_size: int) -> str:
    """A digest of what the reference's log-probs depend on: the model's source (the pretrained
    directory's files by content: content_digests; or the hub id and revision; or the config or
    factory and the seed, and for those whether ZeRO-3 built it, on how many ranks: its partitioned
    initialisation draws other weights than stage 0-2's), LoRA's settings, the attention kernel, the
    precision and the data."""
    m = exp.model
    source: Any = None
    if m.pretrained is not None:
        root = Path(m.pretrained).expanduser()
        source = content_digests(root, exp.data.cache_dir) if root.is_dir() else [m.pretrained, m.revision]
    ident = {
        "version": 2,
        "pretrained": source,
        "config": m.model_dump(mode="json").get("config"),
        "factory": [m.factory, m.model_dump(mode="json").get("factory_args")],
        "seed": exp.seed if m.pretrained is None else None,
        "init": [stage == 3, world_size if stage == 3 else None] if m.pretrained is None else None,
        "lora": m.model_dump(mode="json").get("lora"),
        "attn": m.attn_implementation,
        "precision": precision,
        "train": data.fingerprint["train_digest"],
        "eval": None if data.eval is None else len(data.eval),
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:20]


def prepare(
    objective: Any, engine: Any, data: Any, micro: int, rank: int, world: int, local_rank: int
) -> str:
    """Give `objective` the reference's log-probs (read from the cache, or computed and cached); the
    line the start-up log shows."""
    import torch
    import torch.distributed as dist

    key = data.fingerprint["reference"]
    path = Path(data.cache_path) / "reference" / f"{key}.npz"
    have = torch.tensor([1.0 if path.exists() else 0.0], device=engine.device)
    if dist.is_initialized() and world > 1:
        dist.all_reduce(have, op=dist.ReduceOp.MIN)
    if have.item() == 1.0:
        with np.load(path) as saved:
            objective.reference = {"train": saved["train"], "eval": saved.get("eval")}
        return f"reference log-probs: read from {path} (computed before the first step; not recomputed)"
    t0 = time.perf_counter()
    tables = {"train": compute(engine, data.train, micro, rank, world)}
    if data.eval is not None:
        tables["eval"] = compute(engine, data.eval, micro, rank, world)
    if local_rank == 0:  # each node's cache (a shared cache_dir: every node writes the same table)
        write_table(path, tables)
    objective.reference = {"train": tables["train"], "eval": tables.get("eval")}
    pairs = sum(len(t) for t in tables.values())
    return (
        f"reference log-probs: computed for {pairs:,} pairs in {time.perf_counter() - t0:.1f} s by the model as "
        f"training starts (no reference copy in memory); cached in {path}"
    )


def write_table(path: Path, tables: dict[str, Any]) -> None:
    """The tables into `path` in one rename, through a temporary file of this host and process alone."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{_writer()}.tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **tables)
    os.replace(tmp, path)


def compute(engine: Any, rows: Any, micro: int, rank: int, world: int) -> np.ndarray:
    """(pairs, 2) summed log-probs of each pair's chosen and rejected response, all ranks sharing the
    work: rank r takes pairs r, r + world, ... in micro batches, every rank as many (the last
    repeated where its share is short; those results are not kept)."""
    import torch
    import torch.distributed as dist

    from trainer.data.stream import _collate
    from trainer.objectives.pairs import response_logps

    n = len(rows)
    mine = list(range(rank, n, world))
    per_rank = -(-n // world)
    batches = -(-per_rank // micro)
    table = torch.zeros((n, 2), dtype=torch.float64, device=engine.device)
    was_training = engine.ds.training
    engine.train(False)
    with torch.no_grad():
        for b in range(batches):
            take = mine[b * micro : (b + 1) * micro]
            real = len(take)
            take = take + [mine[-1] if mine else 0] * (micro - real)
            batch = _collate((np.asarray(rows[np.asarray(take)]), np.asarray(take)), 1)
            logps, _ = response_logps(engine.ds, batch.rows.to(engine.device))
            if real:
                table[torch.as_tensor(take[:real], device=engine.device), 0] = logps[:real].double()
                table[torch.as_tensor(take[:real], device=engine.device), 1] = logps[
                    micro : micro + real
                ].double()
    engine.train(was_training)
    if dist.is_initialized() and world > 1:
        dist.all_reduce(table)
    return table.cpu().numpy()
