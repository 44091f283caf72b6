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
