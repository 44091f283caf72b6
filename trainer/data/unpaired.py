"""Unpaired preference data (`data.train.kind: unpaired`, train.objective kto): a prompt, one response and its
label (true: desirable, false: undesirable), TRL's unpaired preference format, as plain text (strings) or as
messages (the prompt a list of messages, the completion a list of assistant messages).

Each row is rendered as prompt_completion data is (every token after the prompt a target, as TRL's: preference.py
`completion_targets`), and beside it the row's **mismatched pair** for KTO's KL reference point: its own prompt
followed by the previous kept row's whole completion (the first row takes the last row's; a previous row of the
same prompt is passed over for the nearest before it of another), token for token (the prompt's tokens up to the
first target, the other row's from its first target on, before that row's own truncation), as TRL's KTOTrainer
rotates completions by one within each batch of `per_device_train_batch_size` of the dataset's order. Here the
rotation is over the whole data's order, once, so the pairs are data (their reference log-probs computed once,
with the rows'); the KL is then the mean over a step's pairs (trainer/objectives/kto.py). A mismatched pair longer
than seq_len is cut at it (as TRL's collator cuts it); a row longer than seq_len follows data.truncation.

Cached as (rows, 2, 3, seq_len) int32 as preference pairs are: [the row, its mismatched pair] x [input_ids,
labels, position_ids]; the labels (1.0 desirable, 0.0 undesirable) where the pairs' margins are (margins.npy).

Preference pairs (prompt, chosen, rejected: no completion column) given as kind unpaired are taken apart as TRL's
KTOTrainer takes them apart (`unpair_preference_dataset`), each pair's chosen response a desirable row and its
rejected one an undesirable row, but pair by pair (TRL: every chosen response of a block of 1,000 pairs, then
every rejected one), so that a held-out tail or an eval batch holds both classes; a row's mismatched pair takes the
previous pair's response of its own side, as TRL's rotation within each block does (chosen with chosen, rejected
with rejected).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from trainer.common.errors import UserError
from trainer.config import DataSection, DataSource
from trainer.data.chat import Example
from trainer.data.formats import paired
from trainer.data.preference import _empty, one_response, two_row_blocks
from trainer.data.sources import locator


def label_of(row: Mapping[str, Any], src: DataSource, where: Any) -> bool:
    """A row's label: true or false (1 and 0, 1.0 and 0.0 read as them); anything else, or none, is refused."""
    value = row.get(src.label_field)
    if isinstance(value, bool) or (isinstance(value, int | float) and value in (0, 1)):
        return bool(value)
    what = "has no label" if value is None else f"label is {value!r}"
    raise UserError(f"{where}: {src.label_field}: the row {what}; give true (a desirable response) or false (an "
                    "undesirable one) in every row, or remove the row")  # fmt: skip


def split_row(row: Mapping[str, Any], src: DataSource, where: Any) -> tuple[Any, Any]:
    """(prompt, completion) of a row, checked: both strings or both lists of messages, the completion not empty."""
    prompt, completion = row.get(src.prompt_field), row.get(src.completion_field)
    for field, value in ((src.prompt_field, prompt), (src.completion_field, completion)):
        if not isinstance(value, str | list):
            raise UserError(
                f"{where}: {field} is {type(value).__name__}; give a string or a list of messages"
            )
    if isinstance(prompt, str) != isinstance(completion, str):
        raise UserError(f"{where}: {src.prompt_field} and {src.completion_field} must be both strings or both lists "
                        "of messages")  # fmt: skip
    if _empty(completion):
        raise UserError(f"{where}: {src.completion_field} is empty: a row needs a response to label; fix the row or "
                        "remove it")  # fmt: skip
    return prompt, completion


def _responses(raw: Any, src: DataSource, where: Any) -> Any:
    """(row number, row, prompt, completion, label) of each response: an unpaired row's; preference pairs taken
    apart pair by pair, the chosen response (true) then the rejected one (false), so that a held-out tail or an eval
    batch holds both classes (TRL's unpair_preference_dataset puts every chosen response of a block of 1,000 pairs
    before every rejected one); `mismatched` pairs each row with the previous pair's response of its side."""
    if not paired(src, raw.column_names):
        for n, row in enumerate(raw):
            label = label_of(row, src, where(n))
            yield (n, row, *split_row(row, src, where(n)), label)
        return
    from trainer.data.preference import split_pair

    for n, row in enumerate(raw):
        prompt, chosen, rejected = split_pair(row, src, where(n))
        yield n, row, prompt, chosen, True
        yield n, row, prompt, rejected, False


def others(prompts: list[Any]) -> list[int]:
    """For each row, the row whose completion makes its mismatched pair: the previous (the first row: the last),
    or where that answers the same prompt the nearest before it that does not (none: the previous). One pass from a
    place where the prompt changes, so a long run of one prompt costs no more than other rows."""
    n = len(prompts)
    start = next((k for k in range(n) if prompts[k - 1] != prompts[k]), None)
    if start is None:  # (one prompt throughout: no other to take)
        return [(i - 1) % n for i in range(n)]
    out = [0] * n
    for t in range(n):
        i = (start + t) % n
        prev = (i - 1) % n
        out[i] = prev if prompts[prev] != prompts[i] else out[prev]
    return out


def mismatched(rows: list[Example], seq_len: int, sides: list[Any] | None = None) -> list[Example]:
    """Each row's prompt followed by another row's whole completion (`others`), cut at seq_len as TRL's collator
    cuts the pair; `rows` as rendered, before their own truncation. With `sides` (pairs taken apart: each row's
    label) a row takes the completion of the previous row of its side, as TRL's rotation within its block of chosen
    responses and within its block of rejected ones does."""
    starts = [ex.targets.index(True) for ex in rows]
    prompts = [tuple(ex.ids[:p]) for ex, p in zip(rows, starts, strict=True)]
    keys = sides if sides is not None else [None] * len(rows)
    other_of = list(range(len(rows)))
    for side in set(keys):
        group = [i for i, k in enumerate(keys) if k == side]
        for i, j in zip(group, others([prompts[i] for i in group]), strict=True):
            other_of[i] = group[j]
    out = []
    for i, j in enumerate(other_of):
        p, q, other = starts[i], starts[j], rows[j]
        out.append(
            Example(rows[i].ids[:p] + other.ids[q:], [False] * p + other.targets[q:]).truncated(seq_len)
        )
    return out


def build_unpaired(
    raw: Any, tok: Any, section: DataSection, src: DataSource, key: str, render: Any
) -> tuple[np.ndarray, dict[str, Any]]:
    """(rows (n, 2, 3, seq_len) int32, statistics). `render(row, n) -> [Example]`: the completion rendered after
    its prompt as prompt_completion data is (examples.py)."""
    where = locator(src, key)
    seq_len = section.seq_len
    kept: list[Example] = []
    whole: list[Example] = []  # (each kept row before its truncation: its completion makes another's pair)
    labels: list[float] = []
    n_rows = truncated = dropped_long = no_target = 0
    for n, row, prompt, completion, label in _responses(raw, src, where):
        n_rows += 1
        ex = full = one_response(
            render, row, n, prompt, completion, src.tools_field, f"{where(n)}: a response"
        )
        if len(ex.ids) > seq_len:
            if section.truncation == "drop":
                dropped_long += 1
                continue
            ex, truncated = ex.truncated(seq_len), truncated + 1
        if not any(ex.targets[1:]):
            no_target += 1
            continue
        kept.append(ex)
        whole.append(full)
        labels.append(1.0 if label else 0.0)
    if not kept:
        raise UserError(f"{key}: no row with a response to train on ({truncated} truncated, {dropped_long} longer than "
                        f"data.seq_len {seq_len} dropped, {no_target} with no target left); raise data.seq_len")  # fmt: skip
    pairs = paired(src, raw.column_names)
    sides = labels if pairs else None  # (pairs: each side's pairs from its own side)
    both = [e for pair in zip(kept, mismatched(whole, seq_len, sides), strict=True) for e in pair]
    rows = two_row_blocks(both, seq_len, tok)
    tokens = sum(len(e.ids) for e in kept)
    desirable = int(sum(labels))
    stats = {
        "kind": "unpaired",
        "examples": n_rows,  # (responses: a pair's are two)
        "kept": len(kept),
        "truncated": truncated,
        "dropped_too_long": dropped_long,
        "dropped_no_target": no_target,
        "tokens": tokens,
        "target_tokens": sum(e.n_targets for e in kept),
        "desirable": desirable,
        "undesirable": len(kept) - desirable,
        "rows": 2 * len(kept),
        "padding_share": 1 - sum(len(e.ids) for e in both) / (2 * len(kept) * seq_len),
        "example": f"{'desirable' if labels[0] else 'undesirable'}: {kept[0].show(tok)}",
        # pairs taken apart, none of their rows dropped: an eval_fraction holds out whole pairs (cache.py)
        "whole_pairs": pairs and not dropped_long and not no_target,
        "margins": np.asarray(labels, dtype=np.float64),  # (the labels: popped into margins.npy by the cache)
    }
    return rows, stats


def describe_unpaired(stats: dict[str, Any]) -> str:
    """The banner's line for unpaired data."""
    return (
        f"unpaired preference data: {stats['kept']:,} of {stats['examples']:,} rows ({stats['truncated']:,} "
        f"truncated, {stats['dropped_too_long']:,} too long dropped, {stats['dropped_no_target']:,} with no target "
        f"left dropped), {stats.get('desirable', 0):,} desirable, {stats.get('undesirable', 0):,} undesirable; each "
        f"row beside its mismatched pair (its prompt, the previous row's completion: KTO's KL), not packed; "
        f"{stats['target_tokens']:,} target tokens of {stats['tokens']:,}; padding to seq_len "
        f"{stats['padding_share']:.1%}"
    )
