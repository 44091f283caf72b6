"""The data formats people have, mapped to conversations by a declared preset or map, never guessed:

- the chat kind's own (`formatting: null` or `openai`): a column of OpenAI-style messages
  (`data.train.messages_field`, default `messages`) and, where the data has one, a column of tool
  schemas (`tools_field`, default `tools`);
- `sharegpt`: `conversations` of `{from, value}` with roles human/gpt/system (and LLaMA-Factory's
  function_call, observation), a `system` column and a `tools` column (JSON); a function_call's
  value (JSON `{name, arguments}`, or a list of them) becomes the assistant's `tool_calls`;
- `alpaca`: `instruction`, `input` (joined to the instruction with a newline, as LLaMA-Factory
  does), `output`, and where present `system` and `history` (`[[question, answer], ...]`);
- `format_map` renames the preset's keys and columns (`role`, `content`, `roles`, `system`;
  alpaca's `instruction`, `input`, `output`, `history`).

Kind prompt_completion reads strings (plain text) or lists of messages (TRL's conversational
prompt/completion: the messages of both, the completion's assistant turns trained).

`locator` names a row by its file and line (JSON lines), file and item (a JSON array) or file and row
(parquet), for the errors that name an example."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from trainer.config import DataSource
from trainer.errors import UserError

PRESETS = ("openai", "sharegpt", "alpaca")
SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
    "function_call": "assistant", "observation": "tool", "tool": "tool",
}  # fmt: skip
# format_map keys each preset takes, and their defaults
MAP_KEYS: dict[str, dict[str, Any]] = {
    "openai": {"role": "role", "content": "content", "roles": {}, "system": None},
    "sharegpt": {"role": "from", "content": "value", "roles": SHAREGPT_ROLES, "system": "system"},
    "alpaca": {"instruction": "instruction", "input": "input", "output": "output", "system": "system",
               "history": "history"},
}  # fmt: skip


def preset(src: DataSource) -> str | None:
    """The preset a chat source is read with (None: prompt_completion or text)."""
    if src.kind != "chat":
        return None
    return src.formatting or "openai"


def mapping(src: DataSource) -> dict[str, Any]:
    """The preset's keys with format_map's renames."""
    keys = dict(MAP_KEYS[preset(src) or "openai"])
    for k, v in (src.format_map or {}).items():
        keys[k] = {**keys[k], **v} if k == "roles" and preset(src) == "sharegpt" else v
    return keys


def messages_column(src: DataSource) -> str:
    if preset(src) == "sharegpt" and "messages_field" not in src.model_fields_set:
        return "conversations"
    return src.messages_field


def required_columns(src: DataSource) -> list[tuple[str, str]]:
    """(the setting that names it, the column) for each column a row must have."""
    if src.kind == "text":
        return [("text_field", src.text_field)]
    if src.kind == "prompt_completion":
        return [("prompt_field", src.prompt_field), ("completion_field", src.completion_field)]
    if preset(src) == "alpaca":
        m = mapping(src)
        return [("format_map.instruction", m["instruction"]), ("format_map.output", m["output"])]
    return [("messages_field", messages_column(src))]


def _tool_calls(value: Any, where: str, n: int) -> list[dict[str, Any]]:
    try:
        calls = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as e:
        raise UserError(
            f"{where}: message {n} (function_call) is not JSON ({e}); give {{name, arguments}}"
        ) from None
    calls = calls if isinstance(calls, list) else [calls]
    if not all(isinstance(c, Mapping) and "name" in c for c in calls):
        raise UserError(
            f"{where}: message {n} (function_call) is not {{name, arguments}} (or a list of them)"
        )
    return [{"type": "function", "function": dict(c)} for c in calls]


def _chat(row: Mapping[str, Any], src: DataSource, where: str) -> list[Any]:
    m = mapping(src)
    raw = row[messages_column(src)]
    if not isinstance(raw, list):
        return raw  # check_conversation names it
    out = []
    system = row.get(m["system"]) if m["system"] else None
    if system:
        out.append({"role": "system", "content": system})
    roles = m["roles"]
    for n, msg in enumerate(raw):
        if not isinstance(msg, Mapping) or msg.get(m["role"]) is None:
            out.append(msg)  # check_conversation names it
            continue
        role = msg[m["role"]]
        # Arrow holds a message without some key as that key set to null; transformers drops null keys too
        msg = {k: v for k, v in msg.items() if k not in (m["role"], m["content"]) and v is not None} | {
            "role": roles.get(role, role)} | ({"content": msg[m["content"]]} if msg.get(m["content"]) is not None else {})  # fmt: skip
        if role == "function_call" and preset(src) == "sharegpt":
            msg = {**msg, "content": "", "tool_calls": _tool_calls(msg["content"], where, n)}
        out.append(msg)
    return out


def _alpaca(row: Mapping[str, Any], src: DataSource, where: str) -> list[dict[str, Any]]:
    m = mapping(src)
    out: list[dict[str, Any]] = []
    if row.get(m["system"]):
        out.append({"role": "system", "content": row[m["system"]]})
    for pair in row.get(m["history"]) or []:
        if not (isinstance(pair, list | tuple) and len(pair) == 2):
            raise UserError(f"{where}: {m['history']} must be a list of [question, answer] pairs")
        out += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    query = "\n".join(x for x in (row[m["instruction"]], row.get(m["input"])) if x)
    out += [{"role": "user", "content": query}, {"role": "assistant", "content": row[m["output"]]}]
    return out


def conversation(row: Mapping[str, Any], src: DataSource, where: str) -> tuple[Any, Any, int | None]:
    """A row of a chat source (or a conversational prompt/completion one) -> (messages, tools,
    completion_from): the messages in the chat kind's own form, before they are checked."""
    tools = row.get(src.tools_field)
    if src.kind == "prompt_completion":
        prompt, completion = row[src.prompt_field], row[src.completion_field]
        if not (isinstance(prompt, list) and isinstance(completion, list)):
            raise UserError(
                f"{where}: {src.prompt_field} and {src.completion_field} must both be strings or both lists of "
                "messages"
            )
        return list(prompt) + list(completion), tools, len(prompt)
    if preset(src) == "alpaca":
        return _alpaca(row, src, where), tools, None
    return _chat(row, src, where), tools, None


def is_conversational(row: Mapping[str, Any], src: DataSource) -> bool:
    """A prompt_completion row of messages (TRL's conversational form) rather than of strings."""
    return isinstance(row[src.prompt_field], list)


def locator(src: DataSource, key: str) -> Callable[[int], str]:
    """Row number -> where it is: 'FILE:LINE' for JSON lines, 'FILE item K' for a JSON array, 'FILE row
    K' for parquet; the key and the row for a hub dataset. The files are read on the first call only."""
    found: list[tuple[str, list[str]]] = []

    def where(n: int) -> str:
        if src.files is None:
            return f"{key} row {n}"
        if not found:
            found.extend(_rows_of_files(src, key))
        for _name, places in found:
            if n < len(places):
                return places[n]
            n -= len(places)
        return f"{key} row {n}"

    return where


def _rows_of_files(src: DataSource, key: str) -> list[tuple[str, list[str]]]:
    from trainer.data.sources import open_text, resolve_files

    files, fmt = resolve_files(src, key)
    out = []
    for f in files:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            out.append((f, [f"{f} row {k}" for k in range(pq.ParquetFile(f).metadata.num_rows)]))
            continue
        with open_text(f) as fh:
            text = fh.read()
        if text.lstrip().startswith("["):
            try:
                n = len(json.loads(text))
            except json.JSONDecodeError:
                n = 0
            out.append((f, [f"{f} item {k}" for k in range(n)]))
        else:
            out.append((f, [f"{f}:{i}" for i, line in enumerate(text.splitlines(), 1) if line.strip()]))
    return out
