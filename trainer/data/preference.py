"""Preference data (`data.train.kind: preference`): a prompt with a chosen and a rejected response ->
one pair of rows, chosen then rejected, for the preference objectives (trainer/objectives/).

A row of the data holds `prompt` + `chosen` + `rejected` (the column names: prompt_field,
chosen_field, rejected_field) as plain text (three strings) or as messages (TRL's conversational
form: the prompt a list of messages, each response a list of assistant messages), or, with no prompt
column, `chosen` and `rejected` as whole conversations whose shared beginning is the prompt (TRL's
implicit prompt). Each response is rendered with the prompt exactly as prompt_completion data is
(trainer/data/chat.py: the template), so a pair's two rows start with the same prompt tokens; the
targets are every token after the prompt, as TRL's DPO and KTO trainers mask a completion (the response, its end
of turn and what the template writes after it: ChatML's newline after <|im_end|>, `completion_targets`). The same truncation rules apply to the pair: one
response longer than seq_len truncates both (right) or drops the pair (drop). Pairs are never
packed: each response is a row of its own, and a pair's rows always travel together (stream.py).

Cached as (pairs, 2, 3, seq_len) int32: [chosen, rejected] x [input_ids, labels, position_ids].
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from trainer.common.errors import UserError
from trainer.config import DataSection, DataSource
from trainer.data.chat import Example
from trainer.data.pack import pack_examples
from trainer.data.sources import locator


def _empty(response: Any) -> bool:
    if isinstance(response, str):
        return not response.strip()
    if isinstance(response, list):
        return not response or all(
            isinstance(m, Mapping) and not m.get("tool_calls") and not _text(m.get("content")).strip()
            for m in response
        )
    return False


def _text(content: Any) -> str:
    if isinstance(content, list):  # content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return content if isinstance(content, str) else ""


def split_pair(row: Mapping[str, Any], src: DataSource, where: Any) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) of a row, checked: both responses there and not empty, the prompt
    shared (given once, or the common beginning of two whole conversations)."""
    chosen, rejected = row.get(src.chosen_field), row.get(src.rejected_field)
    for field, value in ((src.chosen_field, chosen), (src.rejected_field, rejected)):
        if value is None or not isinstance(value, str | list):
            raise UserError(
                f"{where}: {field} is {type(value).__name__}; give a string or a list of messages"
            )
    prompt = row.get(src.prompt_field)
    if prompt is None:
        prompt, chosen, rejected = _implicit_prompt(chosen, rejected, src, where)
    elif isinstance(prompt, list):
        chosen = _without_prompt(prompt, chosen, src.chosen_field, src.prompt_field, where)
        rejected = _without_prompt(prompt, rejected, src.rejected_field, src.prompt_field, where)
    if isinstance(prompt, str) != isinstance(chosen, str) or isinstance(chosen, str) != isinstance(
        rejected, str
    ):
        raise UserError(
            f"{where}: {src.prompt_field}, {src.chosen_field} and {src.rejected_field} must be all strings or all "
            "lists of messages"
        )
    for field, value in ((src.chosen_field, chosen), (src.rejected_field, rejected)):
        if _empty(value):
            raise UserError(
                f"{where}: {field} is empty: a pair needs two responses to compare; fix the row or remove it"
            )
    return prompt, chosen, rejected


def _implicit_prompt(chosen: Any, rejected: Any, src: DataSource, where: Any) -> tuple[Any, Any, Any]:
    """No prompt column: the conversations' shared beginning, up to the first assistant turn that
    differs, is the prompt."""
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        raise UserError(
            f"{where}: no {src.prompt_field}; give it, or give {src.chosen_field} and {src.rejected_field} as whole "
            "conversations (lists of messages) that begin with the same prompt"
        )
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    while n > 0 and isinstance(chosen[n - 1], Mapping) and chosen[n - 1].get("role") == "assistant":
        n -= 1  # a shared assistant turn at the end belongs to the responses
    if n == 0:
        raise UserError(
            f"{where}: {src.chosen_field} and {src.rejected_field} do not begin with the same prompt (their first "
            "messages differ): the pair's prompts do not match; give the same prompt messages first in both, or a "
            f"{src.prompt_field} column"
        )
    for field, side in ((src.chosen_field, chosen), (src.rejected_field, rejected)):
        first = side[n] if n < len(side) else None
        role = first.get("role") if isinstance(first, Mapping) else None
        if role != "assistant":
            what = "ends" if first is None else f"goes on with a {role or 'non-message'} turn"
            raise UserError(
                f"{where}: {src.chosen_field} and {src.rejected_field} share their first {n} message(s), then "
                f"{field} {what} (message {n}) where a response must begin with an assistant turn: the two sides "
                f"answer different prompts; give both the same prompt messages, or a {src.prompt_field} column"
            )
    return chosen[:n], chosen[n:], rejected[n:]


def _without_prompt(prompt: list[Any], response: Any, field: str, prompt_field: str, where: Any) -> Any:
    """A response given as the whole conversation (prompt repeated): the part after the prompt, where
    it begins with the same messages; a response that begins with other ones is refused."""
    if not isinstance(response, list) or not response:
        return response
    first = response[0]
    if isinstance(first, Mapping) and first.get("role") == "assistant":
        return response
    if response[: len(prompt)] == prompt:
        return response[len(prompt) :]
    raise UserError(
        f"{where}: {field} begins with a {first.get('role') if isinstance(first, Mapping) else 'non-message'} "
        f"turn that is not {prompt_field}'s: the pair's prompts do not match; give only the response's assistant "
        f"messages, or the same prompt messages first"
    )


def completion_targets(ex: Example) -> Example:
    """A response's targets as TRL's preference trainers mask them: every token after the prompt (the response, its
    end of turn and what the template writes after it, such as ChatML's newline after <|im_end|>)."""
    first = ex.targets.index(True) if True in ex.targets else len(ex.ids)
    return Example(ex.ids, [False] * first + [True] * (len(ex.ids) - first), ex.text)


def one_response(render: Any, row: Mapping[str, Any], n: int, prompt: Any, response: Any, tools: str,
                 what: str) -> Example:  # fmt: skip
    """A response rendered after its prompt (`render`: as prompt_completion data is), one assistant turn, its
    targets TRL's completion mask (`completion_targets`); `what` names it in the error."""
    rendered = render({"prompt": prompt, "completion": response, tools: row.get(tools)}, n)
    if len(rendered) != 1:
        raise UserError(f"{what} renders as {len(rendered)} trained turns; a response is one assistant turn (with its "
                        "tool calls)")  # fmt: skip
    return completion_targets(rendered[0])


def two_row_blocks(examples: list[Example], seq_len: int, tok: Any) -> np.ndarray:
    """Examples two by two (a pair's responses; an unpaired row and its mismatched pair) as (n, 2, 3, seq_len)
    int32 rows of [input_ids, labels, position_ids], one example a row, padded with the pad token (else EOS)."""
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    packed = pack_examples(examples, seq_len, pad if pad is not None else 0, one_per_row=True)
    rows = np.stack([packed["input_ids"], packed["labels"], packed["position_ids"]], axis=1).astype(np.int32)
    return rows.reshape(len(examples) // 2, 2, 3, seq_len)


class PairCounts:
    """What build_pairs counts for the banner and the cache's meta.json, and each kept pair's margin (the
    margin_field's number where the row has one, else NaN: train.objective reward reads them, margins.npy)."""

    def __init__(self) -> None:
        self.pairs = self.kept = self.truncated = self.dropped_long = self.no_target = 0
        self.tokens = self.chosen_targets = self.rejected_targets = 0
        self.margins: list[float] = []
        self.margin_problem: str | None = None  # the first row whose margin is not a finite number
        self.identical: list[
            str
        ] = []  # the first rows whose two responses render alike (reward refuses them)

    def margin(self, row: Mapping[str, Any], field: str, where: str) -> float:
        """The row's margin: NaN where it has none; a value that is not a finite number is recorded."""
        import math

        if field not in row:
            return math.nan
        value = row[field]
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        if not ok and self.margin_problem is None:
            self.margin_problem = f"{where}: {field} is {value!r}, not a finite number"
        return float(value) if ok else math.nan


def build_pairs(
    raw: Any, tok: Any, section: DataSection, src: DataSource, key: str, render: Any
) -> tuple[np.ndarray, dict[str, Any]]:
    """(rows (pairs, 2, 3, seq_len) int32, statistics). `render(row, n) -> [Example]`: one response
    rendered after its prompt as prompt_completion data is (examples.py)."""
    where = locator(src, key)
    seq_len, c = section.seq_len, PairCounts()
    kept: list[Example] = []
    shown = None
    for n, row in enumerate(raw):
        c.pairs += 1
        prompt, chosen, rejected = split_pair(row, src, where(n))
        pair = []
        for field, response in ((src.chosen_field, chosen), (src.rejected_field, rejected)):
            pair.append(
                one_response(render, row, n, prompt, response, src.tools_field, f"{where(n)}: {field}")
            )
        if max(len(e.ids) for e in pair) > seq_len:
            if section.truncation == "drop":
                c.dropped_long += 1
                continue
            pair = [e.truncated(seq_len) if len(e.ids) > seq_len else e for e in pair]
            c.truncated += 1
        if not all(any(e.targets[1:]) for e in pair):
            c.no_target += 1
            continue
        if pair[0].ids == pair[1].ids and len(c.identical) < 3:
            c.identical.append(str(where(n)))
        c.margins.append(c.margin(row, src.margin_field, where(n)))
        if shown is None:
            shown = [e.show(tok) for e in pair]
        kept += pair
        c.kept += 1
        c.tokens += sum(len(e.ids) for e in pair)
        c.chosen_targets += sum(pair[0].targets[1:])
        c.rejected_targets += sum(pair[1].targets[1:])
    if not kept:
        raise UserError(
            f"{key}: no pair with a response to train on ({c.truncated} truncated, {c.dropped_long} longer than "
            f"data.seq_len {seq_len} dropped, {c.no_target} with no target left); raise data.seq_len"
        )
    rows = two_row_blocks(kept, seq_len, tok)
    stats = {
        "kind": "preference",
        "examples": c.pairs,
        "kept": c.kept,
        "truncated": c.truncated,
        "dropped_too_long": c.dropped_long,
        "dropped_no_target": c.no_target,
        "tokens": c.tokens,
        "target_tokens": c.chosen_targets + c.rejected_targets,
        "chosen_targets": c.chosen_targets,
        "rejected_targets": c.rejected_targets,
        "rows": 2 * c.kept,
        "padding_share": 1 - c.tokens / (2 * c.kept * seq_len),
        "example": None if shown is None else f"chosen: {shown[0]} | rejected: {shown[1]}",
        "margins": np.asarray(c.margins, dtype=np.float64),  # (popped into margins.npy by the cache)
        "margin_field": src.margin_field,
        "margin_rows": int(np.isfinite(np.asarray(c.margins)).sum()),
        "margin_problem": c.margin_problem,
        "identical": c.identical,
    }
    return rows, stats


def describe_pairs(stats: dict[str, Any]) -> str:
    """The banner's line for preference data."""
    return (
        f"preference data: {stats['kept']:,} of {stats['examples']:,} pairs ({stats['truncated']:,} truncated, "
        f"{stats['dropped_too_long']:,} too long dropped, {stats['dropped_no_target']:,} with no target left "
        f"dropped), each response a row of its own (not packed); target tokens {stats['chosen_targets']:,} chosen, "
        f"{stats['rejected_targets']:,} rejected, of {stats['tokens']:,}; padding to seq_len "
        f"{stats['padding_share']:.1%}"
    )
