"""When to save, and the life of a save: the checkpointer keeps its own cadence
(`checkpoint.every_steps`, `every_minutes` whichever comes first, a final save, a save on a stop
request), hands each save to the store and prunes to `keep_last` only after the new checkpoint is
committed.

Asynchronous saves (`checkpoint.async`): a save takes the host copy and returns; the loop's one
collective per step tells every rank when every rank's writer is done (then rank 0 commits) or has
failed (then every rank stops with the error). At most one save is in flight: a save that comes due
while the previous one is still being written waits for it (training blocks until it is committed;
no save is skipped). A stop request and the end of training wait for the write in flight, then save
the current step and wait for that too.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.checkpoint import restore
from trainer.checkpoint.disk import Found, tag_for
from trainer.checkpoint.interval import AutoInterval
from trainer.checkpoint.store import Pending, Store
from trainer.cluster.control import Agreed
from trainer.common.units import format_size
from trainer.config import CheckpointSection

log = logging.getLogger("trainer")


def _prune(store: Any, keep_last: int, step: int) -> None:
    """checkpoint.keep_last after a commit (rank 0). A disk that will not take the prune's record (full, a quota:
    fs.ACTIONABLE) ends nothing: the checkpoint is committed, the prune's record comes before any removal (one
    written is carried out by the next start), and the next save prunes again or says what the disk refuses."""
    from trainer.checkpoint.fs import ACTIONABLE, describe

    try:
        store.disk.prune(keep_last, renamed=lambda: store.faults.at("killprune", step))
    except OSError as e:
        if e.errno not in ACTIONABLE:
            raise
        log.warning(f"checkpoint.keep_last: {describe(e, e.filename or store.root, 'pruning')}; the prune stopped "
                    "there (what it recorded, the next start removes) and the next save prunes again")  # fmt: skip


class CheckpointWriteError(RuntimeError):
    """A background checkpoint write failed on some rank; every rank raises it at the same step. `user`: this
    rank's own write failed for a reason the user can act on (space, quota, permissions: exit 2, not retried)."""

    def __init__(self, message: str, user: bool = False) -> None:
        super().__init__(message)
        self.user = user


@dataclass
class Cadence:
    """When a save is due: every `every_steps` steps, `every_minutes` after the last save (whichever
    comes first), at the end (`save_final`), or when forced (a stop request)."""

    section: CheckpointSection
    last_saved_step: int = -1
    _last_save_time: float = field(default_factory=time.monotonic)
    auto: AutoInterval | None = None  # every_minutes: auto (interval.py)

    def minutes_due(self) -> bool:
        """This rank's clock says a timed save is due (agreed across ranks by the caller)."""
        m = self.auto.minutes if self.auto is not None else self.section.every_minutes
        return m != "auto" and m > 0 and time.monotonic() - self._last_save_time >= m * 60

    def due(self, step: int, *, force: bool, final: bool, time_due: bool) -> bool:
        every = self.section.every_steps
        return force or time_due or (final and self.section.save_final) or (every > 0 and step % every == 0)

    def saved(self, step: int) -> None:
        self.last_saved_step = step
        self._last_save_time = time.monotonic()


@dataclass
class Checkpointer:
    """The loop offers it every step; it decides, and saves through its `store`."""

    section: CheckpointSection
    store: Store
    background: bool = False  # checkpoint.async as resolved for this run (build.py)
    record: Any = None  # metrics.record (rank 0): one record per committed save
    heartbeat: Any = None  # Control.heartbeat: waiting on a write is progress
    inflight: Pending | None = None
    _step: int = 0  # the step training is at (a background save is committed steps after its own)
    cadence: Cadence = field(init=False)

    def __post_init__(self) -> None:
        self.cadence = Cadence(self.section)

    def minutes_due(self) -> bool:
        """This rank's clock says a timed save is due (agreed across ranks by the caller)."""
        return self.cadence.minutes_due()

    def write_status(self) -> tuple[int, float]:
        """This rank's part of the save in flight, for Control.agree: (0 done / 1 writing / 2 failed,
        seconds written so far)."""
        w = self.inflight.writer if self.inflight is not None else None
        if w is None:
            return 0, 0.0
        return w.status, w.seconds or time.perf_counter() - self.inflight.started

    def offer(
        self,
        state: Any,
        *,
        force: bool = False,
        final: bool = False,
        time_due: bool = False,
        agreed: Agreed | None = None,
    ) -> bool:
        """Called by the loop after every step (`agreed`: that step's Control.agree); commits the save
        in flight once every rank wrote its part, and saves when the cadence says so."""
        self._step = state.step
        if self.inflight is not None and agreed is not None:
            self._settle(agreed.written, agreed.write_failed, agreed.write_s)
        if not (final or force):
            return self._offer(state, force=False, final=False, time_due=time_due)
        # The job ends after this: every write and deletion finished, and every rank leaves together
        # (as after a synchronous save), not one still committing while the others tear down the
        # process group.
        due = self._offer(state, force=force, final=final, time_due=time_due)
        self.store.disk.wait_deletes()
        self.store.barrier()
        return due

    def _offer(self, state: Any, *, force: bool, final: bool, time_due: bool) -> bool:
        if state.step == self.cadence.last_saved_step:
            if final or force:
                self.finish()
            return False
        due = self.cadence.due(state.step, force=force, final=final, time_due=time_due)
        if due:
            self.save(state, wait=force or final)
        elif final:
            self.finish()
        return due

    def save(self, state: Any, wait: bool = True) -> Path | None:
        """Save `state`; in the background unless `wait` (or checkpoint.async is off)."""
        self._step = state.step
        self.finish()  # at most one save in flight: the one before is committed first
        if not self.background:
            pending = self.store.start(state, background=False)
            self.store.barrier()
            path = self._commit(pending, pending.blocked_s)
        else:
            self.inflight = self.store.start(state, background=True)
            path = None
            if wait:
                self.finish()
                path = self.store.root / tag_for(state.step)
        self.cadence.saved(state.step)
        return path

    def finish(self) -> None:
        """Wait until the save in flight is written on every rank, then commit it (every rank calls
        this at the same point: one all-gather of each rank's writer status)."""
        if self.inflight is None:
            return
        w = self.inflight.writer
        t0 = time.perf_counter()
        w.wait(self.heartbeat)
        self.inflight.blocked_s += time.perf_counter() - t0
        status = self.store.gather([w.status, int(w.seconds * 1000)])
        self._settle(
            all(s[0] == 0 for s in status),
            tuple(r for r, s in enumerate(status) if s[0] == 2),
            max(s[1] for s in status) / 1000,
        )

    def _settle(self, written: bool, failed: tuple[int, ...], write_s: float) -> None:
        pending = self.inflight
        if failed:
            self.inflight = None
            w = pending.writer
            mine = f" here: {w.describe_error()}" if w.error is not None else ""
            from trainer.checkpoint.disk import named_by_latest
            from trainer.checkpoint.fs import ACTIONABLE

            before, user = named_by_latest(self.store.root), getattr(w.error, "errno", None) in ACTIONABLE
            raise CheckpointWriteError(
                f"checkpoint {pending.tag}: writing it failed on rank(s) {', '.join(map(str, failed))}{mine}. "
                f"It was not committed; `latest` still names {before or 'the checkpoint before it'}, kept intact. "
                f"Check the space and permissions of {self.store.root}, then resume with --resume",
                user=user,
            )
        if written:
            self.inflight = None
            self._commit(pending, write_s)

    def _commit(self, pending: Pending, write_s: float) -> Path:
        path = self.store.commit(pending)
        moved = self.cadence.auto.observe(pending.blocked_s) if self.cadence.auto is not None else None
        if self.store.is_main:
            if moved:
                log.info(moved)
            t0 = time.perf_counter()
            _prune(self.store, self.section.keep_last, pending.step)
            pending.commit_s += time.perf_counter() - t0
            pending.blocked_s += time.perf_counter() - t0
            _report(pending, path, write_s, self._step, self.record)
        return path

    def salvage(self) -> None:
        """A step failed (an exception, a non-finite loss, an out-of-memory) with a background save in
        flight: commit it if every rank finished writing it (Store.salvage), else leave it uncommitted.
        Every rank, on its way out; never raises (the step's own error is what the job ends with)."""
        pending, self.inflight = self.inflight, None
        if pending is None or pending.writer is None:
            return
        try:
            path = self.store.salvage(pending)
        except Exception as e:  # noqa: BLE001  (the failure being handled is the one to report)
            log.warning(f"warning: the background save of step {pending.step} could not be committed: {e}")
            return
        if path is not None:
            log.info(
                f"checkpoint {path} committed on the way out (written in the background before the step failed)"
            )

    def load(self, found: Found, state: Any) -> None:
        restore.load(self.store, found, state, wait_s=self.section.convert_timeout_minutes * 60)
        self.cadence.saved(state.step)


def _report(pending: Pending, path: Path, write_s: float, step: int, record: Any) -> None:
    """Rank 0, after a commit: the log line and the metrics record of the save (`step`: the step
    training is at)."""
    if pending.writer is None:
        log.info(f"checkpoint {path} saved in {pending.blocked_s:.1f} s")
    else:
        log.info(
            f"checkpoint {path} saved: training blocked {pending.blocked_s:.2f} s (host copy "
            f"{format_size(pending.snapshot_bytes)} on rank 0), written in the background in {write_s:.1f} s"
        )
    if record is not None:
        record(
            {
                "step": step,
                "checkpoint": pending.tag,
                "saved_step": pending.step,
                "async": pending.writer is not None,
                "blocked_s": pending.blocked_s,
                "copy_s": pending.copy_s if pending.writer is not None else 0.0,
                "commit_s": pending.commit_s,
                "write_s": write_s if pending.writer is not None else pending.blocked_s,
            }
        )
