"""Files a crash never leaves half-written, and locks between processes.

- `write_atomic`: write beside the target, then rename over it (readers see the old file or the new
  one, never part of one); `durable=True` also fsyncs the file and its directory, so the new one
  survives a power loss (checkpoint metadata and `latest`).
- `fsync_dir`: make a rename in a directory durable.
- `file_lock`: an exclusive flock for the duration of a block (one builder of a data cache per node,
  one conversion of a checkpoint at a time).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str, *, durable: bool = False, writer: str | int | None = None) -> None:
    """Replace `path` by `text` in one rename. `writer` names the temporary file of one of several
    processes that may write the same path at once (default: this process's id)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid() if writer is None else writer}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive flock on `path` (created if missing) for the duration of the block."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def hash_file(path: str | os.PathLike, h: Any, chunk: int = 1 << 24) -> str:
    """The hex digest of a file's bytes through the hasher `h` (hashlib's or xxhash's), read in chunks."""
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
