"""Asynchronous checkpoint writes (`checkpoint.async`): the state is copied to host memory at a step
boundary, and a background thread writes the copy while training goes on.

DeepSpeed writes a checkpoint through its "checkpoint engine" (`engine.checkpoint_engine.save(
state_dict, path)` for every file). During an asynchronous save the Store puts a `SnapshotEngine`
there: its `save` copies the state dict's tensors (the live parameters, fp32 masters, optimizer
moments, scheduler) into host memory and queues (path, copy); nothing is written. When
`save_checkpoint` returns, a `Writer` thread writes the queued files (each with `torch.save`, then
fsync) and reports done or the error. The copy is taken before the next optimizer step can change
anything, so the files hold exactly the state at the step boundary.

DeepSpeed 0.19's own background engines do not fit here: the decoupled engine makes the next
optimizer step wait until the write is done (at most one forward/backward of overlap) and, like the
fast-persist engine, needs DeepSpeed's async I/O op (libaio, GPU builds); see docs/checkpoints.md.
"""

from __future__ import annotations

import copy
import io
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from trainer.common.files import fsync_dir

log = logging.getLogger("trainer")

WRITING, DONE, FAILED = 1, 0, 2  # a Writer's status, as the ranks exchange it each step


class HostCopier:
    """Copies a state dict's tensors to host memory, into buffers kept for the next save (allocated
    at the first save, then reused: the copy into memory already touched runs at memory bandwidth,
    a fresh allocation pays a page fault per page, six times slower on CPU). On a GPU the buffers
    are pinned and the copies run on the current stream, so they finish before any later kernel
    changes the tensors; `ready()` waits for them (the writer thread, before it reads the buffers)."""

    def __init__(self) -> None:
        self._free: dict[tuple[Any, ...], list[Any]] = {}
        self._used: list[tuple[tuple[Any, ...], Any]] = []
        self._event: Any = None
        self.bytes = 0

    def copy(self, obj: Any, memo: dict[Any, Any] | None = None) -> Any:
        """`obj` with every tensor replaced by a host copy (tensors that share storage, offset, shape
        and strides stay shared); containers are rebuilt, other values deep-copied."""
        import torch

        memo = {} if memo is None else memo
        if torch.is_tensor(obj):
            t = obj.detach()
            key = (
                t.untyped_storage().data_ptr(),
                t.storage_offset(),
                tuple(t.shape),
                t.stride(),
                t.dtype,
                t.device,
            )
            if key not in memo:
                memo[key] = self._tensor(t)
            return memo[key]
        if isinstance(obj, dict):
            out = copy.copy(obj)  # keeps the type (OrderedDict, defaultdict)
            for k, v in obj.items():
                out[k] = self.copy(v, memo)
            return out
        if isinstance(obj, list):
            return [self.copy(v, memo) for v in obj]
        if isinstance(obj, tuple):
            items = [self.copy(v, memo) for v in obj]
            return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        try:
            return copy.deepcopy(obj)
        except Exception:  # noqa: BLE001  (an object that cannot be copied is saved as it is then)
            return obj

    def _tensor(self, t: Any) -> Any:
        import torch

        self.bytes += t.numel() * t.element_size()
        cuda = t.device.type == "cuda"
        key = (tuple(t.shape), t.dtype)
        pool = self._free.get(key)
        buf = pool.pop() if pool else torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda)
        self._used.append((key, buf))
        buf.copy_(t, non_blocking=cuda)
        if cuda and self._event is None:
            self._event = torch.cuda.Event()
        return buf

    def mark(self) -> None:
        """After the last copy of a save: what `ready()` waits for."""
        if self._event is not None:
            self._event.record()

    def ready(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def release(self) -> None:
        """The write is done: the pinned buffers serve the next save."""
        for key, buf in self._used:
            self._free.setdefault(key, []).append(buf)
        self._used = []
        self.bytes = 0


def snapshot_engine(base: Any, copier: HostCopier) -> Any:
    """A DeepSpeed checkpoint engine whose `save` copies and queues instead of writing; loading and
    the rest are DeepSpeed's torch engine's."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class SnapshotEngine(TorchCheckpointEngine):
        def __init__(self) -> None:  # noqa: D107  (no config to read: the serialization is `base`'s)
            self.name = "SnapshotEngine"
            self.zipfile_serialization = getattr(base, "zipfile_serialization", True)
            self.queued: list[tuple[Path, Any]] = []

        def create(self, info: Any) -> None:
            pass

        def save(self, state_dict: Any, path: str) -> None:
            self.queued.append((Path(path), copier.copy(state_dict)))

        def commit(self, info: Any) -> bool:
            return True

    return SnapshotEngine()


class _Counted:
    """A binary file that counts the bytes written through it (a Writer's progress) and shows them to
    `seen` (the digest). It has no file descriptor to offer: torch's legacy serialization writes tensor
    data straight to one when the file has it (os.write past write()), which the digest never saw."""

    def __init__(self, f: Any, count: Any, seen: Any = None) -> None:
        self._f, self._count, self._seen = f, count, seen
        self.seen = 0
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        if self._seen is not None:
            self._seen(data)
        try:
            n = self._f.write(data)
        except OSError as e:  # torch's zip writer would report it as "unexpected pos", losing the cause
            self.error = e
            raise
        n = len(data) if n is None else n
        self.seen += n
        self._count(n)
        return n

    def fileno(self) -> int:
        raise io.UnsupportedOperation("fileno")  # every byte goes through write()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def write_file(path: Path, obj: Any, zipfile: bool = True, count: Any = None) -> tuple[int, str]:
    """torch.save, then fsync: the bytes are on disk before the checkpoint can be committed (by the
    process that wrote them: another node's fsync does not flush this one's cache). Returns (bytes,
    digest of the bytes as written: the manifest's, checked before a resume loads anything). `count`:
    called with the bytes of each write (progress)."""
    import torch
    import xxhash

    h = xxhash.xxh3_128()
    out = None
    try:
        with open(path, "wb") as f:
            out = _Counted(f, count or (lambda n: None), h.update)
            torch.save(obj, out, _use_new_zipfile_serialization=zipfile)
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
    except (OSError, RuntimeError) as e:  # a full disk, a quota, an I/O error: the cause, the file, the bytes
        cause = out.error if out is not None and out.error is not None else e
        if not isinstance(cause, OSError):
            raise
        from trainer.checkpoint.fs import describe

        written = f" after {out.seen:,} bytes of it were written" if out is not None else ""
        raise OSError(cause.errno, describe(cause, path, f"writing a checkpoint file{written}")) from e
    if out.seen != size:  # something wrote past write() (a seek back, a descriptor): digest the disk's bytes
        return size, file_digest(path)
    return size, h.hexdigest()


def file_digest(path: Path, chunk: int = 1 << 24) -> str:
    """The digest write_file records, of a file on disk (xxh3-128 of its bytes)."""
    import xxhash

    from trainer.common.files import hash_file

    return hash_file(path, xxhash.xxh3_128(), chunk)


def recording_engine(base: Any, record: dict[str, tuple[int, str]], after: Any = None) -> Any:
    """A DeepSpeed checkpoint engine whose `save` writes through write_file (fsync, digest) and records
    each file's (size, digest) under its path: a synchronous save's shards. `after`: called after each
    file (tests: a crash between files)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class RecordingEngine(TorchCheckpointEngine):
        def __init__(self) -> None:  # noqa: D107  (the serialization is `base`'s)
            self.name = "RecordingEngine"
            self.zipfile_serialization = getattr(base, "zipfile_serialization", True)

        def create(self, info: Any) -> None:
            pass

        def save(self, state_dict: Any, path: str) -> None:
            record[str(path)] = write_file(Path(path), state_dict, self.zipfile_serialization)
            if after is not None:
                after()

        def commit(self, info: Any) -> bool:
            return True

    return RecordingEngine()


class Writer:
    """Writes one save's files on a background thread; `status` is WRITING, DONE or FAILED."""

    def __init__(
        self,
        files: list[tuple[Path, Any]],
        *,
        copier: HostCopier,
        faults: Any,
        step: int,
        zipfile: bool = True,
        report: tuple[Path, int] | None = None,
    ) -> None:
        self.files, self.copier, self.faults, self.step, self.zipfile = files, copier, faults, step, zipfile
        self.report = report  # (staging directory, rank): this rank's report once its files are durable
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.bytes = 0
        self.written: dict[str, tuple[int, str]] = {}  # each file: (bytes, digest), for the manifest
        self.progress = 0  # bytes written so far, as they go (a file half written counts its half)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"checkpoint-writer-{step}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            self.copier.ready()
            self.faults.before_write(self.step)
            dirs = set()
            for i, (path, obj) in enumerate(self.files):
                self.faults.files(self.step, i)
                self.faults.stuck_file(self.step, path)
                self.written[str(path)] = write_file(path, obj, self.zipfile, self._advance)
                self.bytes += self.written[str(path)][0]
                dirs.add(path.parent)
            self.faults.files(self.step, len(self.files))
            for d in dirs:
                fsync_dir(d)
            if self.report is not None:  # what rank 0 commits from if the next step fails (salvage)
                from trainer.checkpoint.directory import write_report

                write_report(self.report[0], self.report[1], self.written)
            self.faults.after_write(self.step)
        except BaseException as e:  # noqa: BLE001  (reported to every rank by the next step's collective)
            self.error = e
        finally:
            self.files = []  # the host copy goes as soon as it is written
            self.copier.release()
            self.seconds = time.perf_counter() - t0
            self._done.set()

    def _advance(self, n: int) -> None:
        self.progress += n

    @property
    def status(self) -> int:
        if not self._done.is_set():
            return WRITING
        return FAILED if self.error is not None else DONE

    def wait(self, heartbeat: Any = None, poll_s: float = 1.0, quiet_s: float | None = None) -> bool:
        """Until the write is done, calling `heartbeat` (the watchdog's) whenever bytes were written
        since the last look: a long write is progress, a write stuck on a hung mount is not, and the
        watchdog ends the job after dist.watchdog_s as it would a stuck synchronous save. `quiet_s`: give
        up once nothing was written for that long (False; the thread is left to the process's end)."""
        seen, quiet = self.progress, time.monotonic() + (quiet_s or 0.0)
        while not self._done.wait(poll_s):
            if self.progress != seen:
                seen, quiet = self.progress, time.monotonic() + (quiet_s or 0.0)
                if heartbeat is not None:
                    heartbeat()
            elif quiet_s is not None and time.monotonic() > quiet:
                return False
        # The thread itself ends too: a daemon thread still alive when the interpreter finalizes is
        # stopped where it stands (inside torch's C++ that can abort the process).
        self._thread.join()
        return True

    def describe_error(self) -> str:
        e = self.error
        return f"{type(e).__name__}: {e}" if e is not None else ""
