"""`bin/train EXP.yaml --preview-data [N]`: the data as it will train, before any GPU hour is spent.

The data cache is built (or read) as training would, then shown: what was kept, truncated and
dropped per the banner's counts, the chat template's strategy and why, whether this model family may
pack, the padding share, and the first N examples in the order the first epoch takes them (rows
split into their packed examples), each as text with its targets in [[ ]] and as tokens, `|`
between them, the targets' runs in [[ ]]. No launcher, no process group, no model weights."""

from __future__ import annotations

from typing import Any

import numpy as np

from trainer.config import Experiment
from trainer.data.chat import Example
from trainer.data.image_rows import image_tokens
from trainer.data.pack import IGNORE


def examples_of(row: np.ndarray) -> list[Example]:
    """A cached row [input_ids, labels, position_ids] -> its examples (positions restart at each), the
    padding after the last target left out."""
    ids, labels, pos = (np.asarray(x).tolist() for x in row)
    starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
    out = []
    for a, b in zip(starts, starts[1:], strict=False):
        targets = [lab != IGNORE for lab in labels[a:b]]
        if any(targets):
            out.append(Example(ids[a:b], targets))
    return out


def token_view(ex: Example, tok: Any) -> str:
    """The example's tokens, `|` between them, each run of targets in [[ ]]."""
    out, inside = [], False
    for i, t in zip(ex.ids, ex.targets, strict=True):
        piece = tok.decode([i]).replace("\n", "\\n")
        if t and not inside:
            out.append("[[")
        elif inside and not t:
            out.append("]]")
        inside = t
        out.append(piece + "|")
    return "|" + "".join(out) + ("]]" if inside else "")


def preview(exp: Experiment, data: Any, n: int, world_size: int, packing: str | None) -> str:
    """The report --preview-data prints."""
    from trainer.data.examples import describe, describe_template
    from trainer.data.stream import RankSampler, padding_shares

    d = exp.data
    if data.columns is not None:  # prompts (train.objective grpo)
        return _prompts(data, exp, n)
    unpaired = (data.finetune or {}).get("kind") == "unpaired"  # (each row beside its mismatched pair)
    what = (
        f"{'rows' if unpaired else 'pairs'} ({2 * len(data.train):,} sequences)"
        if data.pairs
        else "sequences"
    )
    lines = [f"data: {len(data.train):,} training {what} of {d.seq_len} tokens in {data.cache_path}"]
    if data.mixture:
        lines.append("mixture: " + "; ".join(f"{m['source']} (weight {m['weight']:g}, {m['sequences']:,} sequences)"
                                              for m in data.mixture))  # fmt: skip
    if not data.supervised:
        lines.append("text: documents packed end to end, every token a target")
        return "\n".join(lines)
    lines.append(describe(data.finetune))
    if describe_template(data.finetune):
        lines.append(describe_template(data.finetune))
    if data.pairs:
        return "\n".join(lines + _pairs(data, exp, n))
    lines.append(f"packing: {packing}" if d.packing else "packing: off, one example per sequence")
    mix = data.mixture
    sampler = RankSampler(
        len(data.train), 0, world_size, exp.train.micro_batch_size, exp.seed, d.shuffle,
        mixture=([m["sequences"] for m in mix], [m["weight"] for m in mix]) if mix else None,
        lengths=data.lengths if d.group_by_length else None, accum=exp.train.grad_accum,
    )  # fmt: skip
    order = sampler.order(0)
    before, fed = padding_shares(sampler, data.lengths, d.seq_len)
    lines.append(
        f"padding: {before:.1%} of the first epoch's tokens padded to seq_len, {fed:.1%} as fed (micro batch "
        f"{exp.train.micro_batch_size} x {world_size} rank(s), each micro batch padded to its longest"
        f"{'; grouped by length' if d.group_by_length else ''})"
    )
    shown = 0
    for r in order:
        for ex in examples_of(data.train[r]):
            if shown == n:
                return "\n".join(lines)
            shown += 1
            lines += [
                "",
                f"example {shown} (sequence {int(r)}; {len(ex.ids)} tokens, {sum(ex.targets[1:])} targets):",
                ex.show(data.tokenizer, limit=None),
                "tokens: " + token_view(ex, data.tokenizer),
            ] + _images(ex, data)
    return "\n".join(lines)


GLOBAL_VIEW = "<global-img>"  # Idefics3: an image's tiles, then its global view's tokens after this one


def _images(ex: Any, data: Any) -> list[str]:
    """Where each image's tokens stand in an example, and how many (none without images): a run of image tokens
    is an image, or, where the images are tiles and a global view (Idefics3), the runs up to the global view's."""
    marks = set(image_tokens(data))
    tok = data.tokenizer
    view = tok.convert_tokens_to_ids(GLOBAL_VIEW) if GLOBAL_VIEW in tok.get_vocab() else None
    images, runs, at = [], [], 0
    while at < len(ex.ids):
        if ex.ids[at] not in marks:
            at += 1
            continue
        end = at
        while end < len(ex.ids) and ex.ids[end] in marks:
            end += 1
        runs.append((at, end))
        if view is None or view in ex.ids[max(0, at - 2) : at]:  # an image's last run
            tiles = f" in {len(runs)} tiles" if len(runs) > 1 else ""
            tokens = sum(e - s for s, e in runs)
            images.append(f"image {len(images)}: {tokens} tokens{tiles} at {runs[0][0]}-{end - 1}")
            runs = []
        at = end
    return ["images: " + "; ".join(images) + " (never targets)"] if images else []


def _pairs(data: Any, exp: Experiment, n: int) -> list[str]:
    """Preference data: the first `n` pairs of the first epoch, each response with its targets (unpaired data: each
    row, its label and its mismatched pair)."""
    from trainer.data.stream import RankSampler

    sampler = RankSampler(len(data.train), 0, 1, 1, exp.seed, exp.data.shuffle)
    unpaired = data.finetune.get("kind") == "unpaired"  # a row (its label in margins) and its mismatched pair
    lines = []
    for shown, r in enumerate(sampler.order(0)[:n], 1):
        what = "row" if unpaired else "pair"
        label = f", {'desirable' if data.margins[r] > 0.5 else 'undesirable'}" if unpaired else ""
        lines += ["", f"{what} {shown} ({what} {int(r)} of the data{label}):"]
        names = ("response", "mismatched pair (KL)") if unpaired else ("chosen", "rejected")
        for name, row in zip(names, data.train[r], strict=True):
            (ex,) = examples_of(row)
            lines += [
                f"  {name} ({len(ex.ids)} tokens, {sum(ex.targets[1:])} targets): {ex.show(data.tokenizer, limit=None)}",
                "  tokens: " + token_view(ex, data.tokenizer),
            ]
    return lines


def _prompts(data: Any, exp: Experiment, n: int) -> str:
    """Prompt data: how many, the longest against seq_len, and the first `n` prompts of the first epoch as
    generation starts from them, with the columns the reward functions get."""
    import json

    from trainer.data.prompts import PROMPT, lengths
    from trainer.data.stream import RankSampler

    rows = data.train
    longest = int(lengths(rows).max()) if len(rows) else 0
    stats = data.finetune or {}
    room = exp.data.seq_len - longest
    lines = [f"data: {len(rows):,} prompts in {data.cache_path} (of {stats.get('examples', len(rows)):,}; "
             f"{stats.get('dropped_too_long', 0):,} dropped: seq_len {exp.data.seq_len} or longer)",
             f"prompts: the longest {longest} tokens, leaving {room} of seq_len for a completion "
             f"(train.rl.max_new_tokens {exp.train.rl.max_new_tokens})"]  # fmt: skip
    sampler = RankSampler(len(rows), 0, 1, 1, exp.seed, exp.data.shuffle)
    for shown, r in enumerate(sampler.order(0)[:n], 1):
        ids = [int(t) for t in rows[r] if t >= 0]
        other = {k: v for k, v in data.columns[r].items() if k != PROMPT}
        lines += ["", f"prompt {shown} (row {int(r)}; {len(ids)} tokens): {data.tokenizer.decode(ids)!r}",
                  f"  columns for the rewards: {json.dumps(other)[:300]}"]  # fmt: skip
    return "\n".join(lines)
