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
prompt/completion: the messages of both, the completion's assistant turns trained)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from trainer.common.errors import UserError
from trainer.config import MAP_KEYS, DataSource


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


def paired(src: DataSource, columns: list[str]) -> bool:
    """Unpaired data given as preference pairs: the chosen and rejected columns there, no completion column."""
    return src.completion_field not in columns and {src.chosen_field, src.rejected_field} <= set(columns)


def required_columns(src: DataSource) -> list[tuple[str, str]]:
    """(the setting that names it, the column) for each column a row must have."""
    if src.kind == "text":
        return [("text_field", src.text_field)]
    if src.kind == "prompt":
        return [("prompt_field", src.prompt_field)]
    if src.kind == "prompt_completion":
        return [("prompt_field", src.prompt_field), ("completion_field", src.completion_field)]
    if src.kind == "unpaired":
        return [("prompt_field", src.prompt_field), ("completion_field", src.completion_field),
                ("label_field", src.label_field)]  # fmt: skip
    if src.kind == "preference":  # the prompt may be implicit (whole conversations: preference.py)
        return [("chosen_field", src.chosen_field), ("rejected_field", src.rejected_field)]
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
    if calls is None:
        raise UserError(f"{where}: message {n} (function_call) has no value; give {{name, arguments}}")
    calls = calls if isinstance(calls, list) else [calls]
    if not all(isinstance(c, Mapping) and "name" in c for c in calls):
        raise UserError(
            f"{where}: message {n} (function_call) is not {{name, arguments}} (or a list of them)"
        )
    return [{"type": "function", "function": dict(c)} for c in calls]


def _message(msg: Any, m: Mapping[str, Any], where: Any, n: int) -> Any:
    """One message in the chat kind's own keys. Arrow holds a message without some key as that key set to
    null: null keys are left out (transformers' apply_chat_template drops them too)."""
    if not isinstance(msg, Mapping) or msg.get(m["role"]) is None:
        return msg  # check_conversation names it
    role = msg[m["role"]]
    if not isinstance(role, str):
        raise UserError(
            f"{where}: message {n}: the role ({m['role']}) is {type(role).__name__}, not a string"
        )
    out = {k: v for k, v in msg.items() if k not in (m["role"], m["content"]) and v is not None}
    out["role"] = m["roles"].get(role, role)
    if msg.get(m["content"]) is not None:
        out["content"] = msg[m["content"]]
    return out


def _chat(row: Mapping[str, Any], src: DataSource, where: Any) -> list[Any]:
    m = mapping(src)
    raw = row[messages_column(src)]
    if not isinstance(raw, list):
        return raw  # check_conversation names it
    out = []
    system = row.get(m["system"]) if m["system"] else None
    if system:
        out.append({"role": "system", "content": system})
    for n, msg in enumerate(raw):
        msg = _message(msg, m, where, n)
        if (
            preset(src) == "sharegpt"
            and isinstance(msg, Mapping)
            and raw[n].get(m["role"]) == "function_call"
        ):
            msg = {**msg, "content": "", "tool_calls": _tool_calls(raw[n].get(m["content"]), where, n)}
        out.append(msg)
    return out


def _alpaca(row: Mapping[str, Any], src: DataSource, where: Any) -> list[dict[str, Any]]:
    m = mapping(src)
    for key, required in (("instruction", True), ("output", True), ("input", False), ("system", False)):
        value = row.get(m[key])
        if not isinstance(value, str) and (required or value is not None):
            raise UserError(f"{where}: {m[key]} is {type(value).__name__}; give a string (formatting alpaca)")
    out: list[dict[str, Any]] = []
    if row.get(m["system"]):
        out.append({"role": "system", "content": row[m["system"]]})
    for pair in row.get(m["history"]) or []:
        if not (isinstance(pair, list | tuple) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            raise UserError(f"{where}: {m['history']} must be a list of [question, answer] string pairs")
        out += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    query = "\n".join(x for x in (row[m["instruction"]], row.get(m["input"])) if x)
    out += [{"role": "user", "content": query}, {"role": "assistant", "content": row[m["output"]]}]
    return out


def conversation(row: Mapping[str, Any], src: DataSource, where: Any) -> tuple[Any, Any, int | None]:
    """A row of a chat source (or a conversational prompt/completion one) -> (messages, tools,
    completion_from): the messages in the chat kind's own form, before they are checked."""
    tools = row.get(src.tools_field)
    if src.kind == "prompt":
        return [("prompt_field", src.prompt_field)]
    if src.kind == "prompt_completion":
        prompt, completion = row[src.prompt_field], row[src.completion_field]
        if not (isinstance(prompt, list) and isinstance(completion, list)):
            raise UserError(
                f"{where}: {src.prompt_field} and {src.completion_field} must both be strings or both lists of "
                "messages"
            )
        keys = MAP_KEYS["openai"]
        messages = [_message(x, keys, where, n) for n, x in enumerate(list(prompt) + list(completion))]
        return messages, tools, len(prompt)
    if preset(src) == "alpaca":
        return _alpaca(row, src, where), tools, None
    return _chat(row, src, where), tools, None


def is_conversational(row: Mapping[str, Any], src: DataSource) -> bool:
    """A prompt_completion row of messages (TRL's conversational form) rather than of strings."""
    return isinstance(row[src.prompt_field], list)
