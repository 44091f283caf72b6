"""Fine-tuning data (`data.train.kind: prompt_completion | chat`) -> rows for training: each row of
the raw data becomes an Example (trainer/data/chat.py: ids and targets), examples longer than
seq_len are truncated or dropped (data.truncation), examples left with no target are dropped, and
the rest are packed (trainer/data/pack.py) into rows of [input_ids, labels, position_ids]. What was
kept, truncated and dropped, the share of target tokens and one rendered example are returned for
the banner and the cache's meta.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from trainer.config import DataSection, DataSource
from trainer.data.chat import check_messages, render_chat, render_prompt_completion, template_for
from trainer.data.pack import pack_examples
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
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    packed = pack_examples(kept, seq_len, pad if pad is not None else 0, one_per_row=not section.packing)
    rows = np.stack([packed["input_ids"], packed["labels"], packed["position_ids"]], axis=1).astype(np.int32)
    stats = {
        "kind": src.kind,
        "examples": len(kept) + dropped_long + no_target,
        "kept": len(kept),
        "truncated": truncated,
        "dropped_too_long": dropped_long,
        "dropped_no_target": no_target,
        "tokens": tokens,
        "target_tokens": targets,
        "rows": len(rows),
        "padding_share": 1 - tokens / (len(rows) * seq_len),
        "example": shown,
    }
    return rows, stats


def describe(stats: dict[str, Any]) -> str:
    """One line for the banner."""
    return (
        f"fine-tuning data ({stats['kind']}): {stats['kept']:,} of {stats['examples']:,} examples in {stats['rows']:,} "
        f"sequences ({stats['truncated']:,} truncated, {stats['dropped_too_long']:,} too long dropped, "
        f"{stats['dropped_no_target']:,} with no target left dropped); target tokens {stats['target_tokens']:,} = "
        f"{stats['target_tokens'] / max(1, stats['tokens']):.1%} of {stats['tokens']:,}, padding "
        f"{stats['padding_share']:.1%}"
    )
