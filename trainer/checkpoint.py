"""Checkpoints (placeholder until the checkpoint module lands)."""

from __future__ import annotations

from typing import Any


class Checkpointer:
    def __init__(self, section: Any, run_dir: Any, *, engine: Any, stream: Any, is_main: bool) -> None:
        self.section = section

    def offer(self, state: Any, force: bool = False, final: bool = False) -> None:
        return None
