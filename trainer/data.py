"""Data: Hugging Face datasets -> tokenized -> packed into seq_len blocks -> per-rank, resumable batches.

Tokenized and packed data is cached on disk (`data.cache_dir`), keyed by the source files (path,
size, mtime), the tokenizer and the packing settings, so a second run does not tokenize again. The
first process on a node to take the cache lock builds it; the others wait for it and then read it.
The cache holds the packed blocks as `train.npy` and `eval.npy` (int32, sequences x seq_len), read
memory-mapped: a cache hit costs neither an import of `datasets` nor a copy of the data per rank.

The data order is global and independent of the world size: epoch e is a seeded permutation of
the blocks; micro step i takes blocks [i*W*B, (i+1)*W*B) of it (W ranks, micro batch B), and rank
r takes its B-slice. The position in the data is therefore one number, global samples consumed in
the epoch, which carries over when a run resumes on another number of ranks.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainer.config import DataSection, DataSource
from trainer.errors import UserError
from trainer.files import file_lock, write_atomic

CACHE_VERSION = 2  # 2: packed blocks in .npy files (1: datasets' Arrow)
EOS = "<|endoftext|>"
BYTE_VOCAB, BYTE_EOS_ID = 257, 256  # the built-in byte tokenizer: 256 bytes + EOS

# ----------------------------------------------------------------------------- tokenizer


def byte_tokenizer() -> Any:
    """A byte-level tokenizer that needs no files: ids 0..255 are the UTF-8 bytes, 256 is EOS.
    It is a real transformers tokenizer, so it saves with a checkpoint export."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    b2u = bytes_to_unicode()
    vocab = {b2u[i]: i for i in range(256)}
    vocab[EOS] = BYTE_EOS_ID
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, model_max_length=1 << 30)


def load_tokenizer(spec: str) -> Any:
    if spec == "byte":
        return byte_tokenizer()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(spec)
    except (OSError, ValueError) as e:
        raise UserError(
            f"data.tokenizer: cannot load '{spec}': {str(e).splitlines()[0]}. Use 'byte', a local tokenizer "
            "directory, or a hub id on a machine with network access"
        ) from None


def tokenizer_shape(spec: str, cache_dir: str | Path | None = None) -> tuple[int, int | None]:
    """(vocabulary size, EOS id) of a tokenizer, for planning. The byte tokenizer's are constants; a
    local tokenizer directory's are cached by its files' names, sizes and times, so that planning a
    model seen before does not import transformers."""
    if spec == "byte":
        return BYTE_VOCAB, BYTE_EOS_ID
    path = None
    local = Path(spec).expanduser()
    if cache_dir and local.is_dir():
        stamp = sorted(
            (f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in local.iterdir() if f.is_file()
        )
        key = hashlib.sha256(json.dumps([str(local.resolve()), stamp]).encode()).hexdigest()[:24]
        path = Path(cache_dir).expanduser() / "model-info" / f"tokenizer-{key}.json"
        with contextlib.suppress(OSError, ValueError, KeyError):
            d = json.loads(path.read_text())
            return d["vocab"], d["eos"]
    tok = load_tokenizer(spec)
    shape = len(tok), tok.eos_token_id
    if path is not None:
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps({"vocab": shape[0], "eos": shape[1]}))
    return shape


def tokenizer_id(tok: Any, spec: str) -> str:
    """A stable identity for the cache key: the spec plus a hash of the vocabulary."""
    vocab = tok.get_vocab()
    h = hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()[:16]
    return f"{spec}:{len(vocab)}:{h}"


# ----------------------------------------------------------------------------- sources


FORMATS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
}


def resolve_files(src: DataSource, key: str) -> tuple[list[str], str]:
    """Expand the globs; every glob must match; one format for all files."""
    files: list[str] = []
    for pattern in src.files or []:
        matched = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        matched = [m for m in matched if os.path.isfile(m)]
        if not matched:
            raise UserError(
                f"{key}.files: '{pattern}' matches no file (relative paths are resolved against {Path.cwd()}); "
                "check the path or the glob"
            )
        files += matched
    fmt = src.format
    if fmt == "auto":
        kinds = set()
        for f in files:
            suffixes = [s for s in Path(f).suffixes if s not in (".gz", ".bz2", ".xz", ".zst")]
            kind = FORMATS.get(suffixes[-1].lower() if suffixes else "")
            if kind is None:
                raise UserError(
                    f"{key}.files: cannot tell the format of '{f}' from its extension; set {key}.format to "
                    "text, json or parquet"
                )
            kinds.add(kind)
        if len(kinds) > 1:
            raise UserError(
                f"{key}.files: mixed formats ({', '.join(sorted(kinds))}); use one format per source"
            )
        fmt = kinds.pop()
    return files, fmt


def source_key(src: DataSource, key: str) -> dict[str, Any]:
    """What identifies a source's content for the cache: file stats, or the hub id."""
    if src.files is not None:
        files, fmt = resolve_files(src, key)
        stats = [(os.path.abspath(f), os.path.getsize(f), os.stat(f).st_mtime_ns) for f in files]
        return {"files": stats, "format": fmt, "text_field": src.text_field, "sample_by": src.sample_by}
    return {"hub": src.hub, "name": src.name, "split": src.split, "text_field": src.text_field}


def load_raw(src: DataSource, key: str) -> Any:
    import datasets

    if src.files is not None:
        files, fmt = resolve_files(src, key)
        if all(os.path.getsize(f) == 0 for f in files):
            raise UserError(
                f"{key}: the dataset is empty (every file is 0 bytes: {', '.join(files[:3])}); point it at data"
            )
        kwargs: dict[str, Any] = (
            {"sample_by": src.sample_by, "keep_linebreaks": True} if fmt == "text" else {}
        )
        try:
            ds = datasets.load_dataset(fmt, data_files=files, split="train", **kwargs)
        except Exception as e:  # datasets raises many kinds; all mean "this file is not what you said"
            raise UserError(
                f"{key}.files: cannot read {fmt} data from {', '.join(files[:3])}: {type(e).__name__}: {e}; check the "
                f"file contents or set {key}.format"
            ) from None
    else:
        try:
            ds = datasets.load_dataset(src.hub, src.name, split=src.split)
        except Exception as e:
            raise UserError(
                f"{key}.hub: cannot load '{src.hub}' (split {src.split}): {str(e).splitlines()[0]}"
            ) from None
    if src.text_field not in ds.column_names:
        raise UserError(
            f"{key}.text_field: '{src.text_field}' is not a column of the data; its columns are "
            f"{', '.join(ds.column_names)}"
        )
    return ds


# ----------------------------------------------------------------------------- tokenize + pack


def _tokenize_and_pack(raw: Any, tok: Any, section: DataSection, text_field: str, num_proc: int) -> Any:
    """datasets.map: tokenize (append EOS), then concatenate and cut into seq_len blocks."""
    eos = tok.eos_token_id
    seq_len = section.seq_len
    append_eos = section.append_eos

    def tokenize(batch: dict[str, list]) -> dict[str, list]:
        texts = [t for t in batch[text_field] if isinstance(t, str) and t]
        ids = tok(texts, add_special_tokens=False)["input_ids"]
        if append_eos:
            ids = [x + [eos] for x in ids]
        return {"ids": ids}

    def pack(batch: dict[str, list]) -> dict[str, list]:
        flat = np.fromiter((t for x in batch["ids"] for t in x), dtype=np.int32)
        n = len(flat) // seq_len
        return {"input_ids": flat[: n * seq_len].reshape(n, seq_len).tolist()}

    proc = num_proc if num_proc > 1 and len(raw) >= 1000 * num_proc else None
    ids = raw.map(
        tokenize,
        batched=True,
        batch_size=1000,
        num_proc=proc,
        remove_columns=raw.column_names,
        desc="tokenize",
    )
    tokens = int(sum(len(x) for x in ids["ids"])) if len(ids) < 100_000 else None
    packed = ids.map(pack, batched=True, batch_size=1000, num_proc=proc, remove_columns=["ids"], desc="pack")
    return packed, tokens


@dataclass
class Data:
    """Everything the loop needs from the data side."""

    train: np.ndarray  # (sequences, seq_len) int32, memory-mapped from the cache
    eval: np.ndarray | None
    tokenizer: Any
    seq_len: int
    cache_path: str
    built: bool  # True when this process tokenized (a cache miss)
    # What identifies the training data: sequences, a digest of their tokens, the sources' files
    # (path, size, mtime) and the tokenizer. Saved with every checkpoint, compared on resume.
    fingerprint: dict[str, Any] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def eos_id(self) -> int | None:
        return self.tokenizer.eos_token_id


def build(section: DataSection, seed: int, is_main: bool = True) -> Data:
    """Load (from cache, or tokenize and pack once per node) the train and eval sets."""
    tok = load_tokenizer(section.tokenizer)
    if section.append_eos and tok.eos_token_id is None:
        raise UserError(f"data.tokenizer '{section.tokenizer}' has no EOS token; set data.append_eos: false")
    key = {
        "version": CACHE_VERSION,
        "train": source_key(section.train, "data.train"),
        "eval": source_key(section.eval, "data.eval") if section.eval is not None else None,
        "eval_fraction": section.eval_fraction if section.eval is None else 0.0,
        "tokenizer": tokenizer_id(tok, section.tokenizer),
        "seq_len": section.seq_len,
        "append_eos": section.append_eos,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    root = Path(os.path.expanduser(section.cache_dir))
    root.mkdir(parents=True, exist_ok=True)
    final = root / digest
    built = False
    with file_lock(root / f"{digest}.lock"):  # one builder per node; the others wait here, then read
        if not (final / "meta.json").exists():
            _build_cache(section, tok, key, final, quiet=not (is_main and sys.stderr.isatty()))
            built = True
        meta = json.loads((final / "meta.json").read_text())
        if "train_digest" not in meta:  # a cache made before the digest was recorded
            meta["train_digest"] = file_digest(final / "train.npy")
            write_atomic(final / "meta.json", json.dumps(meta, indent=2))
    train = np.load(final / "train.npy", mmap_mode="r")
    eval_ = np.load(final / "eval.npy", mmap_mode="r") if (final / "eval.npy").exists() else None
    fingerprint = {
        "train_sequences": int(meta["train_sequences"]),
        "train_digest": meta["train_digest"],
        "sources": meta["train"],
        "tokenizer": meta["tokenizer"],
    }
    return Data(
        train=train,
        eval=eval_,
        tokenizer=tok,
        seq_len=section.seq_len,
        cache_path=str(final),
        built=built,
        fingerprint=fingerprint,
    )


def file_digest(path: Path, chunk: int = 1 << 24) -> str:
    """sha256 of a file's bytes, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def data_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """How the training data differs from the data a checkpoint was trained on (both `Data.fingerprint`),
    each difference in words; [] when the packed sequences are the same (a file that was only touched
    or re-tokenized to the same tokens is no change)."""
    if (
        saved.get("train_digest") == now["train_digest"]
        and saved.get("train_sequences") == now["train_sequences"]
    ):
        return []
    out = []
    if saved.get("train_sequences") != now["train_sequences"]:
        out.append(
            f"training sequences: {saved.get('train_sequences')} at the checkpoint, {now['train_sequences']} now"
        )
    else:
        out.append(f"the same number of training sequences ({now['train_sequences']}) with other tokens")
    if saved.get("tokenizer") != now["tokenizer"]:
        out.append(f"tokenizer: {saved.get('tokenizer')} at the checkpoint, {now['tokenizer']} now")
    before, after = saved.get("sources") or {}, now["sources"]
    if "files" in before and "files" in after:
        old = {f[0]: (f[1], f[2]) for f in before["files"]}
        new = {f[0]: (f[1], f[2]) for f in after["files"]}
        for path in sorted(old.keys() - new.keys()):
            out.append(f"{path}: gone")
        for path in sorted(new.keys() - old.keys()):
            out.append(f"{path}: new ({new[path][0]:,} bytes)")
        for path in sorted(old.keys() & new.keys()):
            (s0, t0), (s1, t1) = old[path], new[path]
            if s0 != s1:
                out.append(f"{path}: {s0:,} bytes at the checkpoint, {s1:,} now")
            elif t0 != t1:
                out.append(f"{path}: modified since the checkpoint (same size)")
    elif before != after:
        out.append(f"source: {before} at the checkpoint, {after} now")
    return out


def _build_cache(section: DataSection, tok: Any, key: dict[str, Any], final: Path, quiet: bool) -> None:
    import datasets

    from trainer.dist import cpu_cores

    if quiet:
        datasets.disable_progress_bars()
    num_proc = section.num_proc or min(8, cpu_cores())
    raw = load_raw(section.train, "data.train")
    if len(raw) == 0:
        raise UserError(
            f"data.train: the dataset is empty (0 rows in {_where(section.train)}); point it at data"
        )
    train, tokens = _tokenize_and_pack(raw, tok, section, section.train.text_field, num_proc)
    if len(train) == 0:
        raise UserError(
            f"data.train: {len(raw)} document(s) with {tokens} tokens make no full sequence of data.seq_len "
            f"{section.seq_len}; lower data.seq_len or add data"
        )
    if section.eval is not None:
        raw_eval = load_raw(section.eval, "data.eval")
        eval_, _ = _tokenize_and_pack(raw_eval, tok, section, section.eval.text_field, num_proc)
        if len(eval_) == 0:
            raise UserError(
                f"data.eval: no full sequence of data.seq_len {section.seq_len}; lower it or add data"
            )
    elif section.eval_fraction > 0:
        # Hold out the tail: packing keeps document order, so these are the last documents.
        n_eval = max(1, math.ceil(len(train) * section.eval_fraction))
        if n_eval >= len(train):
            raise UserError(
                f"data.eval_fraction: {len(train)} sequences are too few to hold out {section.eval_fraction:.0%}; "
                "set eval_fraction: 0 or add data"
            )
        eval_ = train.select(range(len(train) - n_eval, len(train)))
        train = train.select(range(len(train) - n_eval))
    else:
        eval_ = None
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        _save_blocks(train, tmp / "train.npy", section.seq_len)
        if eval_ is not None:
            _save_blocks(eval_, tmp / "eval.npy", section.seq_len)
        meta = {
            **key,
            "train_sequences": len(train),
            "eval_sequences": len(eval_) if eval_ is not None else 0,
            "train_digest": file_digest(tmp / "train.npy"),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        try:
            os.rename(tmp, final)
        except OSError:  # another node on a shared filesystem finished first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _save_blocks(packed: Any, path: Path, seq_len: int, chunk: int = 65536) -> None:
    """The packed `input_ids` column -> an int32 .npy of (sequences, seq_len), written in chunks so
    that a corpus larger than memory never is in memory whole."""
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.int32, shape=(len(packed), seq_len))
    rows = packed.with_format("numpy")
    for start in range(0, len(packed), chunk):
        out[start : start + chunk] = rows[start : start + chunk]["input_ids"]
    out.flush()
    del out


def _where(src: DataSource) -> str:
    return ", ".join(src.files) if src.files else str(src.hub)


# ----------------------------------------------------------------------------- sampling


class RankSampler:
    """Yields this rank's sample indices for one epoch, from global sample `start` on.

    The global order of an epoch is a permutation seeded by (seed, epoch); each micro step takes
    the next world*micro samples of it and rank r takes its micro-slice. Incomplete global batches
    at the end of an epoch are dropped, so every rank takes the same number of steps."""

    def __init__(self, n: int, rank: int, world: int, micro: int, seed: int, shuffle: bool) -> None:
        self.n, self.rank, self.world, self.micro, self.seed, self.shuffle = (
            n,
            rank,
            world,
            micro,
            seed,
            shuffle,
        )
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n)
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    @property
    def global_batch(self) -> int:
        return self.world * self.micro

    def steps_per_epoch(self) -> int:
        return self.n // self.global_batch

    def __iter__(self) -> Iterator[int]:
        rest = self.order(self.epoch)[self.start :]
        steps = len(rest) // self.global_batch
        mine = rest[: steps * self.global_batch].reshape(steps, self.world, self.micro)[:, self.rank, :]
        return iter(mine.reshape(-1).tolist())

    def __len__(self) -> int:
        return ((self.n - self.start) // self.global_batch) * self.micro


class _Rows:
    """Map-style dataset over the memory-mapped blocks; `__getitems__` fetches a batch in one take."""

    def __init__(self, blocks: np.ndarray) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> np.ndarray:
        return np.asarray(self.blocks[int(i)])

    def __getitems__(self, idx: list[int]) -> np.ndarray:
        return self.blocks[np.asarray(idx, dtype=np.int64)]


def _collate(rows: Any) -> Any:
    import torch

    arr = np.asarray(rows) if not isinstance(rows, np.ndarray) else rows
    return torch.from_numpy(arr.astype(np.int64, copy=False))


def make_loader(ds: Any, sampler: RankSampler, section: DataSection, device_type: str) -> Any:
    import torch
    from torch.utils.data import DataLoader

    workers = section.num_workers
    return DataLoader(
        _Rows(ds),
        batch_size=sampler.micro,
        sampler=sampler,
        drop_last=True,
        num_workers=workers,
        pin_memory=section.pin_memory and device_type == "cuda",
        persistent_workers=section.persistent_workers and workers > 0,
        collate_fn=_collate,
        # Own generator: creating an iterator must not draw from the global RNG (exact resume).
        generator=torch.Generator().manual_seed(0),
        multiprocessing_context="fork" if workers > 0 else None,
    )


@dataclass
class Position:
    """Where training is in the data: the epoch and global samples consumed in it."""

    epoch: int = 0
    sample: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "sample": self.sample}


class TrainStream:
    """Endless micro batches for this rank, across epochs; knows its position for checkpoints."""

    def __init__(
        self,
        data: Data,
        section: DataSection,
        *,
        rank: int,
        world: int,
        micro: int,
        seed: int,
        device_type: str,
    ) -> None:
        self.sampler = RankSampler(len(data.train), rank, world, micro, seed, section.shuffle)
        if self.sampler.steps_per_epoch() == 0:
            raise UserError(
                f"data.train: {len(data.train)} sequences are fewer than one global micro batch ({world} ranks x "
                f"train.micro_batch_size {micro}); lower the micro batch or add data"
            )
        self.loader = make_loader(data.train, self.sampler, section, device_type)
        self.position = Position()
        self._it: Iterator[Any] | None = None
        self.record: list[str] | None = None  # digests of consumed rows, when a test asks for them

    def seek(self, position: Position) -> None:
        """Continue from `position` (global samples in the epoch; any world size)."""
        gb = self.sampler.global_batch
        if position.sample + gb > self.sampler.n:  # the saved epoch was finished
            position = Position(position.epoch + 1, 0)
        self.position = Position(position.epoch, position.sample)
        self._it = None

    def next(self) -> Any:
        if self._it is None:
            self.sampler.set_epoch(self.position.epoch, self.position.sample)
            self._it = iter(self.loader)
        try:
            batch = next(self._it)
        except StopIteration:
            self.position = Position(self.position.epoch + 1, 0)
            self.sampler.set_epoch(self.position.epoch, 0)
            self._it = iter(self.loader)
            batch = next(self._it)
        self.position.sample += self.sampler.global_batch
        if self.record is not None:
            from trainer.checks import row_digest

            self.record += [row_digest(row) for row in batch]
        return batch

    @property
    def steps_per_epoch(self) -> int:
        return self.sampler.steps_per_epoch()


def eval_batches(
    data: Data, section: DataSection, *, rank: int, world: int, micro: int, limit: int, device_type: str
) -> Any:
    """A fixed, unshuffled loader over the eval set, sharded like training; at most `limit` batches."""
    if data.eval is None:
        return None
    sampler = RankSampler(len(data.eval), rank, world, micro, 0, shuffle=False)
    if sampler.steps_per_epoch() == 0:
        # Fewer eval sequences than one global batch: evaluate one smaller batch per rank instead.
        micro = max(1, len(data.eval) // world)
        sampler = RankSampler(len(data.eval), rank, world, micro, 0, shuffle=False)
        if sampler.steps_per_epoch() == 0:
            return None
    loader = make_loader(
        data.eval,
        sampler,
        section.model_copy(update={"persistent_workers": False, "num_workers": 0}),
        device_type,
    )
    return _Limited(loader, limit)


class _Limited:
    def __init__(self, loader: Any, limit: int) -> None:
        self.loader, self.limit = loader, limit

    def __iter__(self) -> Iterator[Any]:
        for i, batch in enumerate(self.loader):
            if i >= self.limit:
                return
            yield batch
