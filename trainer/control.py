"""Run control: preemption signals agreed by every rank, and faults injected by tests.

A signal (SIGTERM, SIGUSR1) may reach one rank only. Each step the ranks agree on "someone was
asked to stop" with one all-reduce of a flag on a CPU (gloo) group, so all of them finish the same
step, save the same checkpoint and exit together. The CPU group never synchronises the GPU.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

from trainer.dist import Fault

log = logging.getLogger("trainer")


class Control:
    def __init__(
        self, *, rank: int, world_size: int, attempt: int, faults: list[Fault], handle_signals: bool
    ) -> None:
        self.rank, self.world_size, self.attempt = rank, world_size, attempt
        self.faults = faults
        self._signalled: int | None = None
        self._group: Any = None
        if handle_signals:
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(sig, self._on_signal)
        if world_size > 1:
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo")

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._signalled = signum
        log.warning(f"rank {self.rank}: received {signal.Signals(signum).name}; saving after this step")

    @property
    def signalled(self) -> int | None:
        return self._signalled

    def agree(self, time_due: bool) -> tuple[bool, bool]:
        """(stop, timed save due) on every rank: any rank signalled / any rank's clock says a timed
        checkpoint is due. One tiny all-reduce per step on a CPU group."""
        flags = [self._signalled is not None, time_due]
        if self._group is None:
            return flags[0], flags[1]
        import torch
        import torch.distributed as dist

        t = torch.tensor(flags, dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group)
        return bool(t[0]), bool(t[1])

    def before_step(self, step: int) -> None:
        """Apply injected faults for this step (tests only; TRAINER_FAULT)."""
        for f in self.faults:
            if f.applies(step, self.rank, self.attempt):
                self._inject(f, step)

    def at(self, point: str, step: int) -> None:
        """`killcommit`: die after every rank has written its shards, before `latest` is updated."""
        for f in self.faults:
            if f.kind == point and f.applies(step, self.rank, self.attempt):
                log.warning(f"injected {point} at rank {self.rank} step {step} (TRAINER_FAULT)")
                os.kill(os.getpid(), signal.SIGKILL)

    def arm_save(self, step: int, writer: Any) -> None:
        """`killsave`: die in the middle of this rank's shard writes (after a pause, so that the
        other ranks finish theirs first): wraps DeepSpeed's checkpoint writer for this save."""
        if not any(f.kind == "killsave" and f.applies(step, self.rank, self.attempt) for f in self.faults):
            return
        real = writer.save

        def save_then_die(*args: Any, **kwargs: Any) -> Any:
            time.sleep(2.0)
            real(*args, **kwargs)
            log.warning(f"injected killsave at rank {self.rank} step {step} (TRAINER_FAULT)")
            os.kill(os.getpid(), signal.SIGKILL)

        writer.save = save_then_die

    def check_loss(self, loss: Any, step: int) -> Any:
        for f in self.faults:
            if f.kind == "nan" and f.applies(step, self.rank, self.attempt):
                return loss * float("nan")
        return loss

    def _inject(self, f: Fault, step: int) -> None:
        import torch

        where = f"rank {self.rank} step {step}"
        if f.kind == "oom":
            raise torch.OutOfMemoryError(f"injected out-of-memory at {where} (TRAINER_FAULT)")
        if f.kind == "raise":
            raise RuntimeError(f"injected failure at {where} (TRAINER_FAULT)")
        if f.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if f.kind == "exit":
            os._exit(1)
        if f.kind == "sleep":
            log.warning(f"injected hang at {where} (TRAINER_FAULT)")
            while True:
                time.sleep(3600)
        if f.kind == "term":
            os.kill(os.getpid(), signal.SIGTERM)
