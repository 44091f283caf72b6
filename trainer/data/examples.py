"""Fine-tuning data (`data.train.kind: prompt_completion | chat`) -> rows for training: each row of
the raw data becomes an Example (trainer/data/chat.py: ids and targets), examples longer than
seq_len are truncated or dropped (data.truncation), examples left with no target are dropped, and
the rest are packed (trainer/data/pack.py) into rows of [input_ids, labels, position_ids]. What was
kept, truncated and dropped, the share of target tokens and one rendered example are returned for
the banner and the cache's meta.json. Text with data.separate_documents: each document (cut into
pieces of seq_len when longer, none lost) is an example whose every token is a target."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from trainer.config import DataSection, DataSource
from trainer.data.chat import Example, check_messages, render_chat, render_prompt_completion, template_for
from trainer.data.pack import pack_examples, tokenize_documents
from trainer.errors import UserError


def chat_template(section: DataSection, tok: Any) -> str | None:
    """The template chat data renders with (None for other kinds)."""
    if section.kind != "chat" and (section.eval is None or section.eval.kind != "chat"):
        return None
    text = None
    if section.chat_template:
        path = Path(section.chat_template).expanduser()
        try:
            text = path.read_text()
        except OSError as e:
            raise UserError(
                f"data.chat_template: cannot read {path}: {e.strerror}; give a .jinja file"
            ) from None
    return template_for(tok, text)


def build_rows(
    raw: Any, tok: Any, section: DataSection, src: DataSource, key: str
) -> tuple[np.ndarray, dict[str, Any]]:
    """(rows (n, 3, seq_len) int32, statistics)."""
    seq_len = section.seq_len
    template = chat_template(section, tok) if src.kind == "chat" else None
    if src.kind == "text":
        return _document_rows(raw, tok, section, src, key)
    kept, shown = [], None
    truncated = dropped_long = no_target = tokens = targets = 0
    for n, row in enumerate(raw):
        where = f"{key} row {n}"
        if src.kind == "chat":
            ex = render_chat(check_messages(row[src.messages_field], where), tok, template,
                             train_on_prompt=section.train_on_prompt)  # fmt: skip
        else:
            prompt, completion = row[src.prompt_field], row[src.completion_field]
            if not isinstance(prompt, str) or not isinstance(completion, str):
                raise UserError(f"{where}: {src.prompt_field} and {src.completion_field} must be strings")
            ex = render_prompt_completion(prompt, completion, tok, train_on_prompt=section.train_on_prompt)
        if len(ex.ids) > seq_len:
            if section.truncation == "drop":
                dropped_long += 1
                continue
            ex = ex.truncated(seq_len)
            truncated += 1
        if not any(ex.targets[1:]):  # the first token of a row is never a target
            no_target += 1
            continue
        if shown is None:
            shown = ex.show(tok)
        kept.append(ex)
        tokens += len(ex.ids)
        targets += sum(ex.targets[1:])
    if not kept:
        raise UserError(
            f"{key}: no example with a token to train on ({truncated} truncated, {dropped_long} longer than "
            f"data.seq_len {seq_len} dropped, {no_target} with no target left); raise data.seq_len"
        )
    rows = _pack(kept, tok, section)
    stats = _stats(src.kind, rows, seq_len, examples=len(kept) + dropped_long + no_target, kept=len(kept),
                   tokens=tokens, targets=targets, example=shown, truncated=truncated,
                   dropped_too_long=dropped_long, dropped_no_target=no_target)  # fmt: skip
    return rows, stats


def _stats(kind: str, rows: np.ndarray, seq_len: int, *, examples: int, kept: int, tokens: int, targets: int,
           example: str | None, **counts: int) -> dict[str, Any]:  # fmt: skip
    """What build_rows reports (the banner, the cache's meta.json): `counts` are the truncated and
    dropped examples (and for text the documents split across sequences)."""
    return {
        "kind": kind,
        "examples": examples,
        "kept": kept,
        "truncated": 0,
        "dropped_too_long": 0,
        "dropped_no_target": 0,
        **counts,
        "tokens": tokens,
        "target_tokens": targets,
        "rows": len(rows),
        "padding_share": 1 - tokens / (len(rows) * seq_len),
        "example": example,
    }


def _pack(kept: list[Example], tok: Any, section: DataSection) -> np.ndarray:
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    packed = pack_examples(
        kept, section.seq_len, pad if pad is not None else 0, one_per_row=not section.packing
    )
    return np.stack([packed["input_ids"], packed["labels"], packed["position_ids"]], axis=1).astype(np.int32)


def _document_rows(
    raw: Any, tok: Any, section: DataSection, src: DataSource, key: str
) -> tuple[np.ndarray, dict[str, Any]]:
    """data.separate_documents: text documents as examples, every token a target (but the first of
    each piece: nothing of its own comes before it)."""
    seq_len = section.seq_len
    ids, _ = tokenize_documents(raw, tok, section, src.text_field, num_proc=1)  # EOS appended as for text
    kept: list[Example] = []
    split = tokens = targets = 0
    for doc in ids["ids"]:
        split += len(doc) > seq_len
        for at in range(0, len(doc), seq_len):
            piece = doc[at : at + seq_len]
            kept.append(Example(piece, [True] * len(piece)))
            tokens += len(piece)
            targets += len(piece) - 1
    if not kept:
        raise UserError(f"{key}: the documents hold no text ({len(raw)} rows); point it at data")
    rows = _pack(kept, tok, section)
    return rows, _stats("text", rows, seq_len, examples=len(ids), kept=len(ids), tokens=tokens,
                        targets=targets, example=None, split=split)  # fmt: skip


def describe(stats: dict[str, Any]) -> str:
    """One line for the banner."""
    if stats["kind"] == "text":
        return (
            f"text documents kept apart: {stats['examples']:,} documents ({stats.get('split', 0):,} longer than "
            f"a sequence, continued in the next) in {stats['rows']:,} sequences; {stats['tokens']:,} tokens, "
            f"{stats['target_tokens']:,} targets, padding {stats['padding_share']:.1%}"
        )
    return (
        f"fine-tuning data ({stats['kind']}): {stats['kept']:,} of {stats['examples']:,} examples in {stats['rows']:,} "
        f"sequences ({stats['truncated']:,} truncated, {stats['dropped_too_long']:,} too long dropped, "
        f"{stats['dropped_no_target']:,} with no target left dropped); target tokens {stats['target_tokens']:,} = "
        f"{stats['target_tokens'] / max(1, stats['tokens']):.1%} of {stats['tokens']:,}, padding "
        f"{stats['padding_share']:.1%}"
    )
