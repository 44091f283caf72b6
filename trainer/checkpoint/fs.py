"""The file-system operations the checkpoint store performs, in one object.

Everything that writes, renames or deletes in a checkpoints directory (the manifest, the commit, the
journal, pruning, rollbacks, setting damaged checkpoints aside, the universal files' marker) and
everything that reads what a decision rests on goes through an `FS`, never through `os` directly. The
product uses `LOCAL` (the operating system's calls, one per method); the crash test
(tests/unit/test_lineage_crashes.py) passes a simulated file system that counts every operation,
crashes at any of them and then drops what was not made durable (file data not fsynced, directory
entries whose directory was not fsynced), as SQLite's and RocksDB's fault-injection file systems do.

The methods are the POSIX operations themselves, so that a crash can fall between any two: `write`
does not fsync, `rename` does not fsync the directory. `durable_write` is the one composite (write a
temporary file, fsync it, rename it over the target, fsync the directory).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path
from typing import Any


class LocalFS:
    """The operating system's file system."""

    # ------------------------------------------------------------------ reading
    def read_bytes(self, path: Path) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def exists(self, path: Path) -> bool:
        return os.path.lexists(path)

    def is_dir(self, path: Path) -> bool:
        return os.path.isdir(path)

    def is_file(self, path: Path) -> bool:
        return os.path.isfile(path)

    def size(self, path: Path) -> int:
        return os.stat(path).st_size

    def listdir(self, path: Path) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def files_under(self, path: Path) -> list[str]:
        """Every file below `path`, relative to it, sorted."""
        out = []
        for dirpath, _, names in os.walk(path):
            for name in names:
                out.append(os.path.relpath(os.path.join(dirpath, name), path))
        return sorted(out)

    def digest(self, path: Path, chunk: int = 1 << 24) -> str:
        """xxh3-128 of a file's bytes (the digest every writer records)."""
        import xxhash

        h = xxhash.xxh3_128()
        with open(path, "rb") as f:
            while block := f.read(chunk):
                h.update(block)
        return h.hexdigest()

    # ------------------------------------------------------------------ writing
    def mkdir(self, path: Path) -> None:
        os.makedirs(path, exist_ok=True)

    def write(self, path: Path, data: bytes) -> None:
        """Create or truncate `path` and write `data` (not fsynced)."""
        with open(path, "wb") as f:
            f.write(data)

    def append(self, path: Path, data: bytes) -> None:
        """Append `data` to `path` (created if missing) in one write (not fsynced)."""
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
        finally:
            os.close(fd)

    def fsync(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def fsync_dir(self, path: Path) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return
        try:
            with contextlib.suppress(OSError):  # some filesystems refuse a directory's fsync
                os.fsync(fd)
        finally:
            os.close(fd)

    def rename(self, src: Path, dst: Path) -> None:
        """Rename `src` to `dst`, which must not exist (a directory) or is replaced (a file)."""
        os.rename(src, dst)

    def unlink(self, path: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def rmtree(self, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)

    # ------------------------------------------------------------------ readers beside a writer
    def lease(self, path: Path, what: str) -> Any:
        """A read lease on the checkpoint at `path` (lease.py), held until its `release()`."""
        from trainer.checkpoint.lease import Lease

        return Lease(path, what)

    def leased(self, root: Path) -> dict[str, str]:
        """The checkpoints of `root` a live reader holds a lease on: tag -> who reads it (lease.py)."""
        from trainer.checkpoint.lease import leased

        return leased(root)

    # ------------------------------------------------------------------ composite
    def durable_write(self, path: Path, data: bytes, tmp_name: str | None = None) -> None:
        """Replace `path` by `data` so that a crash leaves the old file or the new one, and the new one
        survives a power loss once this returns."""
        path = Path(path)
        tmp = path.with_name(tmp_name or f".{path.name}.{os.getpid()}.tmp")
        self.write(tmp, data)
        self.fsync(tmp)
        self.rename(tmp, path)
        self.fsync_dir(path.parent)


FS = LocalFS  # the interface: the crash test's simulated file system has the same methods
LOCAL = LocalFS()


# the errors a user can act on (space, quota, a read-only or forbidden directory): a checkpoint that cannot be
# written for one of them ends the run as a user error (exit 2: a restart would fail the same way until acted on)
ACTIONABLE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


def describe(e: OSError, path: Path | str, what: str = "") -> str:
    """An OSError as a user reads it: the path, the error by name, what to do for the common ones."""
    name = errno.errorcode.get(e.errno or 0, "")
    fix = {
        errno.ENOSPC: "free space or choose another run_dir",
        errno.EDQUOT: "the disk quota is exhausted: free space or raise the quota",
        errno.EROFS: "the file system is read-only: choose a writable run_dir",
        errno.EACCES: "no permission: choose a run_dir this user can write",
        errno.EPERM: "not permitted (an immutable or read-only directory): choose a writable run_dir",
    }.get(e.errno or 0)
    head = f"{path}: {e.strerror or e}" + (f" ({name})" if name else "")
    return head + (f" {what}" if what else "") + (f"; {fix}" if fix else "")
