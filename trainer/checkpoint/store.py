"""Checkpoints you can trust: saving one atomically (the layout on disk, finding and verifying
checkpoints: trainer/checkpoint/disk.py; loading one into a Store's engine:
trainer/checkpoint/restore.py).

Saving: every rank writes into a hidden staging directory (`.tmp-step_00000500`); once every rank
has written its files, rank 0 writes the metadata and the manifest, renames the directory to its
final name and replaces `latest` (write, fsync, rename). In a synchronous save (`Store.save`) every
rank writes at once and a barrier says "all written"; in an asynchronous one (`checkpoint.async`,
`Store.start`, then `Store.commit` from the Checkpointer) each rank's writer thread writes a host
copy of the state while training goes on, and the ranks learn "all written" from the collective the
loop runs each step. A crash at any point leaves the previous checkpoint as `latest`; staging
leftovers are ignored on resume and removed by the next save. DeepSpeed's own `latest` (written by
rank 0 before the other ranks finish) is never used.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from trainer.checkpoint import frozen
from trainer.checkpoint.directory import CheckpointDir
from trainer.checkpoint.disk import STATE, STATE_DIGEST, tag_for
from trainer.common.faults import Faults
from trainer.config import Experiment

log = logging.getLogger("trainer")

FORMAT_VERSION = 1

# ----------------------------------------------------------------------------- saving


def versions() -> dict[str, str]:
    """The versions that made a checkpoint, read from the installed distributions' metadata (not by
    importing them: `datasets`, imported just for its version, would slow every save)."""
    import platform
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist in ("torch", "deepspeed", "transformers", "datasets"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[dist] = metadata.version(dist)
    return out


def rng_state() -> dict[str, Any]:
    import random

    import numpy as np
    import torch

    out = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


@dataclass
class Pending:
    """A save that has started and is not yet visible (Store.start -> Store.commit)."""

    step: int
    tag: str
    stage_dir: Path
    meta: dict[str, Any]  # trainer_state.json as of the save's step (rank 0)
    started: float  # perf_counter at the start
    blocked_s: float = 0.0  # how long training waited for this save (on this rank)
    copy_s: float = 0.0  # of which: taking the host copy (background)
    commit_s: float = 0.0  # of which: the commit and pruning (rank 0)
    snapshot_bytes: int = 0  # the host copy (background)
    writer: Any = None  # writer.Writer of a background save; None: written in the foreground
    written: dict[str, tuple[int, str]] = field(default_factory=dict)  # this rank's files: (bytes, digest)

    def files(self) -> dict[str, tuple[int, str]]:
        """This rank's files of the save, by their path in the checkpoint: (bytes, digest)."""
        mine = {**self.written, **(self.writer.written if self.writer is not None else {})}
        return {str(Path(k).resolve().relative_to(self.stage_dir.resolve())): v for k, v in mine.items()}


@dataclass
class Store:
    """The checkpoints of one run: save one atomically (every rank its shards, rank 0 the metadata
    and the commit), prune the old ones, load one (converting for another stage or world size)."""

    root: Path  # <run_dir>/checkpoints
    engine: Any
    stream: Any
    exp: Experiment
    rank: int
    world_size: int
    plan: dict[str, Any] = field(default_factory=dict)
    layout: tuple[list[list[str]], dict[str, str]] = ([], {})  # parameter names per group, tied aliases
    faults: Faults = field(default_factory=Faults)  # tests: kills during a save (trainer/common/faults.py)
    data_fingerprint: dict[str, Any] = field(default_factory=dict)  # Data.fingerprint, compared on resume
    recent: Callable[[], dict[str, Any]] | None = None  # what trainer_state.json shows of the run so far
    on_save: Callable[[int], None] | None = None  # tests: called on every rank with the step after each save
    resumed_from: str | None = None  # the checkpoint this run resumed from (its lineage; None: a fresh start)
    _group: Any = None
    copier: Any = None  # writer.HostCopier: the host copies of background saves (pinned buffers reused)
    omit_frozen: bool = False  # model.lora from model.pretrained: the frozen base stays out (frozen.py)
    frozen_digest: str | None = None  # model.lora: of the frozen weights (guard_frozen, or a resume's load)
    disk: CheckpointDir | None = (
        None  # `root` on disk: the manifest, the commit, pruning (its line: build's start)
    )

    def __post_init__(self) -> None:
        from trainer.checkpoint.writer import HostCopier

        if self.disk is None:
            self.disk = CheckpointDir(self.root)
        self.copier = HostCopier()
        self.omit_frozen = frozen.omitted(self.exp)
        if self.omit_frozen:
            frozen.leave_out_aliases(self.engine.ds)
        if self.world_size > 1:
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo")  # CPU barriers: never sync the GPU

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self._group is not None:
            __import__("torch.distributed").distributed.barrier(group=self._group)

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (picklable), on every rank (on the checkpoint's CPU group)."""
        if self._group is None:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def gather(self, values: list[int]) -> list[list[int]]:
        """Every rank's `values` (a few ints), on every rank (on the checkpoint's CPU group)."""
        from trainer.cluster.dist import gather_ints

        return gather_ints(values, self.world_size, self._group)

    def save(self, state: Any) -> Path:
        """A synchronous save: every rank writes its files, then rank 0 commits; returns the path."""
        pending = self.start(state, background=False)
        self.barrier()  # every rank has finished writing
        return self.commit(pending)

    def start(self, state: Any, *, background: bool) -> Pending:
        """Begin a save of `state` (every rank, at the same step). In the foreground DeepSpeed writes
        the files now; in the `background` a host copy is taken now and a Writer thread writes it
        (trainer/checkpoint/writer.py). Either way nothing is visible until `commit`."""

        t0 = time.perf_counter()
        tag = tag_for(state.step)
        stage_dir = self.disk.staging(tag)
        try:
            if self.is_main:
                self.disk.prepare(tag)  # the directory, no leftovers, an empty staging directory
            self.barrier()
            stage_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise unwritable(e, tag, self.root, False, "preparing its staging directory") from None
        # What trainer_state.json will say, taken now: the commit may come steps later.
        meta = metadata(self, state) if self.is_main else {}
        if frozen.guarded(self.exp):  # every rank (ZeRO-3 gathers): the frozen weights did not move
            now = frozen.engine_digest(self.engine.ds)
            # (no digest yet: a Store whose first save comes before guard_frozen, --check's)
            self.frozen_digest = frozen.unchanged(self.frozen_digest, now, self.rank, state.step)
            meta[frozen.KEY] = frozen.record(self.exp, now)
        rng = (stage_dir / f"rng_rank{self.rank:05d}.pt", rng_state())
        pending = Pending(step=state.step, tag=tag, stage_dir=stage_dir, meta=meta, started=t0)
        if not background:
            try:
                _write_now(self, pending, rng)
            except OSError as e:  # (write_file's error names the file, the error and the bytes written)
                raise unwritable(e, tag, self.root, False, "writing it") from None
        else:
            _snapshot(self, pending, rng)
        pending.written.update(_save_adapters(self, stage_dir, state))
        pending.blocked_s = pending.copy_s = time.perf_counter() - t0
        if self.on_save is not None:
            self.on_save(state.step)
        return pending

    def ds_save(self, staging: str) -> None:
        """DeepSpeed's save_checkpoint into the staging directory `staging` (its `latest` not written)."""
        self.engine.ds.save_checkpoint(
            str(self.root), tag=staging, save_latest=False, exclude_frozen_parameters=self.omit_frozen
        )

    def commit(self, pending: Pending) -> Path:
        """Every rank, once every rank has written its files: rank 0 writes the metadata and the
        manifest, renames the staging directory to its final name and replaces `latest`."""
        self.faults.at("killcommit", pending.step)
        t0 = time.perf_counter()
        final = self.root / pending.tag
        # Every rank's files, as each wrote them (made durable by the rank that wrote them): the manifest
        # lists what every rank reports, not what rank 0 can see.
        reported = self.gather_objects(pending.files())
        if self.is_main:
            _commit_main(self, pending, reported)
            self.faults.at("killlatest", pending.step)
        pending.commit_s = time.perf_counter() - t0
        if pending.writer is None:
            self.barrier()
            pending.blocked_s = time.perf_counter() - pending.started
        else:
            pending.blocked_s += pending.commit_s
        return final

    def salvage(self, pending: Pending, wait_s: float = 10.0) -> Path | None:
        """A failed step's way out, every rank: rank 0 commits the background save once every rank's report
        is in its staging directory (no collective: the others may be anywhere). The writer is joined (alive
        at exit, it aborted the process: 134 instead of the error's own code)."""
        from trainer.checkpoint.directory import salvage, wait_for_reports

        w = pending.writer
        if not w.wait(poll_s=0.2, quiet_s=wait_s) or not self.is_main or w.status != 0:
            return None  # (a write that hangs is given up: the failure's own exit code comes first)
        wait_for_reports(pending.stage_dir, self.world_size, quiet_s=wait_s)
        return salvage(self.disk, pending.stage_dir, pending.tag, pending.meta, self.engine.ds_config,
                       self.exp.to_yaml(), self.world_size, pending.files())  # fmt: skip

    def guard_frozen(self) -> None:
        """model.lora: the digest every save compares with, taken once, before the first step (build
        calls it after a resume's load, which takes it itself); every rank (ZeRO-3 gathers)."""
        if self.frozen_digest is None and frozen.guarded(self.exp):
            self.frozen_digest = frozen.engine_digest(self.engine.ds)


def _commit_main(store: Store, pending: Pending, reported: list[Any]) -> None:
    """Rank 0's part of a commit: the manifest of what every rank `reported`, the rename, the journal's record;
    a disk that will not take them is a user error saying what is kept (`unwritable`)."""
    faults, written = store.faults, {}
    try:
        faults.full("fullmanifest", pending.step, pending.stage_dir / STATE)
        written = store.disk.write_manifest(
            pending.stage_dir, pending.meta, store.engine.ds_config, store.exp.to_yaml(), reported
        )
        faults.at("killmanifest", pending.step)

        def renamed() -> None:
            faults.at("killrename", pending.step)
            faults.full("fulljournal", pending.step, store.root / "journal.jsonl")

        store.disk.commit(pending.stage_dir, pending.tag, written, renamed=renamed)
    except OSError as e:
        from trainer.checkpoint import journal
        from trainer.checkpoint.fs import ACTIONABLE, describe

        last = (journal.read(store.root).records or [None])[-1]
        if (
            e.errno in ACTIONABLE
            and last
            and last.event == "commit"
            and last.get("id") == written.get(STATE_DIGEST)
        ):
            log.warning(f"checkpoint {pending.tag}: committed (the journal records it), but `latest` was not updated: "
                        f"{describe(e, e.filename or store.root, 'writing latest')}")  # fmt: skip
            return  # a cache (DeepSpeed's loaders read it; no decision does): the next save writes it
        in_place = (store.root / pending.tag).exists()
        raise unwritable(e, pending.tag, store.root, in_place, "committing it") from None


def unwritable(e: OSError, tag: str, root: Path, in_place: bool, doing: str) -> Exception:
    """A checkpoint the disk would not take: a UserError (exit 2) naming the file, the error and what is kept
    where the user can act (a full disk, a quota, a read-only or forbidden directory: fs.ACTIONABLE); the error
    as it is otherwise."""
    from trainer.checkpoint.disk import named_by_latest
    from trainer.checkpoint.fs import ACTIONABLE, describe
    from trainer.common.errors import UserError

    if e.errno not in ACTIONABLE:
        return e
    before = named_by_latest(root)
    kept = (
        f"{tag} is in place, renamed before the error: the journal has no record of it yet, and the next start "
        "adopts it as its line's newest (its manifest names its line)"
        if in_place
        else f"{tag} was not committed: {before or 'no checkpoint'} stays the newest, intact, and {tag}'s staging "
        "directory is removed at the next start"
    )
    return UserError(
        f"checkpoint {tag}: {describe(e, e.filename or root, doing)}. {kept}. Free the space (or fix the "
        "permissions), then resume with --resume"
    )


def _write_now(store: Store, pending: Pending, rng: tuple[Path, Any]) -> None:
    """A synchronous save, every rank: its RNG, then DeepSpeed's shards (DeepSpeed barriers around), each
    written through write_file (fsynced by who wrote them, digested)."""
    from trainer.checkpoint.writer import recording_engine, write_file

    step, faults = pending.step, store.faults
    faults.files(step, 0)
    pending.written[str(rng[0])] = write_file(rng[0], rng[1])
    faults.files(step, 1)
    ds = store.engine.ds
    real = ds.checkpoint_engine
    ds.checkpoint_engine = recording_engine(
        real, pending.written, after=lambda: faults.files(step, len(pending.written))
    )
    faults.arm_save(step, ds.checkpoint_engine)
    try:
        store.ds_save(pending.stage_dir.name)
    finally:
        ds.checkpoint_engine = real


def _snapshot(store: Store, pending: Pending, rng: tuple[Path, Any]) -> None:
    """A background save, every rank: DeepSpeed's save_checkpoint through a SnapshotEngine (host
    copies of the state, queued, nothing written), then a Writer thread for this rank's files."""
    from trainer.checkpoint.writer import Writer, snapshot_engine

    ds = store.engine.ds
    real = ds.checkpoint_engine
    snap = ds.checkpoint_engine = snapshot_engine(real, store.copier)
    try:
        store.ds_save(pending.stage_dir.name)
    finally:
        ds.checkpoint_engine = real
    store.copier.mark()
    pending.snapshot_bytes = store.copier.bytes
    pending.writer = Writer(
        [rng, *snap.queued], copier=store.copier, faults=store.faults, step=pending.step,
        zipfile=snap.zipfile_serialization, report=(pending.stage_dir, store.rank),
    )  # fmt: skip


def _save_adapters(store: Store, stage_dir: Path, state: Any) -> dict[str, tuple[int, str]]:
    """model.lora: the checkpoint's verified adapter/ (trainer/model/adapters.py); rank 0 returns its
    files, fsynced, with their (bytes, digest) (written on the training thread, in any save mode)."""
    import os

    from trainer.checkpoint.writer import file_digest
    from trainer.model import adapters

    ds = store.engine.ds
    if not adapters.is_peft(ds.module):
        return {}
    out = stage_dir / adapters.ADAPTER_DIR  # every rank (a gather at ZeRO-3); rank 0 verifies and writes
    adapters.save(
        out, ds.module, zero3=ds.zero_optimization_stage() == 3,
        is_main=store.is_main, stepped=state.moved, base_name=store.exp.model.pretrained,
    )  # fmt: skip
    written = {}
    for f in sorted(out.rglob("*")) if store.is_main else ():
        if f.is_file():
            with open(f, "rb") as h:
                os.fsync(h.fileno())
            written[str(f)] = (f.stat().st_size, file_digest(f))
    return written


def metadata(store: Store, state: Any) -> dict[str, Any]:
    """trainer_state.json of a save of `state` as of its step (rank 0), less the manifest."""
    pos = store.stream.position
    return {
        "format_version": FORMAT_VERSION,
        **state.to_dict(),
        "epoch": pos.epoch,
        "data_position": {
            "epoch": pos.epoch,
            "sample": pos.sample,
            "samples_per_epoch": store.stream.sampler.n,
        },
        "data": store.data_fingerprint,
        "world_size": store.world_size,
        "zero_stage": store.engine.ds.zero_optimization_stage(),
        "offload": store.plan.get("offload", "none"),
        "plan": store.plan,
        "versions": versions(),
        "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "metrics": {},  # the last metrics and the wandb run id (a resumed run continues it)
        "wandb_run_id": None,
        **(store.recent() if store.recent is not None else {}),
        # Parameter names per optimizer group and tied aliases: reading a stage-0 checkpoint's
        # bf16/fp16 optimizer state (export) needs them; the module alone does not say.
        "param_groups": store.layout[0],
        "tied": store.layout[1],
        "resumed_from": store.resumed_from,  # the lineage: which checkpoint this line continued
    }
