"""Run control: what keeps every rank doing the same thing, and ends a job that cannot go on.

- Preemption: a signal (SIGTERM, SIGUSR1) may reach one rank only. Each step the ranks agree on
  "someone was asked to stop" with one all-reduce of a flag on a CPU (gloo) group, so all of them
  finish the same step, save the same checkpoint and exit together. The CPU group never
  synchronises the GPU.
- NaN guard: a non-finite loss on any rank stops every rank at that step, before the update, so
  the weights stay finite and identical (fp16 is left to DeepSpeed's loss scaler, which skips the
  step on every rank).
- Watchdog: a rank that makes no progress (no step, eval or save) for `dist.watchdog_s` dumps
  every thread's stack and exits; faulthandler runs it from a C thread, so it fires even when
  Python is stuck in a collective or in I/O. The launcher then ends the other ranks.
- Faults injected by the tests (trainer/common/faults.py) at the start of each step.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

from trainer.common.faults import Faults

log = logging.getLogger("trainer")


class Watchdog:
    """Ends this rank when nothing calls `pet()` for `timeout_s`: dumps every thread's stack and exits
    1; the launcher then ends the other ranks, whose own watchdogs fire too. A faulthandler dump
    30-60 s later is the backstop for a thread that holds the GIL forever (it needs no GIL, but
    cannot clean up)."""

    BACKSTOP_S = 60.0

    def __init__(self, timeout_s: float, rank: int) -> None:
        import threading

        self.timeout_s, self.rank = timeout_s, rank
        self._deadline = time.monotonic() + timeout_s
        self._cond = threading.Condition()
        self._stopped = False
        self._armed = -float("inf")  # when the faulthandler backstop was last armed
        self._thread = threading.Thread(target=self._run, name="trainer-watchdog", daemon=True)
        self._thread.start()

    def pet(self) -> None:
        now = time.monotonic()
        with self._cond:
            self._deadline = now + self.timeout_s
        # The backstop is re-armed at most every BACKSTOP_S / 2, so it fires 30-60 s after the
        # watchdog would have: each re-arm joins faulthandler's thread and starts a new one, too
        # costly to do at every pet (twice a step).
        if now - self._armed >= self.BACKSTOP_S / 2:
            self._armed = now
            faulthandler.dump_traceback_later(self.timeout_s + self.BACKSTOP_S, exit=True, file=sys.stderr)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        faulthandler.cancel_dump_traceback_later()

    def _run(self) -> None:
        with self._cond:
            while not self._stopped:
                left = self._deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if self._stopped:
                return
        sys.stderr.write(
            f"watchdog: rank {self.rank} made no progress (no step, eval or save) for {self.timeout_s:.0f} s "
            "(dist.watchdog_s); ending the job. Stacks of every thread:\n"
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(1)


@dataclass(frozen=True)
class Agreed:
    """Control.agree's answer, the same on every rank."""

    stop: bool = False  # some rank was asked to stop: save and stop after this step
    timed: bool = False  # some rank's clock says a timed checkpoint is due
    written: bool = True  # every rank has written its part of the checkpoint in flight (or none is)
    write_failed: tuple[int, ...] = ()  # ranks whose background checkpoint write failed
    write_s: float = 0.0  # the longest background write time so far


class NonFiniteLoss(Exception):
    """The loss was NaN or infinite on some rank; every rank raises it at the same step."""


class Control:
    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        faults: Faults,
        handle_signals: bool,
        watchdog_s: float = 0.0,
        nan_check: bool = True,
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self.faults = faults
        self.watchdog_s = watchdog_s
        self._watchdog: Watchdog | None = None
        self.nan_check = nan_check
        self.on_first_step: Any = None  # called once, before step 2 (post-first-step consistency checks)
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

    def agree(
        self, time_due: bool, finite: Any = None, step: int = 0, write: tuple[int, float] = (0, 0.0)
    ) -> Agreed:
        """What every rank does next, the same on every rank: stop (any rank signalled), a timed
        checkpoint (any rank's clock says it is due), and the state of a checkpoint being written in
        the background (`write`: this rank's writer status, 0 done / 1 writing / 2 failed, and its
        write time so far). Raises NonFiniteLoss on every rank if any rank's loss was not finite
        (`finite`: the flag from `finite()`, read here once). One tiny all-gather per step on a CPU
        group, after the step's backward and before its optimizer update."""
        bad = 0 if finite is None else int(not bool(finite))
        from trainer.cluster.dist import gather_ints

        mine = [int(self._signalled is not None), int(time_due), bad, int(write[0]), int(write[1] * 1000)]
        flags = gather_ints(mine, self.world_size, self._group)
        nonfinite = [r for r, f in enumerate(flags) if f[2]]
        if nonfinite:
            raise NonFiniteLoss(
                f"non-finite loss at step {step} on rank(s) {', '.join(map(str, nonfinite))}: every rank stops "
                "before the optimizer update, so the weights stay as after the previous step. Typical causes: a "
                "learning rate too high (optim.lr, optim.warmup_steps), fp16 overflow (use train.precision: bf16), "
                "bad data"
            )
        return Agreed(
            stop=any(f[0] for f in flags),
            timed=any(f[1] for f in flags),
            written=all(f[3] == 0 for f in flags),
            write_failed=tuple(r for r, f in enumerate(flags) if f[3] == 2),
            write_s=max(f[4] for f in flags) / 1000,
        )

    def heartbeat(self) -> None:
        """Progress: (re)arm the watchdog for another `watchdog_s` (started at the first call)."""
        if self.watchdog_s <= 0:
            return
        if self._watchdog is None:
            self._watchdog = Watchdog(self.watchdog_s, self.rank)
        self._watchdog.pet()

    def disarm(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None

    def before_step(self, step: int) -> None:
        """Every step: the watchdog, the first-step checks, injected faults (TRAINER_FAULT)."""
        self.heartbeat()
        if step == 2 and self.on_first_step is not None:
            self.on_first_step()
            self.on_first_step = None
        self.faults.before_step(step)

    def finite(self, loss: Any, so_far: Any = None) -> Any:
        """Whether this step's micro-batch losses so far were all finite, as a device flag (no host
        read: `agree` reads it once per step). None when the check is off."""
        if not self.nan_check:
            return None
        import torch

        ok = torch.isfinite(loss).all()
        return ok if so_far is None else so_far & ok


def ignore_sigterm_after_save() -> None:
    """After a stop on request has saved: SIGTERM is ignored, so this rank ends with the stop's own exit code.
    srun --kill-on-bad-exit sends SIGTERM to the ranks still tearing down once the first has exited with the
    stop's code; a 143 failed the documented script's requeue. A Python handler is not enough: the interpreter
    restores the default action while it finalizes (torch's teardown is long), and a SIGTERM there ends the
    process with 143; an ignored signal stays ignored to the end (tests/unit/test_control_signals.py)."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
