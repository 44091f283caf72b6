"""Prompt data (`data.train.kind: prompt`, train.objective grpo): each row's prompt tokenized as generation
starts from it, and every other column of the row kept for the reward functions.

A prompt is a string (tokenized after the tokenizer's own leading special tokens, as prompt/completion data
is) or a list of chat messages, rendered by the chat template with its generation prompt (a template without
one is refused: generation would start inside the user's turn). The cache (trainer/data/cache.py) holds
`train.npy`, the prompts as rows of token ids padded with IGNORE to the longest (at most data.seq_len; a
longer one is dropped and counted), and `columns.json`, each row's other columns (JSON, each value read back as
the data gave it: datetimes, dates, times, durations, bytes and decimals tagged, numpy's numbers and arrays as
Python's; `_plain`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from trainer.common.errors import UserError
from trainer.config import DataSection
from trainer.data.pack import IGNORE
from trainer.data.sources import locator
from trainer.data.tokenizer import special_edges

COLUMNS = "columns.json"
PROMPT = (
    "__prompt__"  # the row's prompt as the data gives it (the reward functions' `prompts`), in its columns
)


def prompt_ids(row: Any, n: int, section: DataSection, tok: Any, where: Any, prof: list[Any]) -> list[int]:
    """A row's prompt as generation starts from it."""
    src = section.train
    value = row[src.prompt_field]
    if isinstance(value, str):
        return special_edges(tok)[0] + tok(value, add_special_tokens=False)["input_ids"]
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m for m in value):
        if prof[0] is None:
            from trainer.data.examples import chat_profile

            prof[0] = chat_profile(section, tok)
            with_prompt = prof[0].render(tok, [{"role": "user", "content": "probe"}], prompt=True)
            without = prof[0].render(tok, [{"role": "user", "content": "probe"}], prompt=False)
            if with_prompt == without:
                raise UserError(
                    "data.train: the chat template has no generation prompt (rendered with "
                    "add_generation_prompt it is the same as without), so generation would start inside the user's "
                    "turn; give a template that opens the assistant's turn (data.chat_template)"
                )
        text = prof[0].render(tok, [dict(m) for m in value], prompt=True)
        return tok(text, add_special_tokens=False)["input_ids"]
    raise UserError(
        f"{where(n)}: {src.prompt_field} must be a string or a list of chat messages (each with a role), "
        f"found {type(value).__name__}"
    )


TYPED = "\u0000type"  # a JSON object standing for a value JSON has no type for: {TYPED: name, "value": text}


def _plain(value: Any) -> Any:
    """A column's value as columns.json holds it, its type kept (read_columns gives it back as it was): datetimes,
    dates, times, durations, bytes and decimals tagged (JSON has none of them); numpy's numbers and arrays as Python's
    (datasets' own); lists, tuples (as lists) and dicts through; anything else as its str (said in docs/rl.md)."""
    import base64
    import datetime
    import decimal

    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic | np.ndarray):
        return _plain(value.tolist() if isinstance(value, np.ndarray) else value.item())
    for kind, text in ((datetime.datetime, datetime.datetime.isoformat), (datetime.date, datetime.date.isoformat),
                       (datetime.time, datetime.time.isoformat)):  # fmt: skip
        if isinstance(value, kind):
            return {TYPED: kind.__name__, "value": text(value)}
    if isinstance(value, datetime.timedelta):
        return {TYPED: "timedelta", "value": repr(value.total_seconds())}
    if isinstance(value, bytes | bytearray):
        return {TYPED: "bytes", "value": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, decimal.Decimal):
        return {TYPED: "Decimal", "value": str(value)}
    return str(value)


def _typed(obj: dict[str, Any]) -> Any:
    """json's object hook: a tagged value back to its type (_plain's inverse)."""
    if TYPED not in obj:
        return obj
    import base64
    import datetime
    import decimal

    kind, text = obj[TYPED], obj["value"]
    if kind == "timedelta":
        return datetime.timedelta(seconds=float(text))
    if kind == "bytes":
        return base64.b64decode(text)
    if kind == "Decimal":
        return decimal.Decimal(text)
    return getattr(datetime, kind).fromisoformat(text)


def build_prompts(
    raw: Any, tok: Any, section: DataSection
) -> tuple[np.ndarray, list[dict[str, Any]], dict[str, Any]]:
    """(prompts (n, width) int32 padded with IGNORE, the rows' other columns, statistics)."""
    src = section.train
    where = locator(src, "data.train")
    prof: list[Any] = [None]
    ids, columns, too_long = [], [], 0
    for n, row in enumerate(raw):
        p = prompt_ids(row, n, section, tok, where, prof)
        if len(p) >= section.seq_len:
            too_long += 1
            continue
        ids.append(p)
        columns.append({**{k: _plain(v) for k, v in row.items() if k != src.prompt_field},
                        PROMPT: _plain(row[src.prompt_field])})  # fmt: skip
    if not ids:
        raise UserError(
            f"data.train: none of the {len(raw)} prompts is shorter than data.seq_len {section.seq_len}; raise it"
        )
    width = max(len(p) for p in ids)
    out = np.full((len(ids), width), IGNORE, dtype=np.int32)
    for i, p in enumerate(ids):
        out[i, : len(p)] = p
    lengths = [len(p) for p in ids]
    stats = {"kind": "prompt", "examples": len(raw), "kept": len(ids), "dropped_too_long": too_long,
             "tokens": int(sum(lengths)), "longest_prompt": width, "chat": prof[0] is not None}  # fmt: skip
    return out, columns, stats


def write_columns(directory: Path, columns: list[dict[str, Any]]) -> None:
    (directory / COLUMNS).write_text(json.dumps(columns))


def read_columns(directory: Path) -> list[dict[str, Any]] | None:
    path = Path(directory) / COLUMNS
    return json.loads(path.read_text(), object_hook=_typed) if path.exists() else None


def lengths(prompts: np.ndarray) -> np.ndarray:
    """Each prompt's tokens (the rows are padded with IGNORE)."""
    return (np.asarray(prompts) != IGNORE).sum(axis=1)
