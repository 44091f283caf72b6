"""Checkpoints you can trust.

Layout (one directory per checkpoint, `latest` names the newest complete one):

    <run_dir>/checkpoints/
      latest                  "step_00000500": replaced atomically, only after every rank finished
      step_00000500/
        ds_config.json        exactly the dict given to deepspeed.initialize
        experiment.yaml       the resolved experiment
        trainer_state.json    step, samples, tokens, data position, world size, stage, plan, versions,
                              wall time, metrics, the training data's fingerprint (compared on resume),
                              parameter names per optimizer group, and the manifest (every file with
                              its size)
        rng_rank00000.pt ...  per-rank RNG states (python, numpy, torch CPU and CUDA)
        ...DeepSpeed's files  mp_rank_00_model_states.pt, *_optim_states.pt

Saving: every rank writes into a hidden staging directory (`.tmp-step_00000500`); once every rank
has written its files, rank 0 writes the metadata and the manifest, renames the directory to its
final name and replaces `latest` (write, fsync, rename). In a synchronous save (`Store.save`) every
rank writes at once and a barrier says "all written"; in an asynchronous one (`checkpoint.async`,
`Store.start`, then `Store.commit` from the Checkpointer) each rank's writer thread writes a host
copy of the state while training goes on, and the ranks learn "all written" from the collective the
loop runs each step. A crash at any point leaves the previous checkpoint as `latest`; staging
leftovers are ignored on resume and removed by the next save. DeepSpeed's own `latest` (written by
rank 0 before the other ranks finish) is never used.

Resuming checks the manifest first (every file present with its size) on every rank: a truncated or
missing shard is reported by name before any rank loads anything; `--resume`/auto then fall back to
the previous complete checkpoint and say so, `--resume PATH` stops.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from trainer.checkpoint import frozen
from trainer.config import Experiment
from trainer.errors import UserError
from trainer.faults import Faults
from trainer.files import fsync_dir, write_atomic

log = logging.getLogger("trainer")

FORMAT_VERSION = 1
STEP_DIR = re.compile(r"^step_(\d{8})$")
STAGING_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
LATEST = "latest"
STATE = "trainer_state.json"

# ----------------------------------------------------------------------------- discovery (no torch)


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


@dataclass(frozen=True)
class Found:
    """A complete checkpoint on disk."""

    path: Path
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])

    @property
    def tag(self) -> str:
        return self.path.name


def read_state(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / STATE).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def verify(path: Path, state: Mapping[str, Any]) -> list[str]:
    """Problems with a checkpoint's files: missing or with another size than the manifest says."""
    out = []
    for rel, size in state.get("files", {}).items():
        f = path / rel
        try:
            actual = f.stat().st_size
        except FileNotFoundError:
            out.append(f"{f} is missing")
            continue
        if actual != size:
            out.append(f"{f} has {actual} bytes, the manifest says {size} (truncated or overwritten)")
    return out


def complete(root: Path) -> list[Found]:
    """Complete checkpoints under a checkpoints directory, oldest first (final names only)."""
    out = []
    if not root.is_dir():
        return out
    for d in root.iterdir():
        if d.is_dir() and STEP_DIR.match(d.name):
            state = read_state(d)
            if state is not None:
                out.append(Found(d, state))
    return sorted(out, key=lambda f: f.step)


def latest(root: Path) -> tuple[Found | None, list[str]]:
    """The newest complete checkpoint that passes verification, and warnings about skipped ones."""
    warnings: list[str] = []
    candidates = complete(root)
    named = None
    with contextlib.suppress(OSError):
        named = (root / LATEST).read_text().strip()
    # `latest` first, then newest to oldest (a deleted `latest` target falls back by itself).
    order = sorted(candidates, key=lambda f: (f.tag != named, -f.step))
    for found in order:
        problems = verify(found.path, found.state)
        if not problems:
            return found, warnings
        warnings.append(f"checkpoint {found.path} is damaged ({'; '.join(problems[:3])}); skipping it")
    return None, warnings


def before(found: Found) -> Found | None:
    """The complete checkpoint before `found` in its directory, if any."""
    older = [f for f in complete(found.path.parent) if f.step < found.step]
    return older[-1] if older else None


def resolve_resume(arg: str | None, mode: str, run_dir: str | Path) -> tuple[Found | None, list[str]]:
    """What to resume from: `--resume` (arg 'latest'), `--resume PATH`, or checkpoint.resume: auto."""
    root = checkpoints_dir(run_dir)
    if arg is None and mode == "never":
        existing = complete(root)
        if existing:
            raise UserError(
                f"{root} already holds checkpoints (newest: {existing[-1].tag}); starting fresh would mix runs. "
                f"Resume with --resume (or checkpoint.resume: auto), or choose another run_dir "
                f"(--set run_dir=...), or remove {root}"
            )
        return None, []
    if arg is None or arg == "latest":
        found, warnings = latest(root)
        if found is None:
            if arg is None:  # auto: nothing there yet, start fresh
                return None, warnings
            looked = f"looked in {root.resolve()} for '{LATEST}' and step_* directories"
            raise UserError(
                f"--resume: nothing to resume: no complete checkpoint ({looked}). " + " ".join(warnings)
            )
        return found, warnings
    path = Path(arg)
    if (path / STATE).exists():
        state = read_state(path)
        if state is None:
            raise UserError(f"--resume {arg}: {path / STATE} is not valid JSON; the checkpoint is damaged")
        problems = verify(path, state)
        if problems:
            raise UserError(f"--resume {arg}: the checkpoint is damaged: " + "; ".join(problems))
        return Found(path, state), []
    for root_guess in (path, path / "checkpoints"):  # a checkpoints dir or a run dir: take its latest
        if (root_guess / LATEST).exists() or complete(root_guess):
            found, warnings = latest(root_guess)
            if found is not None:
                return found, warnings
    raise UserError(
        f"--resume {arg}: not a checkpoint (no {STATE} in it) and no complete checkpoint below it; pass a "
        "step_XXXXXXXX directory, a checkpoints directory or a run directory"
    )


# ----------------------------------------------------------------------------- saving / loading


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


def set_rng_state(state: Mapping[str, Any]) -> None:
    import random

    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


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
    faults: Faults = field(default_factory=Faults)  # tests: kills during a save (trainer/faults.py)
    data_fingerprint: dict[str, Any] = field(default_factory=dict)  # Data.fingerprint, compared on resume
    recent: Callable[[], dict[str, Any]] | None = None  # what trainer_state.json shows of the run so far
    on_save: Callable[[int], None] | None = None  # tests: called on every rank with the step after each save
    _group: Any = None
    _deleting: Any = None  # the thread deleting pruned checkpoints
    copier: Any = None  # writer.HostCopier: the host copies of background saves (pinned buffers reused)
    omit_frozen: bool = False  # model.lora from model.pretrained: the frozen base stays out (frozen.py)
    frozen_digest: str | None = None  # model.lora: of the frozen weights (guard_frozen, or a resume's load)

    def __post_init__(self) -> None:
        from trainer.checkpoint.writer import HostCopier

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
            import torch.distributed as dist

            dist.barrier(group=self._group)

    def gather(self, values: list[int]) -> list[list[int]]:
        """Every rank's `values` (a few ints), on every rank (on the checkpoint's CPU group)."""
        from trainer.dist import gather_ints

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
        import torch

        from trainer.model import adapters

        t0 = time.perf_counter()
        tag = tag_for(state.step)
        staging = STAGING_PREFIX + tag
        stage_dir = self.root / staging
        if self.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            self._clean_leftovers(keep=staging)
            if stage_dir.exists():
                shutil.rmtree(stage_dir)
        self.barrier()
        stage_dir.mkdir(parents=True, exist_ok=True)
        # What trainer_state.json will say, taken now: the commit may come steps later.
        meta = self._metadata(state) if self.is_main else {}
        if frozen.guarded(self.exp):  # every rank (ZeRO-3 gathers): the frozen weights did not move
            now = self._digest_frozen()
            if self.frozen_digest is None:  # a Store whose first save comes before guard_frozen (--check's)
                self.frozen_digest = now
            elif now != self.frozen_digest:
                raise RuntimeError(
                    f"the frozen weights changed during training (digest {self.frozen_digest} -> {now}) on rank "
                    f"{self.rank}: something wrote to parameters that have no gradient; not saving step {state.step}"
                )
            meta[frozen.KEY] = frozen.record(self.exp, now)
        rng = (stage_dir / f"rng_rank{self.rank:05d}.pt", rng_state())
        ds = self.engine.ds
        pending = Pending(step=state.step, tag=tag, stage_dir=stage_dir, meta=meta, started=t0)
        if not background:  # every rank: its RNG, then DeepSpeed's shards (DeepSpeed barriers around)
            torch.save(rng[1], rng[0])
            self.faults.arm_save(state.step, ds.checkpoint_engine)
            ds.save_checkpoint(
                str(self.root), tag=staging, save_latest=False, exclude_frozen_parameters=self.omit_frozen
            )
        else:
            from trainer.checkpoint.writer import Writer, snapshot_engine

            real = ds.checkpoint_engine
            snap = ds.checkpoint_engine = snapshot_engine(real, self.copier)
            try:
                ds.save_checkpoint(
                    str(self.root), tag=staging, save_latest=False, exclude_frozen_parameters=self.omit_frozen
                )
            finally:
                ds.checkpoint_engine = real
            self.copier.mark()
            pending.snapshot_bytes = self.copier.bytes
            pending.writer = Writer(
                [rng, *snap.queued], copier=self.copier, faults=self.faults, step=state.step,
                zipfile=snap.zipfile_serialization,
            )  # fmt: skip
        if adapters.is_peft(ds.module):  # every rank (a gather at ZeRO-3); rank 0 verifies and writes
            adapters.save(
                stage_dir / adapters.ADAPTER_DIR, ds.module, zero3=ds.zero_optimization_stage() == 3,
                is_main=self.is_main, stepped=state.moved, base_name=self.exp.model.pretrained,
            )  # fmt: skip
        pending.blocked_s = pending.copy_s = time.perf_counter() - t0
        if self.on_save is not None:
            self.on_save(state.step)
        return pending

    def commit(self, pending: Pending) -> Path:
        """Every rank, once every rank has written its files: rank 0 writes the metadata and the
        manifest, renames the staging directory to its final name and replaces `latest`."""
        self.faults.at("killcommit", pending.step)
        t0 = time.perf_counter()
        final = self.root / pending.tag
        if self.is_main:
            # A synchronous save's files are made durable here; a background writer fsyncs its own.
            self._write_metadata(pending.stage_dir, pending.meta, fsync=pending.writer is None)
            if final.exists():  # an older run reached this step too: replace it
                trash = self.root / (TRASH_PREFIX + pending.tag)
                shutil.rmtree(trash, ignore_errors=True)
                os.rename(final, trash)
            os.rename(pending.stage_dir, final)
            fsync_dir(self.root)
            write_atomic(self.root / LATEST, pending.tag + "\n", durable=True)
            shutil.rmtree(self.root / (TRASH_PREFIX + pending.tag), ignore_errors=True)  # the replaced one
        pending.commit_s = time.perf_counter() - t0
        if pending.writer is None:
            self.barrier()
            pending.blocked_s = time.perf_counter() - pending.started
        else:
            pending.blocked_s += pending.commit_s
        return final

    def guard_frozen(self) -> None:
        """model.lora: the digest every save compares with, taken once, before the first step (build
        calls it after a resume's load, which takes it itself); every rank (ZeRO-3 gathers)."""
        if self.frozen_digest is None and frozen.guarded(self.exp):
            self.frozen_digest = self._digest_frozen()

    def _digest_frozen(self) -> str:
        """frozen.digest of the engine's frozen weights; every rank."""
        ds = self.engine.ds
        return frozen.digest(ds.module, zero3=ds.zero_optimization_stage() == 3)

    def _metadata(self, state: Any) -> dict[str, Any]:
        pos = self.stream.position
        return {
            "format_version": FORMAT_VERSION,
            **state.to_dict(),
            "epoch": pos.epoch,
            "data_position": {
                "epoch": pos.epoch,
                "sample": pos.sample,
                "samples_per_epoch": self.stream.sampler.n,
            },
            "data": self.data_fingerprint,
            "world_size": self.world_size,
            "zero_stage": self.engine.ds.zero_optimization_stage(),
            "offload": self.plan.get("offload", "none"),
            "plan": self.plan,
            "versions": versions(),
            "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "metrics": {},  # the last metrics and the wandb run id (a resumed run continues it)
            "wandb_run_id": None,
            **(self.recent() if self.recent is not None else {}),
            # Parameter names per optimizer group and tied aliases: reading a stage-0 checkpoint's
            # bf16/fp16 optimizer state (export) needs them; the module alone does not say.
            "param_groups": self.layout[0],
            "tied": self.layout[1],
        }

    def _write_metadata(self, stage_dir: Path, meta: dict[str, Any], fsync: bool = True) -> None:
        (stage_dir / "ds_config.json").write_text(json.dumps(self.engine.ds_config, indent=2) + "\n")
        (stage_dir / "experiment.yaml").write_text(self.exp.to_yaml())
        files = {}
        for p in sorted(stage_dir.rglob("*")):
            if p.is_file() and p.name != STATE:
                if fsync or p.name in ("ds_config.json", "experiment.yaml") or p.suffix == ".py":
                    with open(p, "rb") as f:
                        os.fsync(f.fileno())
                files[str(p.relative_to(stage_dir))] = p.stat().st_size
        write_atomic(stage_dir / STATE, json.dumps({**meta, "files": files}, indent=2) + "\n", durable=True)

    def _clean_leftovers(self, keep: str) -> None:
        """Remove staging and trash directories left by crashed saves or prunes."""
        for d in self.root.iterdir():
            if d.is_dir() and d.name.startswith((STAGING_PREFIX, TRASH_PREFIX)) and d.name != keep:
                log.info(f"removing {d} (left by an interrupted save)")
                shutil.rmtree(d, ignore_errors=True)

    def prune(self, keep_last: int, keep: str) -> None:
        """Keep the newest `keep_last` complete checkpoints (`keep` among them; 0 = all), after the commit."""
        n = keep_last
        if n <= 0:
            return
        done = [f for f in complete(self.root) if f.tag != keep]
        trash = []
        for old in done[: max(0, len(done) - (n - 1))]:
            trash.append(self.root / (TRASH_PREFIX + old.tag))
            os.rename(old.path, trash[-1])  # atomic: never a half-deleted "complete" checkpoint
        if trash:  # unlinking gigabytes can take a second: not on the training thread
            import threading

            self.wait_deletes()
            self._deleting = threading.Thread(
                target=lambda: [shutil.rmtree(t, ignore_errors=True) for t in trash],
                name="prune",
                daemon=True,
            )
            self._deleting.start()

    def wait_deletes(self) -> None:
        """Until the pruned checkpoints are deleted (the end of training; a kill leaves a `.trash-`
        directory, which the next save removes)."""
        if self._deleting is not None:
            self._deleting.join()
            self._deleting = None

    def load(self, found: Found, state: Any, wait_s: float = 7200.0) -> None:
        """Restore weights, optimizer, scheduler, step, data position and this rank's RNG. `wait_s`:
        how long every rank waits for a conversion to another stage or world size."""
        import torch

        from trainer.checkpoint import reshard

        saved = found.state
        same_world = saved["world_size"] == self.world_size
        names, aliases = self.layout
        rec = frozen.saved(saved)
        custom = None
        if rec is not None and rec.get("omitted"):  # the module may lack the frozen weights, and only those
            custom = frozen.strict_but_frozen(frozen.frozen_names(self.engine.ds.module), found.path)
        try:
            reshard.load(
                self.engine, found.path, names, aliases, self.rank, self._group, wait_s=wait_s,
                custom_load_fn=custom,
            )  # fmt: skip
        except (UserError, torch.OutOfMemoryError):
            raise
        except Exception as e:  # noqa: BLE001  (a checkpoint that does not load will not load next time)
            log.debug("loading the checkpoint failed", exc_info=True)
            raise reshard.ResumeError(
                f"resuming from {found.path} failed on rank {self.rank}: {type(e).__name__}: {e}"
            ) from e
        from trainer.engine import resume_schedule

        resume_schedule(self.engine.scheduler)
        if frozen.guarded(self.exp):  # every rank (ZeRO-3 gathers): the frozen weights are the run's
            self.frozen_digest = self._digest_frozen()
            problem = frozen.mismatch(found.path, rec, self.frozen_digest, frozen.RESUME_FIX) if rec else None
            bad = [r for r, (flag,) in enumerate(self.gather([int(problem is not None)])) if flag]
            if bad:  # every rank stops, with rank 0's words where it has them
                raise reshard.ResumeError(
                    problem
                    or f"{found.path}: rank(s) {bad} hold other frozen weights than the run trained on "
                    f"({frozen.RESUME_FIX.lower()})"
                )
        state.step = int(saved["step"])
        state.samples = int(saved["samples"])
        state.tokens = int(saved["tokens"])
        state.wall_time = float(saved.get("wall_time", 0.0))
        # saved before the flag existed: unknown, so not claimed (the next step with a nonzero LR sets it)
        state.moved = bool(saved.get("moved", False))
        from trainer.data import Position

        pos = saved["data_position"]
        self.stream.seek(Position(int(pos["epoch"]), int(pos["sample"])))
        rng = found.path / f"rng_rank{self.rank:05d}.pt"
        if same_world and rng.exists():
            set_rng_state(torch.load(rng, weights_only=False))
        else:  # another world size: a fresh, still deterministic, per-rank stream
            from trainer.dist import seed_all

            seed_all(self.exp.seed + 1 + self.rank + 1_000_003 * state.step)
