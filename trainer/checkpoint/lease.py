"""Readers beside a writer: a process that reads a checkpoint another job's run directory holds (`bin/export`
of a run directory in use, `--resume PATH` of a checkpoint in another run directory) takes a read lease on it
first, and the writer's prune keeps a checkpoint a live lease names until the reader is done.

A lease is a file `<checkpoints>/.readers/<host>-<pid>-<id>` naming the checkpoint's tag and the reader, which
the reader holds an exclusive flock on for as long as it reads (the kernel releases it when the reader dies,
SIGKILL included); it is written and locked under a `.new-` name and then renamed, so a pruner sees only
leases whole and held. The pruner tries each lease's flock: held, the lease is live and its checkpoint stays;
free, the reader is gone and the lease file is removed. A reader takes its lease before it verifies the
checkpoint, so a prune that came first shows as a checkpoint gone, which the reader says (never a traceback).
(A lease that appears between the pruner's reading of the leases and its journal record, a window of one
append, is not honoured: that reader too finds its checkpoint gone and says so.)
On a filesystem without locks there are no leases: the reader's own check (a checkpoint gone while read) is
what is left.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import uuid
from pathlib import Path
from typing import Any

READERS = ".readers"
PENDING = ".new-"  # a lease being written: not yet one (removed by a pruner once its writer is gone)


class Lease:
    """A read lease on the checkpoint at `path` (a step directory), held until `release` or the process ends."""

    def __init__(self, path: Path, what: str) -> None:
        self.path = Path(path)
        self.file: Path | None = None
        self._fd: int | None = None
        readers = self.path.parent / READERS
        name = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:  # written and locked under a name no pruner reads, then renamed: a lease is seen whole and held
            readers.mkdir(exist_ok=True)
            self.file = readers / (PENDING + name)
            self._fd = os.open(self.file, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            info = {"tag": self.path.name, "what": what, "host": socket.gethostname(), "pid": os.getpid()}
            os.write(self._fd, json.dumps(info).encode())
            os.rename(self.file, readers / name)
            self.file = readers / name
        except (
            OSError
        ):  # a read-only directory, a filesystem without locks: no lease, the reader's own checks
            self.release()

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.unlink()
            self.file = None

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def leased(root: Path) -> dict[str, str]:
    """The checkpoints of `root` (a checkpoints directory) a live reader holds a lease on: tag -> who reads it.
    Leases whose reader is gone are removed."""
    out: dict[str, str] = {}
    readers = Path(root) / READERS
    try:
        names = os.listdir(readers)
    except OSError:
        return out
    for name in names:
        path = readers / name
        if name.startswith(PENDING) and _young(path):  # being written: its reader renames it when it holds
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # held: a live reader
                with contextlib.suppress(OSError, ValueError, KeyError):
                    info = json.loads(Path(path).read_text())
                    if not name.startswith(PENDING):
                        out[info["tag"]] = f"{info['what']} (pid {info['pid']} on {info['host']})"
                continue
            except OSError:
                continue
            with contextlib.suppress(OSError):  # its reader is gone
                path.unlink()
        finally:
            os.close(fd)
    return out


def _young(path: Path, seconds: float = 60.0) -> bool:
    import time

    try:
        return time.time() - os.stat(path).st_mtime < seconds
    except OSError:
        return True
