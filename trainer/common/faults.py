"""Faults the tests inject, in one place: `TRAINER_FAULT=kind@step[:rank=R][:attempt=A][:ms=M],...`.

Production code calls a `Faults` object (bound to this rank and attempt) at named points; with
`TRAINER_FAULT` unset every call does nothing. The points and what the kinds do there:

- `before_step(step)`, at the start of each step (trainer/run/loop.py, through Control): oom (raise
  torch.OutOfMemoryError), raise (RuntimeError), kill (SIGKILL self), exit (os._exit(1)), sleep
  (hang), term (SIGTERM self);
- `loss(loss, step)`, on each micro batch's loss: nan (a NaN loss), slow (M ms more per step from
  `step` on, default 100: a straggler);
- `perturb(module)`, after DeepSpeed's initial broadcast: perturb@0 (change one weight);
- `before_write(step)`/`after_write(step)` around the writing of this rank's files of a save (in
  the writer thread of an asynchronous save; through `arm_save` in a synchronous one) and
  `at("killcommit", step)`: killsave (SIGKILL once this rank's files are written, after a 2 s pause
  so that the other ranks finish theirs), slowsave (M ms longer), failsave (an OSError "no space
  left on device"), killcommit (SIGKILL after every rank wrote its files, before `latest` is
  replaced); `stuck_file(step, path)` before each file of a background write: hangwrite (the file a
  FIFO nobody reads, so that opening it blocks as on a hung network mount);
- the boundaries of a save and its publication, each a SIGKILL: killfile (`files(step, n)` before each
  of this rank's files and after the last: dies when `:n=N` of them are written, N = 0 before the
  first), killmanifest (the manifest written, the staging directory not yet renamed), killrename
  (renamed, `latest` not yet replaced), killlatest (`latest` replaced, nothing pruned yet), killprune
  (the first old checkpoint renamed to its trash name, not yet deleted); `full(point, step, path)` rank 0's
  commit on a full disk (ENOSPC naming `path`): fullmanifest (before the manifest), fulljournal (renamed into
  place, the journal's record not written);
- the start of a run in its checkpoints directory (rank 0, trainer/checkpoint/begin.py), each a SIGKILL:
  killstart (before anything there moves: a rollback's fork not yet recorded), killfork (a fork
  recorded and its first checkpoint moved to abandoned/, the rest not yet);
- `stale_resume()`, when choosing the checkpoint to resume: staleresume@0 (this rank takes the one
  before the latest, as a node-local or stale run_dir would show it);
- `conversion()`, in the process converting a checkpoint for another stage or world size, before
  the result is put in place: convertfail (raise), convertslow (M ms longer), convertkill (SIGKILL
  the rank that started it).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("trainer")

ENV_FAULT = "TRAINER_FAULT"


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None = None
    attempt: int | None = None
    ms: int = 100
    n: int = 0  # killfile: how many of this rank's files are written when it dies

    def applies(self, step: int, rank: int, attempt: int) -> bool:
        return (
            step == self.step
            and (self.rank is None or self.rank == rank)
            and (self.attempt is None or self.attempt == attempt)
        )


def parse(spec: str) -> list[Fault]:
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        head, *opts = item.split(":")
        kind, _, step = head.partition("@")
        kw: dict[str, Any] = {"kind": kind, "step": int(step or 0)}
        for opt in opts:
            k, _, v = opt.partition("=")
            kw[k] = int(v)
        out.append(Fault(**kw))
    return out


class Faults:
    """The faults `TRAINER_FAULT` asks of this rank and attempt, at the points named above."""

    def __init__(self, rank: int = 0, attempt: int = 0, spec: str | None = None) -> None:
        self.rank, self.attempt = rank, attempt
        self.faults = parse(os.environ.get(ENV_FAULT, "") if spec is None else spec)

    def _due(self, kind: str, step: int = 0) -> Fault | None:
        return next(
            (f for f in self.faults if f.kind == kind and f.applies(step, self.rank, self.attempt)), None
        )

    def before_step(self, step: int) -> None:
        import torch

        where = f"rank {self.rank} step {step}"
        for f in self.faults:
            if not f.applies(step, self.rank, self.attempt):
                continue
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

    def loss(self, loss: Any, step: int) -> Any:
        for f in self.faults:
            if f.kind == "nan" and f.applies(step, self.rank, self.attempt):
                loss = loss * float("nan")
            if f.kind == "slow" and step >= f.step and f.applies(f.step, self.rank, self.attempt):
                time.sleep(f.ms / 1000)  # a straggler: this rank's compute takes longer from step f.step on
        return loss

    def perturb(self, module: Any) -> None:
        import torch

        if self._due("perturb"):
            with torch.no_grad():
                next(module.parameters()).data.add_(1e-3)
            log.warning(f"injected a parameter perturbation on rank {self.rank} (TRAINER_FAULT)")

    def files(self, step: int, written: int) -> None:
        """killfile: die when `written` of this rank's files of the save at `step` are on disk."""
        for f in self.faults:
            if f.kind == "killfile" and f.n == written and f.applies(step, self.rank, self.attempt):
                log.warning(
                    f"injected killfile at rank {self.rank} step {step} after {written} file(s) (TRAINER_FAULT)"
                )
                os.kill(os.getpid(), signal.SIGKILL)

    def at(self, point: str, step: int) -> None:
        """killcommit, killmanifest, killrename, killlatest, killprune: die here."""
        if self._due(point, step):
            log.warning(f"injected {point} at rank {self.rank} step {step} (TRAINER_FAULT)")
            os.kill(os.getpid(), signal.SIGKILL)

    def full(self, point: str, step: int, path: Any) -> None:
        """fullmanifest (before the manifest is written), fulljournal (the checkpoint renamed into place, its
        journal record not yet written): the disk is full there, as an OSError of `path` says it."""
        if self._due(point, step):
            import errno

            raise OSError(
                errno.ENOSPC, f"No space left on device (injected {point}, TRAINER_FAULT)", str(path)
            )

    def arm_save(self, step: int, writer: Any) -> None:
        """A synchronous save: wrap DeepSpeed's checkpoint writer for this save with `before_write`
        and `after_write` (an asynchronous save's writer thread calls them itself)."""
        if not any(self._due(kind, step) for kind in ("killsave", "slowsave", "failsave")):
            return
        real = writer.save

        def save_with_faults(*args: Any, **kwargs: Any) -> Any:
            self.before_write(step)
            out = real(*args, **kwargs)
            self.after_write(step)
            return out

        writer.save = save_with_faults

    def before_write(self, step: int) -> None:
        """Before this rank writes the files of the save at `step`: killsave waits 2 s (the other
        ranks finish theirs), slowsave M ms; failsave fails as a full disk would."""
        if self._due("killsave", step):
            time.sleep(2.0)
        f = self._due("slowsave", step)
        if f:
            time.sleep(f.ms / 1000)
        if self._due("failsave", step):
            import errno

            raise OSError(
                errno.ENOSPC,
                f"No space left on device (injected failsave at rank {self.rank} step {step}, TRAINER_FAULT)",
            )

    def stuck_file(self, step: int, path: Any) -> None:
        """hangwrite: `path` becomes a FIFO with no reader, so that the writer blocks opening it, as
        on a hung NFS or Lustre mount."""
        if self._due("hangwrite", step) and not os.path.exists(path):
            log.warning(
                f"injected hangwrite at rank {self.rank} step {step}: {path} is a FIFO (TRAINER_FAULT)"
            )
            os.mkfifo(path)

    def after_write(self, step: int) -> None:
        """killsave: die once this rank's files are written (before the checkpoint is committed)."""
        if self._due("killsave", step):
            log.warning(f"injected killsave at rank {self.rank} step {step} (TRAINER_FAULT)")
            os.kill(os.getpid(), signal.SIGKILL)

    def stale_resume(self) -> bool:
        return self._due("staleresume") is not None

    def conversion(self) -> None:
        for f in self.faults:
            if f.kind == "convertfail":
                raise RuntimeError("injected conversion failure (TRAINER_FAULT)")
            if f.kind == "convertslow":
                time.sleep(f.ms / 1000)
            if f.kind == "convertkill":
                os.kill(os.getppid(), signal.SIGKILL)
                time.sleep(60)  # the rank's death ends this process (PR_SET_PDEATHSIG)
