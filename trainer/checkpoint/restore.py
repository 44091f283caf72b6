"""Loading a checkpoint into a run (`load(store, found, state)`, every rank): weights, optimizer,
scheduler (through trainer/checkpoint/reshard.py, converting for another ZeRO stage or world size),
the frozen weights' check (model.lora, trainer/checkpoint/frozen.py), step, data position and this
rank's RNG. The Checkpointer (a resume) and --check call it; the Store itself only saves.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from trainer.checkpoint import frozen
from trainer.checkpoint.disk import Found
from trainer.checkpoint.store import Store
from trainer.common.errors import UserError

log = logging.getLogger("trainer")


def load(store: Store, found: Found, state: Any, wait_s: float = 7200.0) -> None:
    """Restore weights, optimizer, scheduler, step, data position and this rank's RNG. `wait_s`:
    how long every rank waits for a conversion to another stage or world size."""
    import torch

    from trainer.checkpoint import reshard

    saved = found.state
    same_world = saved["world_size"] == store.world_size
    names, aliases = store.layout
    rec = frozen.saved(saved)
    custom = None
    if rec is not None and rec.get("omitted"):  # the module may lack the frozen weights, and only those
        custom = frozen.strict_but_frozen(frozen.frozen_names(store.engine.ds.module), found.path)
    try:
        reshard.load(
            store.engine, found.path, names, aliases, store.rank, store._group, wait_s=wait_s,
            custom_load_fn=custom, journal_root=store.root,
        )  # fmt: skip
    except (UserError, torch.OutOfMemoryError):
        raise
    except Exception as e:  # noqa: BLE001  (a checkpoint that does not load will not load next time)
        log.debug("loading the checkpoint failed", exc_info=True)
        raise reshard.ResumeError(
            f"resuming from {found.path} failed on rank {store.rank}: {type(e).__name__}: {e}"
        ) from e
    from trainer.engine import resume_schedule

    resume_schedule(store.engine.scheduler)
    if frozen.guarded(store.exp):  # every rank (ZeRO-3 gathers): the frozen weights are the run's
        store.frozen_digest = frozen.engine_digest(store.engine.ds)
        problem = frozen.resumed_problem(found.path, rec, store.frozen_digest, store.gather)
        if problem:  # every rank stops
            raise reshard.ResumeError(problem)
    state.step = int(saved["step"])
    state.samples = int(saved["samples"])
    state.tokens = int(saved["tokens"])
    state.wall_time = float(saved.get("wall_time", 0.0))
    # saved before the flag existed: unknown, so not claimed (the next step with a nonzero LR sets it)
    state.moved = bool(saved.get("moved", False))
    from trainer.data import Position

    pos = saved["data_position"]
    store.stream.seek(Position(int(pos["epoch"]), int(pos["sample"])))
    rng = found.path / f"rng_rank{store.rank:05d}.pt"
    if same_world and rng.exists():
        set_rng_state(torch.load(rng, weights_only=False))
    else:  # another world size: a fresh, still deterministic, per-rank stream
        from trainer.cluster.dist import seed_all

        seed_all(store.exp.seed + 1 + store.rank + 1_000_003 * state.step)


def set_rng_state(state: Mapping[str, Any]) -> None:
    import random

    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
