"""The tokenized data cache: sources tokenized and packed once per node, kept as `train.npy` and
`eval.npy` (int32, sequences x seq_len) read memory-mapped, keyed by the source files (path, size,
mtime), the tokenizer and the packing settings. The first process on a node to take the cache lock
builds it; the others wait and read it. A cache hit costs neither an import of `datasets` nor a copy
of the data per rank.

Each cache records the training data's fingerprint (sequences, a digest of the packed tokens, the
sources and the tokenizer), which every checkpoint saves and a resume compares (`data_changes`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainer.common.errors import UserError
from trainer.common.files import file_lock, write_atomic
from trainer.config import DataSection
from trainer.data.image_rows import save_images, stale_images, stored_images
from trainer.data.keys import cache_key, data_changes, file_digest, rebuilt_why, side_digests  # noqa: F401
from trainer.data.pack import IGNORE, blocks, fill_blocks, tokenize_documents
from trainer.data.prompts import read_columns
from trainer.data.sources import _where, load_raw
from trainer.data.tokenizer import load_tokenizer


@dataclass
class Data:
    """Everything the loop needs from the data side."""

    train: np.ndarray  # (sequences, seq_len) int32, memory-mapped from the cache
    eval: np.ndarray | None
    tokenizer: Any
    seq_len: int
    cache_path: str
    built: bool  # True when this process tokenized (a cache miss)
    rebuilt: str | None = None  # a miss where a cache of the same files was there: what changed since
    # What identifies the training data: sequences, a digest of their tokens, the sources' files
    # (path, size, mtime) and the tokenizer. Saved with every checkpoint, compared on resume.
    fingerprint: dict[str, Any] = field(default_factory=dict)
    finetune: dict[str, Any] | None = None  # fine-tuning kinds: what was kept, truncated, dropped
    targets: np.ndarray | None = None  # fine-tuning kinds: target tokens per training row (the loss's count)
    lengths: np.ndarray | None = None  # fine-tuning kinds: per row, the last target's position + 1
    mixture: list[dict[str, Any]] | None = (
        None  # several sources: each one's name, weight, sequences (in order)
    )
    tokens: int | None = None  # real tokens in train and eval (not padding), where the cache knows
    packing: str | None = None  # packed fine-tuning rows: why this model family may pack (the check's words)
    columns: list[dict[str, Any]] | None = (
        None  # prompt data: each row's other columns (the reward functions')
    )
    images: Any = None  # chat data with images: each training row's image tensors (data/images.py ImageStore)
    eval_images: Any = None
    idle_image: Any = None  # a blank image's tensors (trainer/model/vision.py: the idle image)
    vision: dict[str, Any] | None = None  # the images' statistics, keys and token types (meta.json)
    margins: np.ndarray | None = None  # pairs: each one's margin (NaN: none; reward); unpaired: its label
    eval_margins: np.ndarray | None = None

    @property
    def supervised(self) -> bool:
        """Rows of [input_ids, labels, position_ids] (fine-tuning kinds), not token blocks."""
        return self.train.ndim >= 3

    @property
    def pairs(self) -> bool:
        """Preference pairs: (pairs, 2, 3, seq_len), chosen and rejected rows (data/preference.py)."""
        return self.train.ndim == 4

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def eos_id(self) -> int | None:
        return self.tokenizer.eos_token_id


def build(
    section: DataSection,
    seed: int,
    is_main: bool = True,
    num_proc: int | None = None,
    progress: bool | None = None,
) -> Data:
    """Load (from cache, or tokenize and pack once per node) the train and eval sets. `num_proc`:
    tokenizer processes (default data.num_proc, else up to 8 cores); `progress`: progress bars
    (default: on rank 0 in a terminal)."""
    tok = load_tokenizer(section.tokenizer)
    if section.append_eos and tok.eos_token_id is None:
        raise UserError(f"data.tokenizer '{section.tokenizer}' has no EOS token; set data.append_eos: false")
    key = cache_key(section, tok)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    root = Path(os.path.expanduser(section.cache_dir))
    root.mkdir(parents=True, exist_ok=True)
    final = root / digest
    built, why = False, None
    with file_lock(root / f"{digest}.lock"):  # one builder per node; the others wait here, then read
        changed = stale_images(final)  # an image file changed since, or the image cache damaged: made again
        if changed:
            shutil.rmtree(final)
        if not (final / "meta.json").exists():
            why = changed or rebuilt_why(root, key, digest)
            quiet = not (is_main and sys.stderr.isatty()) if progress is None else not progress
            _build_cache(section, tok, key, final, quiet=quiet, num_proc=num_proc)
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
        **{k: meta[k] for k in ("images_digest", "margins_digest") if k in meta},  # pixels; labels, margins
    }
    return Data(
        **stored_images(final, (meta.get("finetune") or {}).get("vision")),
        train=train,
        eval=eval_,
        tokenizer=tok,
        seq_len=section.seq_len,
        cache_path=str(final),
        built=built,
        rebuilt=why,
        fingerprint=fingerprint,
        finetune=meta.get("finetune"),
        mixture=meta.get("mixture"),
        tokens=meta.get("tokens", (meta.get("finetune") or {}).get("tokens")),
        targets=np.load(final / "targets.npy", mmap_mode="r") if (final / "targets.npy").exists() else None,
        columns=read_columns(final),
        lengths=_lengths(final, train),
        margins=_side(final, "margins.npy"),
        eval_margins=_side(final, "eval_margins.npy"),
    )


def _side(directory: Path, name: str, write: np.ndarray | None = None) -> np.ndarray | None:
    """A side array of the rows (preference pairs' margins.npy): read, or with `write` written where not None."""
    _ = write is not None and np.save(directory / name, write)
    return np.load(directory / name) if write is None and (directory / name).exists() else None


def _lengths(directory: Path, train: np.ndarray) -> np.ndarray | None:
    """Fine-tuning rows' lengths (row_lengths): lengths.npy, written with the cache (computed here for
    a cache made before it was)."""
    if train.ndim < 3:
        return None
    if (directory / "lengths.npy").exists():
        return np.load(directory / "lengths.npy")
    return row_lengths(train)


def row_lengths(rows: np.ndarray) -> np.ndarray:
    """Fine-tuning rows: each row's last target position + 1. What follows in a row is padding or an
    untrained tail, which nothing before it attends to: a batch needs only its rows' longest."""
    if rows.ndim == 4:  # preference pairs: the longer of the pair's two rows
        return row_lengths(np.asarray(rows).reshape(-1, *rows.shape[2:])).reshape(len(rows), 2).max(axis=1)
    labels = np.asarray(rows[:, 1, :])
    has = labels != IGNORE
    last = labels.shape[1] - np.argmax(has[:, ::-1], axis=1)
    return np.where(has.any(axis=1), last, 1).astype(np.int32)


def _build_cache(
    section: DataSection, tok: Any, key: dict[str, Any], final: Path, quiet: bool, num_proc: int | None = None
) -> None:
    import datasets

    from trainer.cluster.dist import cpu_cores

    if quiet:
        datasets.disable_progress_bars()
    num_proc = num_proc or section.num_proc or min(8, cpu_cores())
    if section.mixture:
        _build_mixture_cache(section, tok, key, final, num_proc)
        return
    raw = load_raw(section.train, "data.train")
    if len(raw) == 0:
        raise UserError(
            f"data.train: the dataset is empty (0 rows in {_where(section.train)}); point it at data"
        )
    if section.kind == "prompt":  # train.objective grpo: the prompts, and the columns for the rewards
        from trainer.data.prompts import build_prompts, write_columns

        prompts, columns, stats = build_prompts(raw, tok, section)
        meta = {**key, "key": key, "train_sequences": len(prompts), "eval_sequences": 0, "finetune": stats}

        def write(d: Path) -> None:
            np.save(d / "train.npy", prompts)
            write_columns(d, columns)

        _publish(final, write, None, meta)
        return
    if section.kind != "text" or section.separate_documents:
        _build_finetune_cache(section, tok, key, final, raw)
        return
    ids, tokens = tokenize_documents(raw, tok, section, section.train.text_field, num_proc)
    if tokens == 0:
        raise UserError(f"data.train: {len(raw)} document(s) hold no text; point it at data")
    seq_len, n = section.seq_len, blocks(tokens, section.seq_len)
    if section.eval is not None:
        eval_ids, eval_tokens = tokenize_documents(
            load_raw(section.eval, "data.eval"), tok, section, section.eval.text_field, num_proc
        )
        if eval_tokens == 0:
            raise UserError("data.eval: the documents hold no text; point it at data")
        n_train, n_eval, train_tokens = n, blocks(eval_tokens, seq_len), tokens
        fills = [(ids, [("train.npy", n_train)]), (eval_ids, [("eval.npy", n_eval)])]
        tokens += eval_tokens
    else:
        # data.eval_fraction: hold out the tail (packing keeps document order: the last documents).
        n_eval = _held_out(n, section.eval_fraction, seq_len=seq_len) if section.eval_fraction > 0 else 0
        n_train, train_tokens = n - n_eval, min(tokens, (n - n_eval) * seq_len)
        fills = [(ids, [("train.npy", n_train)] + ([("eval.npy", n_eval)] if n_eval else []))]

    def write(d: Path) -> None:
        for stream, files in fills:  # each token stream end to end into its files' blocks
            fill_blocks(stream, [_open_blocks(d / name, rows, seq_len) for name, rows in files])
        # The padded last block is in training: the loss's count per row (known without reading it).
        if train_tokens < n_train * seq_len:
            targets = np.full(n_train, seq_len - 1, dtype=np.int32)
            targets[-1] = train_tokens - (n_train - 1) * seq_len - 1
            np.save(d / "targets.npy", targets)

    _publish(
        final,
        write,
        None,
        {**key, "key": key, "train_sequences": n_train, "eval_sequences": n_eval, "tokens": tokens},
    )


def _open_blocks(path: Path, rows: int, seq_len: int) -> np.ndarray:
    return np.lib.format.open_memmap(path, mode="w+", dtype=np.int32, shape=(rows, seq_len))


def _block_targets(train: np.ndarray) -> np.ndarray:
    """Target tokens per row of token blocks (all but the first, the padding of a padded one not)."""
    targets = np.full(len(train), train.shape[1] - 1, dtype=np.int32)
    for i in np.flatnonzero(np.asarray(train[:, -1]) < 0):
        targets[i] = int((train[i, 1:] >= 0).sum())
    return targets


def _held_out(n: int, fraction: float, key: str = "data.train", seq_len: int | None = None) -> int:
    """How many of `n` sequences data.eval_fraction holds out (at least one, never all)."""
    n_eval = max(1, math.ceil(n * fraction))
    if n_eval >= n:
        of = f" of data.seq_len {seq_len}" if seq_len else ""
        raise UserError(
            f"data.eval_fraction: {key} makes {n} sequence(s){of}, too few to hold out {fraction:.0%}; set "
            f"eval_fraction: 0, add data or lower data.seq_len"
        )
    return n_eval


def _publish(final: Path, write_train: Any, write_eval: Any, meta: dict[str, Any]) -> None:
    """Write the cache into a hidden directory, then rename it into place (atomic)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        write_train(tmp)
        if write_eval is not None:
            write_eval(tmp)
        meta = {**meta, "train_digest": file_digest(tmp / "train.npy"), **side_digests(tmp)}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        try:
            os.rename(tmp, final)
        except OSError:  # another node on a shared filesystem finished first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _save_rows(directory: Path, rows: np.ndarray) -> None:
    """The training rows; for fine-tuning, beside them the target tokens of each (labels after the first
    position: the count a step's loss is divided by), counted once here rather than by every rank at
    every start."""
    np.save(directory / "train.npy", rows)
    if rows.ndim == 4:  # preference pairs: each pair's loss is its own (no step-wide target count)
        np.save(directory / "lengths.npy", row_lengths(rows))
    elif rows.ndim == 3:
        np.save(directory / "targets.npy", (rows[:, 1, 1:] != IGNORE).sum(axis=1).astype(np.int32))
        np.save(directory / "lengths.npy", row_lengths(rows))
    elif (rows[:, -1] < 0).any():  # a mixture of text sources, with a padded last block of one
        np.save(directory / "targets.npy", _block_targets(rows))


def _source_rows(src: Any, key: str, tok: Any, section: DataSection, num_proc: int) -> tuple[np.ndarray, Any]:
    """One source of a mixture -> its rows in memory (and, fine-tuning, its statistics)."""
    raw = load_raw(src, key)
    if len(raw) == 0:
        raise UserError(f"{key}: the dataset is empty (0 rows in {_where(src)}); point it at data")
    if src.kind != "text" or section.separate_documents:
        from trainer.data.examples import build_rows

        return build_rows(raw, tok, section, src, key)
    ids, tokens = tokenize_documents(raw, tok, section, src.text_field, num_proc)
    if tokens == 0:
        raise UserError(f"{key}: the documents hold no text ({_where(src)}); point it at data")
    rows = np.empty((blocks(tokens, section.seq_len), section.seq_len), dtype=np.int32)
    fill_blocks(ids, [rows])
    return rows, None


def _build_mixture_cache(
    section: DataSection, tok: Any, key: dict[str, Any], final: Path, num_proc: int
) -> None:
    """Several sources: each tokenized (and for fine-tuning packed) on its own, its tail held out for
    eval, then concatenated in order; the stream mixes them by weight (stream.RankSampler). Built in
    memory, source by source."""
    train, evals, mixture, stats = [], [], [], []
    for k, src in section.sources:
        rows, st = _source_rows(src, k, tok, section, num_proc)
        if st is not None and st.get("vision"):
            raise UserError(f"{k}: a mixture of sources with images is not supported yet; give one source")
        if section.eval is None and section.eval_fraction > 0:
            n_eval = _held_out(len(rows), section.eval_fraction, k, section.seq_len)
            rows, held = rows[:-n_eval], rows[-n_eval:]
            evals.append(held)
        train.append(rows)
        mixture.append({"source": f"{k} {_where(src)}", "weight": src.weight, "sequences": len(rows)})
        if st is not None:
            stats.append(st)
    if section.eval is not None:
        evals = [_source_rows(section.eval, "data.eval", tok, section, num_proc)[0]]
    all_train = np.concatenate(train)
    all_eval = np.concatenate(evals) if evals else None
    meta = {**key, "key": key, "train_sequences": len(all_train), "eval_sequences": len(all_eval) if all_eval is not None else 0,
            "mixture": mixture}  # fmt: skip
    if stats:
        sums = {f: sum(s[f] for s in stats) for f in ("examples", "kept", "truncated", "dropped_too_long",
                                                         "dropped_no_target", "tokens", "target_tokens", "rows")}  # fmt: skip
        meta["finetune"] = {**sums, "kind": stats[0]["kind"], "example": stats[0]["example"],
                            "padding_share": 1 - sums["tokens"] / (sums["rows"] * section.seq_len),
                            "conversations": sum(s.get("conversations", s["examples"]) for s in stats)}  # fmt: skip
        templates = [s["template"] for s in stats if s.get("template")]
        if templates:
            unread: dict[str, int] = {}
            for t in templates:
                for k, n in t["unread_keys"].items():
                    unread[k] = unread.get(k, 0) + n
            meta["finetune"]["template"] = {**templates[0], "unread_keys": unread,
                                            "turn_by_turn": sum(t["turn_by_turn"] for t in templates)}  # fmt: skip
    _publish(
        final,
        lambda d: _save_rows(d, all_train),
        (lambda d: np.save(d / "eval.npy", all_eval)) if all_eval is not None else None,
        meta,
    )


def _build_finetune_cache(section: DataSection, tok: Any, key: dict[str, Any], final: Path, raw: Any) -> None:
    """Fine-tuning kinds: rows of [input_ids, labels, position_ids] (trainer/data/examples.py)."""
    from trainer.data.examples import build_rows

    train, stats = build_rows(raw, tok, section, section.train, "data.train")
    margins, eval_margins = stats.pop("margins", None), None  # preference pairs' (train.objective reward)
    vision = stats.pop("vision", None)
    store, idle = (vision.pop("store") if vision else None), None
    eval_, eval_store = None, None
    if section.eval is not None:
        eval_, eval_stats = build_rows(
            load_raw(section.eval, "data.eval"), tok, section, section.eval, "data.eval"
        )
        eval_store, eval_margins = (
            (eval_stats.get("vision") or {}).get("store"),
            eval_stats.pop("margins", None),
        )
        stats["eval"] = {
            k: eval_stats[k] for k in ("margin_problem", "identical", "margin_rows") if k in eval_stats
        }
    elif section.eval_fraction > 0:
        n_eval = _held_out(len(train), section.eval_fraction, seq_len=section.seq_len)
        if (
            stats.get("whole_pairs") and n_eval % 2 and n_eval + 1 < len(train)
        ):  # (a pair's two rows together)
            n_eval += 1
        train, eval_ = train[:-n_eval], train[-n_eval:]
        if margins is not None:
            margins, eval_margins = margins[:-n_eval], margins[-n_eval:]
        if store is not None:
            store, eval_store = store.take(0, len(train)), store.take(len(train), len(train) + n_eval)
    if vision is not None:
        idle, stats["vision"] = vision.pop("idle"), vision

    def write_train(d: Path) -> None:
        _save_rows(d, train)
        save_images(d, "train", store, idle)
        _side(d, "margins.npy", margins)

    def write_eval(d: Path) -> None:
        np.save(d / "eval.npy", eval_)
        save_images(d, "eval", eval_store)
        _side(d, "eval_margins.npy", eval_margins)

    _publish(final, write_train, write_eval if eval_ is not None else None,
             {**key, "key": key, "train_sequences": len(train), "eval_sequences": len(eval_) if eval_ is not None else 0,
              "finetune": stats})  # fmt: skip
