"""One job per run directory.

Rank 0 of a job holds an exclusive lock on `<run_dir>/.lock` (flock) from before any rank reads the
directory to decide what to resume until the process ends, and writes who holds it (host, pid, start time,
command) into the file. A second job started on the same run directory (a double launch, a requeued job
overlapping the dying one, which saves on SIGTERM) waits for the lock up to checkpoint.lock_wait_s, saying
whom it waits for, then stops with an error naming the holder: two jobs would otherwise delete each other's
in-progress saves, and a decision made before the lock could resume a checkpoint the dying job prunes. The kernel releases the lock when the
holder dies, SIGKILL included, so a killed job's lock never blocks the next one. On a filesystem
without locks (some network mounts) the run goes on with a warning.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

LOCK = ".lock"

_held: list[Any] = []  # the open lock files of this process (kept open: closing would release them)


def hold(
    run_dir: str | Path, rank: int, world_size: int, wait_s: float, say: Any = print
) -> tuple[str | None, str | None]:
    """Rank 0 takes the run directory's lock (`acquire`, waiting up to `wait_s` for a job that still holds
    it) and every rank learns whether it did, before any of them reads the run directory to decide what to
    resume: every rank calls it. A directory held by another job is an error on every rank. Returns (None,
    or rank 0's warning of a filesystem without locks; the job, rank 0's: cluster/dist.job)."""
    from trainer.cluster.dist import all_gather, job
    from trainer.common.errors import UserError

    try:
        mine = (acquire(run_dir, wait_s, say) if rank == 0 else None, job())
    except UserError as e:  # rank 0 cannot write there: every rank stops with its reason, none waits for it
        mine = (f"error:{e}", job())
    got, job_id = all_gather(mine, world_size)[0] if world_size > 1 else mine
    if got is not None and got.startswith("error:"):
        raise UserError(got.removeprefix("error:"), everywhere=True)
    if got is not None and not got.startswith("warning:"):
        raise UserError(
            f"run_dir {run_dir} is in use by another job: {got}" + (f", after waiting {wait_s:g} s for it to end "
            "(checkpoint.lock_wait_s)" if wait_s else "") + ". One job per run directory (two would delete each "
            "other's saves): wait for it to end or stop it, or choose another run_dir (--set run_dir=...)",
            everywhere=True,
        )  # fmt: skip
    return got, job_id


def lock_wait(wait_s: float | None, timeout_s: float) -> float:
    """checkpoint.lock_wait_s as set, or unset: 300 s, or half of dist.timeout_s where that is less (the other
    ranks wait for rank 0's lock in a collective that dist.timeout_s bounds)."""
    return wait_s if wait_s is not None else min(300.0, timeout_s / 2)


def acquire(run_dir: str | Path, wait_s: float = 0.0, say: Any = None) -> str | None:
    """Take the run directory's lock for the rest of this process, waiting up to `wait_s` for another job to
    release it (said once, with the holder). Returns None when taken, or why not: the holder's description,
    or a warning when the filesystem has no locks ("warning: ...")."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        got = _try(run_dir)
        if got is None or got.startswith("warning:") or time.monotonic() >= deadline:
            return got
        if say is not None:
            say(f"run_dir {run_dir} is held by {got}: waiting up to {wait_s:g} s for it to end "
                "(checkpoint.lock_wait_s; a requeued job overlapping the dying one)")  # fmt: skip
            say = None
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def _try(run_dir: str | Path) -> str | None:
    """One try at the lock (see `acquire`)."""
    path = Path(run_dir) / LOCK
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe = path.with_name(
            f".write-check-{socket.gethostname()}-{os.getpid()}"
        )  # the lock may exist: a new file must be possible
        probe.write_text("")
        probe.unlink()
        f = open(path, "a+")  # noqa: SIM115  (held open until the process ends)
    except OSError as e:  # read-only, no permission, a full disk: nothing could be saved there
        raise _unwritable(run_dir, path, e) from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = _describe(f.read())
        f.close()
        return holder
    except OSError as e:  # ENOLCK, EOPNOTSUPP: no locks on this filesystem
        f.close()
        return f"warning: {path}: cannot lock ({e.strerror}); a second job on this run directory would not be detected"
    info = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
    }
    try:
        f.seek(0)
        f.truncate()
        f.write(json.dumps(info) + "\n")
        f.flush()
    except OSError as e:  # a full disk, a quota: nothing could be saved there either
        f.close()
        raise _unwritable(run_dir, path, e) from None
    _held.append(f)
    return None


def _unwritable(run_dir: str | Path, path: Path, e: OSError) -> Exception:
    from trainer.checkpoint.fs import describe
    from trainer.common.errors import UserError

    return UserError(
        f"run_dir {Path(run_dir)} cannot be written (nothing could be saved there): "
        + describe(e, e.filename or path, "writing in it")
    )


SHARED = ".shared-check"


def shared_everywhere(
    run_dir: str | Path, rank: int, world_size: int, nodes: int, wait_s: float = 10.0
) -> list[int]:
    """The ranks that do not see the run directory rank 0 writes (a node-local disk: each node its
    own `run_dir`), found with one file rank 0 writes and every rank reads (a network filesystem's
    cached lookups get `wait_s` to catch up). Every rank calls it; [] on one node."""
    import secrets
    import time

    from trainer.cluster.dist import all_gather

    if nodes <= 1 or world_size <= 1:
        return []
    path = Path(run_dir) / SHARED
    token = secrets.token_hex(8) if rank == 0 else None
    if token is not None:
        path.write_text(token)
    token = all_gather(token, world_size)[0]  # after rank 0 wrote it
    deadline = time.monotonic() + wait_s
    while True:
        try:
            sees = path.read_text() == token
        except OSError:
            sees = False
        if sees or time.monotonic() > deadline:
            break
        with contextlib.suppress(OSError):  # revalidate the directory's entries (it may not exist here)
            os.listdir(path.parent)
        time.sleep(0.5)
    return [r for r, s in enumerate(all_gather(sees, world_size)) if not s]


def _describe(text: str) -> str:
    try:
        h = json.loads(text)
        return f"pid {h['pid']} on {h['host']}, started {h['started']} ({h['command']})"
    except (ValueError, KeyError, TypeError):
        return "another process (it wrote no details yet)"


def release_all() -> None:
    """Release this process's locks (tests; a process's end releases them anyway)."""
    while _held:
        f = _held.pop()
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()
