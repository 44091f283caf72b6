"""One job per run directory.

Rank 0 of a job holds an exclusive lock on `<run_dir>/.lock` (flock) from before it touches the
directory until the process ends, and writes who holds it (host, pid, start time, command) into the
file. A second job started on the same run directory (a double launch, a requeued job overlapping
the dying one) finds the lock taken and stops at once with an error naming the holder: two jobs
would otherwise delete each other's in-progress saves. The kernel releases the lock when the
holder dies, SIGKILL included, so a killed job's lock never blocks the next one. On a filesystem
without locks (some network mounts) the run goes on with a warning.
"""

from __future__ import annotations

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


def acquire(run_dir: str | Path) -> str | None:
    """Take the run directory's lock for the rest of this process. Returns None when taken, or why
    not: the holder's description, or a warning when the filesystem has no locks ("warning: ...")."""
    path = Path(run_dir) / LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a+")  # noqa: SIM115  (held open until the process ends)
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
    f.seek(0)
    f.truncate()
    f.write(json.dumps(info) + "\n")
    f.flush()
    _held.append(f)
    return None


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
