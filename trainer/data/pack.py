"""Tokenize and pack: documents -> token ids (EOS appended) -> one stream cut into seq_len blocks (no
token lost: the last block is padded); fine-tuning examples -> packed rows kept apart."""

from __future__ import annotations

from typing import Any

import numpy as np

from trainer.config import DataSection
from trainer.data.tokenizer import special_edges

IGNORE = -100  # a label the loss skips (transformers' ignore_index)


def tokenize_documents(
    raw: Any, tok: Any, section: DataSection, text_field: str, num_proc: int
) -> tuple[Any, int]:
    """datasets.map over the documents: token ids, in order, each document between the special tokens
    the tokenizer adds by default (BOS for Llama 3, Gemma, Mistral: tokenizer.special_edges) and with
    EOS appended (data.append_eos, unless the tokenizer ends a text with it itself). -> (dataset of
    `ids`, tokens)."""
    import pyarrow.compute as pc

    eos = tok.eos_token_id
    before, after = special_edges(tok)
    tail = after + ([eos] if section.append_eos and not (after and after[-1] == eos) else [])

    def tokenize(batch: dict[str, list]) -> dict[str, list]:
        texts = [t for t in batch[text_field] if isinstance(t, str) and t]
        ids = tok(texts, add_special_tokens=False)["input_ids"]
        return {"ids": [before + x + tail for x in ids]}

    proc = num_proc if num_proc > 1 and len(raw) >= 1000 * num_proc else None
    ids = raw.map(
        tokenize,
        batched=True,
        batch_size=1000,
        num_proc=proc,
        remove_columns=raw.column_names,
        desc="tokenize",
    )
    column = ids.data.column("ids")
    tokens = sum(int(pc.sum(pc.list_value_length(c)).as_py() or 0) for c in column.chunks)
    return ids, tokens


def blocks(tokens: int, seq_len: int) -> int:
    """Rows of `seq_len` that hold `tokens` end to end, the last one partly (none lost)."""
    return -(-tokens // seq_len)


def fill_blocks(ids: Any, parts: list[np.ndarray]) -> None:
    """Write the documents' tokens (`tokenize_documents`) end to end into `parts` (int32 arrays of
    (rows, seq_len), in order, memory-mapped or not), chunk by chunk, so that a corpus larger than
    memory never is in memory whole. Every token lands in exactly one row; the space after the last
    token holds IGNORE: a padded, partly filled last row (`as_rows` makes it one the loss masks)."""
    flats = [p.reshape(-1) for p in parts]
    part, at = 0, 0
    for chunk in ids.data.column("ids").chunks:
        values = chunk.flatten().to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
        while len(values):
            while at == len(flats[part]):
                part, at = part + 1, 0
            n = min(len(values), len(flats[part]) - at)
            flats[part][at : at + n] = values[:n]
            values, at = values[n:], at + n
    for flat in flats[part:]:
        flat[at:] = IGNORE
        at = 0


def as_rows(blocks: np.ndarray) -> np.ndarray:
    """Token blocks with a padded (partly filled) one -> rows of [input_ids, labels, position_ids] like
    fine-tuning rows: the padding is input id 0 (any id would do: it comes after every real token, so
    causal attention never lets a real token see it) and no target. The data cache's text blocks hold IGNORE after the corpus' last token; the batch that
    draws that one row becomes such rows (`stream._collate`)."""
    labels = blocks
    inputs = np.where(blocks < 0, 0, blocks)
    pos = np.broadcast_to(np.arange(blocks.shape[1], dtype=blocks.dtype), blocks.shape)
    return np.stack([inputs, labels, pos], axis=1)


def pack_examples(
    examples: Any,
    seq_len: int,
    pad_id: int,
    one_per_row: bool = False,
    placed: list[int] | None = None,
    images: tuple[list[int], int] | None = None,
) -> dict[str, np.ndarray]:
    """Fine-tuning examples (`chat.Example`, each at most `seq_len` tokens) -> rows of `seq_len`:
    `input_ids`, `labels` (the token where it is a target, else IGNORE; an example's first token never
    is, as nothing of its own comes before it) and `position_ids` restarting at 0 at each example,
    so that attention never crosses an example (transformers builds per-example causal masks from
    packed position ids when no attention mask and no cache are passed). In order, greedily: an
    example that does not fit in the row's space left starts the next row; the rest of a row is
    padding (IGNORE, its own positions). Every token of every example is in exactly one row.
    `one_per_row` (data.packing: false): each example alone in its row. `placed`: filled with each example's
    row (an empty example's: -1). `images`: each example's images and the most a row holds (data.max_images,
    where an image is one token): an example that would pass it starts the next row."""
    rows: list[tuple[list[int], list[int], list[int]]] = []
    ids: list[int] = []
    labels: list[int] = []
    pos: list[int] = []
    held = 0  # the row's images (`images`)

    def close() -> None:
        pad = seq_len - len(ids)
        rows.append((ids + [pad_id] * pad, labels + [IGNORE] * pad, pos + list(range(pad))))

    for k, ex in enumerate(examples):
        n = len(ex.ids)
        pictures = images[0][k] if images else 0
        if n > seq_len:
            raise ValueError(f"an example of {n} tokens is longer than seq_len {seq_len}: truncate it first")
        if n == 0:
            if placed is not None:
                placed.append(-1)
            continue
        if ids and (one_per_row or len(ids) + n > seq_len or (images and held + pictures > images[1])):
            close()
            ids, labels, pos, held = [], [], [], 0
        held += pictures
        if placed is not None:
            placed.append(len(rows))
        ids += ex.ids
        labels += [IGNORE] + [t if m else IGNORE for t, m in zip(ex.ids[1:], ex.targets[1:], strict=True)]
        pos += list(range(n))
    if ids:
        close()
    out = {k: np.zeros((len(rows), seq_len), dtype=np.int32) for k in ("input_ids", "labels", "position_ids")}
    for r, (i, lab, p) in enumerate(rows):
        out["input_ids"][r], out["labels"][r], out["position_ids"][r] = i, lab, p
    return out
