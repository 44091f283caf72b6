"""Tokenize and pack: documents -> token ids (EOS appended) -> one stream cut into seq_len blocks."""

from __future__ import annotations

from typing import Any

import numpy as np

from trainer.config import DataSection


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


IGNORE = -100  # a label the loss skips (transformers' ignore_index)


def pack_examples(
    examples: Any, seq_len: int, pad_id: int, one_per_row: bool = False
) -> dict[str, np.ndarray]:
    """Fine-tuning examples (`chat.Example`, each at most `seq_len` tokens) -> rows of `seq_len`:
    `input_ids`, `labels` (the token where it is a target, else IGNORE; an example's first token never
    is, as nothing of its own comes before it) and `position_ids` restarting at 0 at each example,
    so that attention never crosses an example (transformers builds per-example causal masks from
    packed position ids when no attention mask and no cache are passed). In order, greedily: an
    example that does not fit in the row's space left starts the next row; the rest of a row is
    padding (IGNORE, its own positions). Every token of every example is in exactly one row.
    `one_per_row` (data.packing: false): each example alone in its row."""
    rows: list[tuple[list[int], list[int], list[int]]] = []
    ids: list[int] = []
    labels: list[int] = []
    pos: list[int] = []

    def close() -> None:
        pad = seq_len - len(ids)
        rows.append((ids + [pad_id] * pad, labels + [IGNORE] * pad, pos + list(range(pad))))

    for ex in examples:
        n = len(ex.ids)
        if n > seq_len:
            raise ValueError(f"an example of {n} tokens is longer than seq_len {seq_len}: truncate it first")
        if n == 0:
            continue
        if ids and (one_per_row or len(ids) + n > seq_len):
            close()
            ids, labels, pos = [], [], []
        ids += ex.ids
        labels += [IGNORE] + [t if m else IGNORE for t, m in zip(ex.ids[1:], ex.targets[1:], strict=True)]
        pos += list(range(n))
    if ids:
        close()
    out = {k: np.zeros((len(rows), seq_len), dtype=np.int32) for k in ("input_ids", "labels", "position_ids")}
    for r, (i, lab, p) in enumerate(rows):
        out["input_ids"][r], out["labels"][r], out["position_ids"][r] = i, lab, p
    return out
