"""A simulated file system for the crash tests: trainer/checkpoint/fs.py's interface, in memory, with
a power loss at any operation.

Files and directories are inodes. A file's data is durable once fsynced; a directory's entries (names
created, renamed in or out, unlinked) are durable once that directory is fsynced, as POSIX promises and
no more (the pessimistic model of ALICE and of RocksDB's FaultInjectionTestFS). Reads see everything
written (the page cache). `crash()` keeps only what was durable: each directory's entries as of its last
fsync, each file's data as of its last fsync (a file never fsynced is empty). A rename between two
directories is atomic (journaling file systems make it so): if both directories' durable entries hold the
inode, the newer placement wins.

Every mutating operation is counted (`ops`); `crash_at = k` raises `Crash` instead of performing the k-th
(counting from 1), so a test can stop the code at every operation in turn. `full_at = k` makes the k-th
write or append fail with ENOSPC instead (a full disk). `rmtree` is the unlink of each file and directory
below, bottom-up, each an operation of its own.
"""

from __future__ import annotations

import errno
import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path

_ids = itertools.count(1)
_seq = itertools.count(1)


class Crash(BaseException):  # noqa: N818  (a power loss: no `except Exception` in the code under test catches it)
    """The machine lost power here."""


@dataclass
class Node:
    kind: str  # "file" | "dir"
    data: bytes = b""
    synced: bytes | None = None  # file: data as of the last fsync
    entries: dict[str, Node] = field(default_factory=dict)  # dir: name -> node
    durable: dict[str, Node] = field(default_factory=dict)  # dir: entries as of the last fsync
    placed: dict[tuple[int, str], int] = field(default_factory=dict)  # (dir id, name) -> when placed there
    ident: int = field(default_factory=lambda: next(_ids))


class SimFS:
    def __init__(self) -> None:
        self.root = Node("dir")
        self.ops = 0
        self.version = 0  # changes with every mutation, crash and damage (readers' caches key on it)
        self.crash_at: int | None = None
        self.full_at: int | None = None
        self.last = ""  # the kind of the last operation performed
        self.pending = ""  # the kind of operation a crash stopped
        self.readers: dict[int, tuple[Path, str]] = {}  # live read leases: id -> (checkpoint, who)
        self.on_lease = None  # tests: called as a lease is taken, before it holds (what a writer does then)

    # ------------------------------------------------------------------ the tree
    def _walk(self, path: Path | str) -> Node | None:
        node = self.root
        for part in os.fspath(path).split("/"):
            if not part:
                continue
            if node.kind != "dir" or part not in node.entries:
                return None
            node = node.entries[part]
        return node

    def _parent(self, path: Path | str) -> tuple[Node, str]:
        head, _, name = os.fspath(path).rstrip("/").rpartition("/")
        parent = self._walk(head)
        if parent is None or parent.kind != "dir":
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", head)
        return parent, name

    def _get(self, path: Path) -> Node:
        node = self._walk(path)
        if node is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))
        return node

    def _op(self, what: str, path: Path, *, write: bool = False) -> None:
        self.ops += 1
        self.version += 1
        if self.crash_at is not None and self.ops >= self.crash_at:
            self.crash_at = None
            self.pending = what
            raise Crash(f"power lost before op {self.ops}: {what} {path}")
        if write and self.full_at is not None and self.ops >= self.full_at:
            self.full_at = None
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        self.last = what

    def _place(self, parent: Node, name: str, node: Node) -> None:
        parent.entries[name] = node
        node.placed[(parent.ident, name)] = next(_seq)

    # ------------------------------------------------------------------ reading
    def read_bytes(self, path: Path) -> bytes:
        node = self._get(path)
        if node.kind != "file":
            raise IsADirectoryError(errno.EISDIR, "Is a directory", str(path))
        return node.data

    def exists(self, path: Path) -> bool:
        return self._walk(path) is not None

    def is_dir(self, path: Path) -> bool:
        node = self._walk(path)
        return node is not None and node.kind == "dir"

    def is_file(self, path: Path) -> bool:
        node = self._walk(path)
        return node is not None and node.kind == "file"

    def size(self, path: Path) -> int:
        return len(self.read_bytes(path))

    def listdir(self, path: Path) -> list[str]:
        node = self._walk(path)
        return sorted(node.entries) if node is not None and node.kind == "dir" else []

    def files_under(self, path: Path) -> list[str]:
        out = []

        def walk(node: Node, rel: str) -> None:
            for name, child in node.entries.items():
                sub = f"{rel}/{name}" if rel else name
                if child.kind == "dir":
                    walk(child, sub)
                else:
                    out.append(sub)

        node = self._walk(path)
        if node is not None and node.kind == "dir":
            walk(node, "")
        return sorted(out)

    def digest(self, path: Path) -> str:
        import xxhash

        return xxhash.xxh3_128(self.read_bytes(path)).hexdigest()

    # ------------------------------------------------------------------ writing
    def mkdir(self, path: Path) -> None:
        path = Path(path)
        missing = []
        while self._walk(path) is None:
            missing.append(path)
            path = path.parent
        for p in reversed(missing):
            self._op("mkdir", p)
            parent, name = self._parent(p)
            self._place(parent, name, Node("dir"))
        if not self.is_dir(missing[0] if missing else path):
            raise FileExistsError(errno.EEXIST, "File exists", str(path))

    def write(self, path: Path, data: bytes) -> None:
        self._op("write", path, write=True)
        parent, name = self._parent(path)
        node = parent.entries.get(name)
        if node is None:
            node = Node("file")
            self._place(parent, name, node)
        elif node.kind != "file":
            raise IsADirectoryError(errno.EISDIR, "Is a directory", str(path))
        node.data = bytes(data)

    def append(self, path: Path, data: bytes) -> None:
        self._op("append", path, write=True)
        parent, name = self._parent(path)
        node = parent.entries.get(name)
        if node is None:
            node = Node("file")
            self._place(parent, name, node)
        node.data = node.data + bytes(data)

    def fsync(self, path: Path) -> None:
        self._op("fsync", path)
        node = self._get(path)
        node.synced = node.data

    def fsync_dir(self, path: Path) -> None:
        node = self._walk(path)
        if node is None or node.kind != "dir":
            return
        self._op("fsync_dir", path)
        node.durable = dict(node.entries)

    def rename(self, src: Path, dst: Path) -> None:
        self._op("rename", f"{src} -> {dst}")
        sp, sname = self._parent(src)
        if sname not in sp.entries:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(src))
        dp, dname = self._parent(dst)
        node = sp.entries[sname]
        old = dp.entries.get(dname)
        if old is not None and old.kind == "dir" and (node.kind != "dir" or old.entries):
            raise OSError(errno.ENOTEMPTY, "Directory not empty", str(dst))
        del sp.entries[sname]
        self._place(dp, dname, node)

    def unlink(self, path: Path) -> None:
        parent, name = self._parent(path)
        if name not in parent.entries:
            return
        self._op("unlink", path)
        del parent.entries[name]

    def rmtree(self, path: Path) -> None:
        node = self._walk(path)
        if node is None:
            return
        if node.kind == "dir":
            for name in sorted(node.entries):
                self.rmtree(Path(path) / name)
        self.unlink(path)

    def durable_write(self, path: Path, data: bytes, tmp_name: str | None = None) -> None:
        path = Path(path)
        tmp = path.with_name(tmp_name or f".{path.name}.sim.tmp")
        self.write(tmp, data)
        self.fsync(tmp)
        self.rename(tmp, path)
        self.fsync_dir(path.parent)

    # ------------------------------------------------------------------ readers beside a writer
    def lease(self, path: Path, what: str) -> SimLease:
        """A read lease (trainer/checkpoint/lease.py's flock, in memory): live until released or a power loss."""
        hook, self.on_lease = self.on_lease, None
        if hook is not None:
            hook()
        ident = next(_ids)
        self.readers[ident] = (Path(path), what)
        return SimLease(self, ident)

    def leased(self, root: Path) -> dict[str, str]:
        return {p.name: what for p, what in self.readers.values() if p.parent == Path(root)}

    # ------------------------------------------------------------------ a power loss
    def crash(self) -> None:
        """Keep only what was durable (module docstring); every reader's lease ends with its process."""
        self.version += 1
        self.readers.clear()
        best: dict[
            int, tuple[int, int, str]
        ] = {}  # node -> (when placed, parent id, name) of its newest durable place

        def collect(node: Node) -> None:
            for name, child in node.durable.items():
                when = child.placed.get((node.ident, name), 0)
                if child.ident not in best or when > best[child.ident][0]:
                    best[child.ident] = (when, node.ident, name)
                if child.kind == "dir":
                    collect(child)

        collect(self.root)

        def rebuild(node: Node) -> None:
            kept = {
                n: c for n, c in node.durable.items() if best.get(c.ident, (0, -1, ""))[1:] == (node.ident, n)
            }
            node.entries = dict(kept)
            node.durable = dict(kept)
            for child in kept.values():
                if child.kind == "dir":
                    rebuild(child)
                else:
                    child.data = child.synced if child.synced is not None else b""
                    child.synced = child.data

        rebuild(self.root)

    # ------------------------------------------------------------------ for the tests
    def damage(self, path: Path, truncate: bool = False) -> None:
        """Damage a file in place, durably (as a disk or a person would): one byte flipped, or cut short."""
        self.version += 1
        node = self._get(path)
        if truncate:
            node.data = node.data[: len(node.data) // 2]
        else:
            data = bytearray(node.data or b"\0")
            data[len(data) // 2] ^= 0xFF
            node.data = bytes(data)
        node.synced = node.data


@dataclass
class SimLease:
    fs: SimFS
    ident: int

    def release(self) -> None:
        self.fs.readers.pop(self.ident, None)

    def __enter__(self) -> SimLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
