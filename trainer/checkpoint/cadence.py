"""When to save: the checkpointer keeps its own cadence (`checkpoint.every_steps`, `every_minutes`
whichever comes first, a final save, a save on a stop request) and hands each save to the store,
then prunes to `keep_last` (only after the new checkpoint is complete)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.checkpoint.store import Found, Store
from trainer.config import CheckpointSection


@dataclass
class Checkpointer:
    """The loop offers it every step; it decides, and saves through its `store`."""

    section: CheckpointSection
    store: Store
    last_saved_step: int = -1
    _last_save_time: float = field(default_factory=time.monotonic)

    def minutes_due(self) -> bool:
        """This rank's clock says a timed save is due (agreed across ranks by the caller)."""
        m = self.section.every_minutes
        return m > 0 and time.monotonic() - self._last_save_time >= m * 60

    def offer(self, state: Any, *, force: bool = False, final: bool = False, time_due: bool = False) -> bool:
        """Called by the loop after every step; saves when the cadence says so."""
        if state.step == self.last_saved_step:
            return False
        every = self.section.every_steps
        due = (
            force
            or time_due
            or (final and self.section.save_final)
            or (every > 0 and state.step % every == 0)
        )
        if due:
            self.save(state)
        return due

    def save(self, state: Any) -> Path:
        path = self.store.save(state)
        if self.store.is_main:
            self.store.prune(self.section.keep_last, keep=path.name)
        self._saved(state.step)
        return path

    def load(self, found: Found, state: Any) -> None:
        self.store.load(found, state, wait_s=self.section.convert_timeout_minutes * 60)
        self._saved(state.step)

    def _saved(self, step: int) -> None:
        self.last_saved_step = step
        self._last_save_time = time.monotonic()
