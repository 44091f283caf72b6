"""The offline teacher (train.distill.offline): its top-k next-token log-probabilities at every target token of the
data, computed once by `bin/train EXP.yaml --prepare-teacher` (`prepare`) and read by training (`TeacherStore`), so
that no teacher is in memory while the student trains.

What a stored entry is keyed by: an example's tokens. A training row holds examples kept apart (packing restarts the
position ids at each: the models attend within an example), and a block of text is one sequence; each such segment's
tokens up to its last target and which of them are targets digest to 8 bytes (`segments`). At a forward the same
digests of the micro batch's rows find their entries, however the rows were cut to the batch's width or laid end to
end (flash attention's one row): the order of the targets is the loss's.

A store is a directory: `meta.json` (the format's VERSION, what it was made from: the teacher's files by content, the
data's digest, the tokenizer, top_k, temperature, the precision it ran in), the segments' sorted digests with their
first entry and count (`keys.npy`, `starts.npy`, `counts.npy`), and the entries (`ids.bin` int32 and `logp.bin` fp32,
entries x top_k): 8 bytes a token per k (top_k 32: 256 bytes a target token). By default it lies in the data cache
(`teacher/<digest of what it depends on>`); train.distill.store names another directory (a store made elsewhere),
which is checked against the run's data, tokenizer, teacher, top_k and temperature before training reads it.

Written and read back as the checkpoints are: meta.json records each file's size and digest and its own digest, and
a store is read only once they hold (`_verified`: exit 2 naming it otherwise); --prepare-teacher replaces a store
and nothing else (a directory that is not one, or a file, is refused), works in a directory of its own job
(`_work_name`), removes it whatever happens, and swaps the new store in under a lock without a moment where neither
is there.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from trainer.common.errors import UserError

VERSION = 2  # 2: each file's size and digest, and meta.json's own, in meta.json


def segments(ids: np.ndarray, labels: np.ndarray, pos: np.ndarray | None) -> list[tuple[int, int]]:
    """A row's examples that hold targets, in order: (digest, targets). An example starts where the position ids
    restart at 0 (the whole row for a block of text: `pos` None); its targets are the tokens after its first whose
    label is not IGNORE; the digest covers its tokens up to its last target and where its targets are."""
    from trainer.data.pack import IGNORE

    starts = [0] if pos is None else [int(s) for s in np.flatnonzero(pos == 0)]
    if not starts or starts[0] != 0:
        starts = [0, *starts]
    out = []
    for s, e in zip(starts, [*starts[1:], len(ids)], strict=True):
        target = labels[s + 1 : e] != IGNORE
        if not target.any():
            continue
        last = s + 1 + int(np.flatnonzero(target)[-1])
        h = hashlib.blake2b(digest_size=8)
        h.update(np.ascontiguousarray(ids[s : last + 1], dtype=np.int64).tobytes())
        h.update(np.packbits(target[: last - s]).tobytes())
        out.append((int.from_bytes(h.digest(), "little"), int(target.sum())))
    return out


def batch_segments(input_ids: Any, labels: Any, position_ids: Any) -> list[tuple[int, int]]:
    """`segments` of every row of a micro batch (tensors anywhere), rows in order: the loss's order of targets."""
    ids = input_ids.detach().cpu().numpy()
    lab = labels.detach().cpu().numpy()
    pos = None if position_ids is None else position_ids.detach().cpu().numpy()
    return [s for r in range(ids.shape[0]) for s in segments(ids[r], lab[r], None if pos is None else pos[r])]


def identity(exp: Any, data: Any) -> dict[str, Any]:
    """What a store's entries depend on (its key, and what a given store is checked against)."""
    from trainer.objectives.reference import content_digests

    spec, d = exp.train.distill.teacher, exp.train.distill
    local = Path(spec).expanduser()
    teacher = content_digests(local, exp.data.cache_dir) if local.is_dir() else spec
    return {
        "version": VERSION,
        "teacher": hashlib.sha256(json.dumps(teacher).encode()).hexdigest()[:20],
        "top_k": d.top_k,
        "quantization": d.quantization,
        "temperature": d.temperature,
        "tokenizer": data.fingerprint.get("tokenizer"),
        "train": data.fingerprint["train_digest"],
        "eval": None
        if data.eval is None
        else hashlib.sha256(np.ascontiguousarray(data.eval).tobytes()).hexdigest()[:20],
    }


def store_path(exp: Any, data: Any, ident: dict[str, Any] | None = None) -> Path:
    if exp.train.distill.store:
        return Path(exp.train.distill.store).expanduser()
    ident = ident or identity(exp, data)
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]
    return Path(data.cache_path) / "teacher" / key


def _rows(rows: np.ndarray, at: np.ndarray) -> tuple[Any, Any, Any]:
    """(input ids, labels, position ids or None) of rows as the loader gives them."""

    from trainer.data.stream import _collate

    batch = _collate(np.asarray(rows[at]), 1)
    if batch.dim() == 2:
        return batch, batch, None
    return batch[:, 0], batch[:, 1], batch[:, 2]


def _batches(data: Any, micro: int) -> list[tuple[Any, np.ndarray]]:
    """Every micro batch of rows the store covers, in order: (the rows' array, their indices), train then eval."""
    return [(rows, np.arange(a, min(a + micro, len(rows)))) for rows in (data.train, data.eval) if rows is not None
            for a in range(0, len(rows), micro)]  # fmt: skip


def _part(
    model: Any, batches: list[tuple[Any, np.ndarray]], mine: range, device: Any, d: Any, out: Path
) -> None:
    """This rank's micro batches `mine` through the teacher: each example's entries in order (`ids.bin`,
    `logp.bin`) and (batch, digest, count) for each (`segments.npy`), into `out`."""
    import torch

    from trainer.data.pack import IGNORE
    from trainer.objectives.distill import _heads
    from trainer.objectives.sparse import teacher_topk

    base, head = _heads(model, "train.distill.teacher")
    out.mkdir(parents=True)
    segs = []
    with open(out / "ids.bin", "wb") as f_ids, open(out / "logp.bin", "wb") as f_lp, torch.no_grad():
        for b in mine:
            ids, labels, pos = _rows(*batches[b])
            extra = {} if pos is None else {"position_ids": pos.to(device)}
            hidden = base(input_ids=ids.to(device), use_cache=False, **extra)[0][:, :-1]
            mask = (labels[:, 1:] != IGNORE).to(device)
            top_ids, top_lp = teacher_topk(hidden[mask], head.weight, d.top_k, d.temperature)
            f_ids.write(top_ids.cpu().numpy().astype(np.int32).tobytes())
            f_lp.write(top_lp.cpu().numpy().astype(np.float32).tobytes())
            segs += [(b, digest, count) for digest, count in batch_segments(ids, labels, pos)]
    np.save(out / "segments.npy", np.array(segs, dtype=np.uint64).reshape(-1, 3))


def _merge(parts: list[Path], k: int, tmp: Path) -> tuple[int, int]:
    """The ranks' parts (rank r's holds the batches r, r + world, ...) into one store at `tmp`, in the batches'
    order, each example once: (entries, examples)."""
    segs = [np.load(p / "segments.npy") for p in parts]
    spans = [np.concatenate([[0], np.cumsum(s[:, 2].astype(np.int64))]) for s in segs]
    arrays = [(np.memmap(p / "ids.bin", dtype=np.int32, mode="r", shape=(int(sp[-1]), k)) if sp[-1] else None,
               np.memmap(p / "logp.bin", dtype=np.float32, mode="r", shape=(int(sp[-1]), k)) if sp[-1] else None)
              for p, sp in zip(parts, spans, strict=True)]  # fmt: skip
    order = sorted((int(s[i, 0]), r, i) for r, s in enumerate(segs) for i in range(len(s)))
    seen: dict[int, tuple[int, int]] = {}
    total = 0
    with open(tmp / "ids.bin", "wb") as f_ids, open(tmp / "logp.bin", "wb") as f_lp:
        for _, r, i in order:
            digest, count = int(segs[r][i, 1]), int(segs[r][i, 2])
            if digest in seen:
                continue
            a, b = int(spans[r][i]), int(spans[r][i + 1])
            f_ids.write(np.ascontiguousarray(arrays[r][0][a:b]).tobytes())
            f_lp.write(np.ascontiguousarray(arrays[r][1][a:b]).tobytes())
            seen[digest] = (total, count)
            total += count
    keys = np.array(sorted(seen), dtype=np.uint64)
    np.save(tmp / "keys.npy", keys)
    np.save(tmp / "starts.npy", np.array([seen[int(x)][0] for x in keys], dtype=np.int64))
    np.save(tmp / "counts.npy", np.array([seen[int(x)][1] for x in keys], dtype=np.int64))
    return total, len(keys)


def _target(final: Path, key: str = "train.distill.store") -> None:
    """What --prepare-teacher may replace at `final`: nothing there, or a store (it never removes anything else)."""
    if final.is_file() or (final.exists() and not final.is_dir()):
        raise UserError(
            f"{key}: {final} is a file; give a directory for the store (a new one, or a store to replace)"
        )
    if final.is_dir() and any(final.iterdir()) and not _is_store(final):
        raise UserError(f"{key}: {final} is not a store (no meta.json of one): give a new directory or a store's; "
                        "--prepare-teacher replaces a store and never removes anything else")  # fmt: skip


def _is_store(path: Path) -> bool:
    """A directory --prepare-teacher wrote: its meta.json parses, is a store's (its own digest holds) and lists
    every other file there."""
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(meta, dict) or "files" not in meta or meta.get("meta_digest") != _meta_digest(meta):
        return False
    return {p.name for p in path.iterdir()} <= {*meta["files"], "meta.json"}


def _sweep(final: Path) -> None:
    """Work directories of earlier prepares of `final` whose jobs are gone (killed: their lock is free): removed."""
    import fcntl

    for lock in final.parent.glob(f".{final.name}.*.parts.lock"):
        with open(lock, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a job at work
            shutil.rmtree(lock.with_suffix(""), ignore_errors=True)
            lock.unlink(missing_ok=True)


def _work_name() -> str:
    """This job's work directory's name part, one for every rank of a launch (its rendezvous: no two jobs share it on
    a node at once) and unique to a process without one (containers on two nodes give theirs the same pids)."""
    import socket

    from trainer.objectives.reference import _writer

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and os.environ.get("MASTER_PORT"):
        return f"{socket.gethostname()}.{os.environ['MASTER_PORT']}"
    return _writer()


def _publish(tmp: Path, final: Path, meta: dict[str, Any]) -> None:
    """The merged store at `tmp` made `final`, with each file's size and digest and meta.json's own digest; a store
    there before is replaced in two renames (it is never gone without the new one in its place)."""
    from trainer.checkpoint.writer import file_digest
    from trainer.common.files import file_lock

    meta["files"] = {p.name: [p.stat().st_size, file_digest(p)] for p in sorted(tmp.iterdir())}
    meta["meta_digest"] = _meta_digest(meta)
    with open(tmp / "meta.json", "w") as f:
        f.write(json.dumps(meta, indent=2))
        f.flush()
        os.fsync(f.fileno())
    final.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(
        final.parent / f".{final.name}.lock"
    ):  # (two jobs preparing the same store: one at a time here)
        old = final.with_name(f".{final.name}.{_work_name()}.old")
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)


def _meta_digest(meta: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps({k: v for k, v in meta.items() if k != "meta_digest"}, sort_keys=True).encode()).hexdigest()[:20]  # fmt: skip


def prepare(exp: Any, data: Any, device: Any, dtype: Any, rank: int = 0, world: int = 1, barrier: Any = None,
            say: Any = print) -> Path | None:  # fmt: skip
    """Run the teacher over every row of the data (train and eval) and write the store (module docstring): rank r
    of `world` (one node's ranks, `barrier` between them) the micro batches r, r + world, ...; rank 0 merges the
    parts. The directory appears whole (written beside it, then renamed); a write that fails removes the work and
    stops naming the store (exit 2). Returns its path on rank 0."""
    from trainer.model import hf_config
    from trainer.objectives.distill import teacher

    barrier = barrier or (lambda: None)
    d, ident = exp.train.distill, identity(exp, data)
    final = store_path(exp, data, ident)
    _target(final)
    config = teacher_config(d, hf_config(exp.model, data.vocab_size, data.eos_id), data.tokenizer)
    model = teacher(d.teacher, config, dtype, None, d.quantization)
    if d.quantization == "none":
        model = model.to(device)
    work = final.with_name(f".{final.name}.{_work_name()}.parts")
    held = None
    try:
        if rank == 0:  # this job's work, locked while it lasts; the work of jobs killed before is swept
            import fcntl

            final.parent.mkdir(parents=True, exist_ok=True)
            held = open(work.with_name(work.name + ".lock"), "a")  # noqa: SIM115 (held until the finally)
            fcntl.flock(held, fcntl.LOCK_EX)
            shutil.rmtree(work, ignore_errors=True)
            _sweep(final)
        barrier()
        t0, batches = time.perf_counter(), _batches(data, exp.train.micro_batch_size)
        _part(model, batches, range(rank, len(batches), world), device, d, work / f"rank{rank}")
        barrier()
        if rank != 0:
            return None
        tmp = work / "store"
        tmp.mkdir()
        total, examples = _merge([work / f"rank{r}" for r in range(world)], d.top_k, tmp)
        meta = {**ident, "entries": total, "examples": examples, "vocab_size": data.vocab_size,
                "teacher_spec": d.teacher, "dtype": str(dtype).replace("torch.", ""), "ranks": world,
                "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
        _publish(tmp, final, meta)
    except OSError as e:
        raise UserError(f"train.distill.store: cannot write the stored teacher at {final} ({e}); free the room it needs "
                        "or give train.distill.store a writable directory, and run --prepare-teacher again") from None  # fmt: skip
    finally:
        if rank == 0:
            shutil.rmtree(work, ignore_errors=True)
            if held is not None:
                Path(held.name).unlink(missing_ok=True)
                held.close()
    size = sum(p.stat().st_size for p in final.iterdir())
    say(f"teacher: top-{d.top_k} log-probabilities of {total:,} target tokens ({examples:,} examples) by "
        f"{d.teacher} in {meta['dtype']} on {world} rank(s) in {meta['seconds']} s: {size / 2**20:,.1f} MiB in "
        f"{final}")  # fmt: skip
    return final


class TeacherStore:
    """A store read back: `lookup` gives a micro batch's entries in the loss's order."""

    def __init__(self, path: Path, top_k: int) -> None:
        self.path = path
        meta = json.loads((path / "meta.json").read_text())
        self.meta, n = meta, int(meta["entries"])
        self.keys = np.load(path / "keys.npy")
        self.starts, self.counts = np.load(path / "starts.npy"), np.load(path / "counts.npy")
        self.ids = np.memmap(path / "ids.bin", dtype=np.int32, mode="r", shape=(n, top_k)) if n else None
        self.logp = np.memmap(path / "logp.bin", dtype=np.float32, mode="r", shape=(n, top_k)) if n else None

    def lookup(self, input_ids: Any, labels: Any, position_ids: Any) -> tuple[Any, Any]:
        import torch

        parts = []
        for digest, count in batch_segments(input_ids, labels, position_ids):
            i = int(np.searchsorted(self.keys, np.uint64(digest)))
            if i >= len(self.keys) or int(self.keys[i]) != digest or int(self.counts[i]) != count:
                raise UserError(
                    f"train.distill.offline: an example of this batch is not in the stored teacher {self.path} (the "
                    "data changed since it was prepared); run `bin/train EXPERIMENT.yaml --prepare-teacher` again"
                )
            parts.append(slice(int(self.starts[i]), int(self.starts[i]) + count))
        if not parts:
            k = self.ids.shape[1] if self.ids is not None else 1
            return torch.zeros((0, k), dtype=torch.int64), torch.zeros((0, k))
        ids = np.concatenate([self.ids[s] for s in parts])
        logp = np.concatenate([self.logp[s] for s in parts])
        device = input_ids.device
        return torch.from_numpy(ids).to(device).long(), torch.from_numpy(logp).to(device)


def open_store(exp: Any, data: Any) -> TeacherStore:
    """The run's store, checked against what it must have been made from: exit 2 naming what differs (or that there
    is none, and how to make it)."""
    ident = identity(exp, data)
    path = store_path(exp, data, ident)
    if path.exists() and not (path / "meta.json").is_file():
        _target(path)  # (a file, or a directory that is not a store: said as such)
    if not (path / "meta.json").is_file():
        where = "train.distill.store" if exp.train.distill.store else "the data cache"
        raise UserError(
            f"train.distill.offline: no stored teacher at {path} ({where}) for this data, teacher, top_k and "
            "temperature; run `bin/train EXPERIMENT.yaml --prepare-teacher` first (the teacher runs once over the "
            "data), or set offline: false (the teacher beside the student)"
        )
    meta = _verified(path, exp.data.cache_dir)
    names = {"version": "its format", "teacher": "train.distill.teacher (its files)", "top_k": "train.distill.top_k",
             "quantization": "train.distill.quantization",
             "temperature": "train.distill.temperature", "tokenizer": "data.tokenizer",
             "train": "the training data (its tokens)", "eval": "the eval data (its tokens)"}  # fmt: skip
    spec = exp.train.distill.teacher
    if not Path(spec).expanduser().is_dir() and meta.get("teacher_spec") == spec:
        names.pop(
            "teacher"
        )  # prepared where the teacher's directory is, read where it is not: its record stands
    for key, what in names.items():
        if meta.get(key) != ident[key]:
            raise UserError(
                f"train.distill.store: {path} was prepared from another {what} ({meta.get(key)!r}; this run's "
                f"{ident[key]!r}); run `bin/train EXPERIMENT.yaml --prepare-teacher` to prepare this run's, or give "
                "the store prepared for it"
            )
    return TeacherStore(path, int(exp.train.distill.top_k))


def _verified(path: Path, cache_dir: str) -> dict[str, Any]:
    """A store's meta.json, once it and every file it lists are whole: their sizes and digests (the digests kept in
    the cache by path, size and time: reference.content_digests); exit 2 naming the store otherwise."""
    from trainer.objectives.reference import content_digests

    def damaged(what: str) -> UserError:
        return UserError(f"train.distill.store: {path} is damaged ({what}); run `bin/train EXPERIMENT.yaml "
                         "--prepare-teacher` again to make it anew")  # fmt: skip

    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise damaged(f"meta.json: {type(e).__name__}") from None
    if not isinstance(meta, dict) or meta.get("meta_digest") != _meta_digest(meta) or "files" not in meta:
        raise damaged("meta.json is not the one it was written as")
    have = dict(content_digests(path, cache_dir))
    for name, (size, digest) in meta["files"].items():
        f = path / name
        if not f.is_file() or f.stat().st_size != size or have.get(name) != digest:
            raise damaged(f"{name}: not the bytes it was written with")
    return meta


def check_top_k(d: Any, student: Any) -> None:
    """train.distill.top_k at most the student's vocabulary (exit 2)."""
    vocab = student.get_text_config().vocab_size
    if d.top_k is not None and d.top_k > vocab:
        raise UserError(f"train.distill.top_k: {d.top_k:,} is more than the vocabulary ({vocab:,}); set at most "
                        f"{vocab:,} (null: the whole distribution)")  # fmt: skip


def check_teacher(exp: Any, student: Any, data: Any) -> tuple[Any, Any]:
    """(the stored teacher, None) offline; (None, the teacher's config) otherwise, once its vocabulary is the
    student's. top_k at most the vocabulary. Exit 2 naming what is wrong, before any weight loads."""
    from trainer.objectives.distill import _family

    d = exp.train.distill
    if d.offline:
        check_top_k(d, student)
        _family(student, "model")
        return open_store(exp, data), None
    return None, teacher_config(d, student, data.tokenizer)


def teacher_config(d: Any, student: Any, tokenizer: Any) -> Any:
    """The config of train.distill's teacher (`d`) once top_k, its vocabulary and, in 4 bits, bitsandbytes and its
    widths hold against the student (exit 2 otherwise), before any weight loads: a run's and --prepare-teacher's."""
    from trainer.objectives.distill import check_vocabulary, cpu_four_bit, require_bitsandbytes

    check_top_k(d, student)
    config = check_vocabulary(d.teacher, student, tokenizer)
    if d.quantization == "4bit":
        require_bitsandbytes()
        cpu_four_bit(config)
    return config
