"""Fine-tuning data (`data.train.kind: prompt_completion | chat`) -> rows for training: each row of
the raw data becomes an Example (trainer/data/chat.py: ids and targets), examples longer than
seq_len are truncated or dropped (data.truncation), examples left with no target are dropped, and
the rest are packed (trainer/data/pack.py) into rows of [input_ids, labels, position_ids]. What was
kept, truncated and dropped, the share of target tokens and one rendered example are returned for
the banner and the cache's meta.json. Text with data.separate_documents: each document (cut into
pieces of seq_len when longer, none lost) is an example whose every token is a target."""

from __future__ import annotations

from typing import Any

import numpy as np

from trainer.common.errors import UserError
from trainer.config import DataSection, DataSource
from trainer.data import formats, image_rows, images
from trainer.data.chat import (
    Example,
    check_conversation,
    prepared,
    render_conversation,
    render_prompt_completion,
)
from trainer.data.pack import pack_examples, tokenize_documents
from trainer.data.sources import locator
from trainer.data.templates import Profile, load_template, profile, template_for


def chat_profile(section: DataSection, tok: Any, required: bool = True) -> Profile | None:
    """The chat template's profile (trainer/data/templates.py), for chat data (and conversational
    prompt/completion data); None where the data needs none, or (`required` False) the tokenizer has none."""
    if not required and not section.chat_template:
        try:
            template_for(tok, None)
        except UserError:
            return None
    text, source = load_template(section, tok)
    return profile(tok, text, section.chat_template_kwargs, section.multi_turn, source)


def chat_template(section: DataSection, tok: Any) -> str | None:
    """The profile's digest for the data cache's key (None for text)."""
    if section.kind == "text" and (section.eval is None or section.eval.kind == "text"):
        return None
    p = chat_profile(section, tok, required=section.kind == "chat")
    return p.digest if p is not None else None


class _Counts:
    """What build_rows counts for the banner and the cache's meta.json."""

    def __init__(self) -> None:
        self.truncated = self.dropped_long = self.no_target = self.tokens = self.targets = 0
        self.rows = self.turn_by_turn = 0
        self.unread: dict[str, int] = {}


def _examples(row: Any, n: int, src: DataSource, section: DataSection, tok: Any, where: Any,
              prof: list[Profile | None], c: _Counts, pics: image_rows.Images | None = None) -> list[Any]:  # fmt: skip
    """One row of the raw data -> its examples."""
    if src.kind == "prompt_completion" and not formats.is_conversational(row, src):
        prompt, completion = row[src.prompt_field], row[src.completion_field]
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise UserError(
                f"{where(n)}: {src.prompt_field} and {src.completion_field} must both be strings or both lists of messages"
            )
        return [render_prompt_completion(prompt, completion, tok, train_on_prompt=section.train_on_prompt)]
    if prof[0] is None:
        prof[0] = chat_profile(section, tok)
    messages, tools, completion_from = formats.conversation(row, src, where(n))
    messages, specs = images.conversation_images(messages, row, src, where(n))
    if specs and pics is None:
        raise UserError(
            f"{where(n)}: the row has images; only chat data (data.train.kind: chat) carries them"
        )
    if pics is not None:  # a text model's tokenizer refused before its template fails on the parts
        pics.check_row(messages, specs, where(n))
    conv = check_conversation(messages, where(n), tools, completion_from)
    conv, unread = prepared(conv, prof[0], tok)
    if specs:
        pics.check_placed(prof[0], tok, conv, len(specs), where(n))
    for key in unread:
        c.unread[key] = c.unread.get(key, 0) + 1
    out, fell_back = render_conversation(conv, tok, prof[0], train_on_prompt=section.train_on_prompt)
    c.turn_by_turn += fell_back
    if pics is not None and not specs:
        _no_image_token(out, section, where(n))
    return pics.expand(out, specs, tok, where(n)) if specs else out


def build_rows(
    raw: Any, tok: Any, section: DataSection, src: DataSource, key: str
) -> tuple[np.ndarray, dict[str, Any]]:
    """(rows (n, 3, seq_len) int32, statistics)."""
    seq_len = section.seq_len
    if src.kind == "text":
        return _document_rows(raw, tok, section, src, key)
    where = locator(src, key)
    if src.kind in ("preference", "unpaired"):  # each response rendered after its prompt as prompt_completion
        from trainer.data.preference import build_pairs
        from trainer.data.unpaired import build_unpaired

        pc = src.model_copy(update={"kind": "prompt_completion", "prompt_field": "prompt",
                                    "completion_field": "completion"})  # fmt: skip
        prof_pc: list[Profile | None] = [None]
        build = build_unpaired if src.kind == "unpaired" else build_pairs
        return build(raw, tok, section, src, key,
                     lambda row, n: _examples(row, n, pc, section, tok, where, prof_pc, _Counts()))  # fmt: skip
    prof: list[Profile | None] = [chat_profile(section, tok) if src.kind == "chat" else None]
    kept, shown, c = [], None, _Counts()
    pics = image_rows.Images(section) if src.kind == "chat" else None
    for n, row in enumerate(raw):
        c.rows += 1
        for ex in _examples(row, n, src, section, tok, where, prof, c, pics):
            if len(ex.ids) > seq_len:
                if getattr(ex, "image_tokens", 0) >= seq_len:
                    raise UserError(
                        f"{where(n)}: the row's images alone take {ex.image_tokens:,} tokens, data.seq_len is "
                        f"{seq_len:,}; raise data.seq_len or bound the images (data.image_max_pixels)"
                    )
                if section.truncation == "drop":
                    c.dropped_long += 1
                    continue
                ex = ex.truncated(seq_len)
                if ex is None:  # the cut would fall inside an image: the processor's features would not match
                    pics.cut += 1
                    c.dropped_long += 1
                    continue
                c.truncated += 1
            if not any(ex.targets[1:]):  # the first token of a row is never a target
                c.no_target += 1
                continue
            _within_max_images(ex, section, where(n))
            if shown is None:
                shown = ex.show(tok)
            kept.append(ex)
            c.tokens += len(ex.ids)
            c.targets += sum(ex.targets[1:])
    if not kept:
        raise UserError(
            f"{key}: no example with a token to train on ({c.truncated} truncated, {c.dropped_long} longer than "
            f"data.seq_len {seq_len} dropped, {c.no_target} with no target left); raise data.seq_len"
        )
    placed: list[int] = []
    rows = _pack(kept, tok, section, placed)
    stats = _stats(src.kind, rows, seq_len, examples=len(kept) + c.dropped_long + c.no_target, kept=len(kept),
                   tokens=c.tokens, targets=c.targets, example=shown, truncated=c.truncated,
                   dropped_too_long=c.dropped_long, dropped_no_target=c.no_target)  # fmt: skip
    stats["conversations"] = c.rows
    if pics is not None and pics.proc is not None:
        stats["vision"] = _vision(kept, placed, len(rows), pics)
    if prof[0] is not None:
        p = prof[0]
        stats["template"] = {"strategy": p.strategy, "why": p.why, "parts": p.renders_parts, "dated": p.dated,
                             "turn_by_turn": c.turn_by_turn, "unread_keys": c.unread,
                             "train_on_prompt": section.train_on_prompt}  # fmt: skip
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


def _vision(kept: list[Any], placed: list[int], n_rows: int, pics: image_rows.Images) -> dict[str, Any]:
    """The images' statistics, and (`store`, taken out before meta.json is written) each row's tensors."""
    per_row: list[dict[str, list[np.ndarray]]] = [{} for _ in range(n_rows)]
    for ex, r in zip(kept, placed, strict=True):
        for key, value in getattr(ex, "tensors", {}).items():
            per_row[r].setdefault(key, []).append(value)
        pics.image_tokens += getattr(ex, "image_tokens", 0)
    rows = [{k: np.concatenate(v) for k, v in d.items()} for d in per_row]
    return {**pics.stats(), "store": image_rows.ImageStore.of(rows, pics.keys), "idle": pics.idle()}


def _no_image_token(examples: list[Any], section: DataSection, where: Any) -> None:
    """A row without images whose text holds the model's image token itself (its tokenizer reads the text
    "<|image|>" as that token): refused, as no image stands there (Llama 3.2 Vision's model stops on it, others
    would train on it as a target)."""
    proc = images.load_processor(section.tokenizer)
    if proc is None or not getattr(proc, "image_token", None):
        return
    token = proc.tokenizer.convert_tokens_to_ids(proc.image_token)
    found = sum(ex.ids.count(token) for ex in examples)
    if found:
        raise UserError(
            f"{where}: the text holds {proc.image_token} (the model's image token) {found} time(s) but the row has "
            "no image; remove it from the text, or give the image (an image part, or <image> with an images column)"
        )


def _max_images(ex: Any, section: DataSection) -> int | None:
    """The most images a row of `ex`'s data holds: data.max_images, or null: 1 where an image is one token (Llama
    3.2 Vision's examples: aspect ratios among their tensors), else no bound (the images' tokens bound them)."""
    one_token = "aspect_ratio_ids" in (getattr(ex, "tensors", None) or {})
    return section.max_images or (1 if one_token else None)


def _within_max_images(ex: Any, section: DataSection, where: Any) -> None:
    """data.max_images: exit 2 for an example with more images."""
    n, most = getattr(ex, "images", 0), _max_images(ex, section)
    if most is not None and n > most:
        said = section.max_images or "null: 1 for Llama 3.2 Vision, whose images the plan counts by it"
        raise UserError(f"{where}: the row has {n} images, more than data.max_images ({said}); set "
                        f"data.max_images: {n}")  # fmt: skip


def _pack(kept: list[Example], tok: Any, section: DataSection, placed: list[int] | None = None) -> np.ndarray:
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    most = max((m for m in (_max_images(ex, section) for ex in kept) if m is not None), default=None)
    images = ([getattr(ex, "images", 0) for ex in kept], most) if most is not None else None
    packed = pack_examples(
        kept, section.seq_len, pad if pad is not None else 0, one_per_row=not section.packing, placed=placed,
        images=images,
    )  # fmt: skip
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


def describe_template(stats: dict[str, Any]) -> str | None:
    """The chat template's strategy and what it did to the data, for the banner (None without one)."""
    t = stats.get("template")
    if not t:
        return None
    out = f"chat template: multi_turn {t['strategy']} ({t['why']})"
    if t.get("turn_by_turn"):
        out += f"; {t['turn_by_turn']:,} conversations rendered turn by turn (the template rewrote their history)"
    if t.get("train_on_prompt") and (t["strategy"] == "each" or t.get("turn_by_turn")):
        out += (
            "; data.train_on_prompt: a conversation rendered turn by turn is one example, its last turn as "
            "inference sees it (one a turn would train its early turns once per later answer)"
        )
    if not t.get("parts"):
        out += "; content parts are joined to text (the template reads content as a string)"
    if t.get("dated"):
        out += (
            "; the template renders today's date (strftime_now): the rendered data changes from day to day "
            "unless data.chat_template_kwargs.date_string is set"
        )
    if t.get("unread_keys"):
        keys = ", ".join(f"{k} ({n:,} rows)" for k, n in sorted(t["unread_keys"].items()))
        out += f"; message keys the template never reads, so not rendered: {keys}"
    return out


def describe(stats: dict[str, Any]) -> str:
    """One line for the banner."""
    if stats["kind"] == "preference":
        from trainer.data.preference import describe_pairs

        return describe_pairs(stats)
    if stats["kind"] == "unpaired":
        from trainer.data.unpaired import describe_unpaired

        return describe_unpaired(stats)
    if stats["kind"] == "text":
        return (
            f"text documents kept apart: {stats['examples']:,} documents ({stats.get('split', 0):,} longer than "
            f"a sequence, continued in the next) in {stats['rows']:,} sequences; {stats['tokens']:,} tokens, "
            f"{stats['target_tokens']:,} targets, padding {stats['padding_share']:.1%}"
        )
    convs = stats.get("conversations")
    made = f" made from {convs:,} rows" if convs is not None and convs != stats["examples"] else ""
    v = stats.get("vision")
    images = (
        f"; images: {v['images']:,} in {v['rows']:,} rows, {v['image_tokens']:,} image tokens (never targets; "
        f"{v['cut']:,} examples dropped where truncation would cut an image)"
        if v
        else ""
    )
    return (
        f"fine-tuning data ({stats['kind']}): {stats['kept']:,} of {stats['examples']:,} examples{made} in {stats['rows']:,} "
        f"sequences ({stats['truncated']:,} truncated, {stats['dropped_too_long']:,} too long dropped, "
        f"{stats['dropped_no_target']:,} with no target left dropped); target tokens {stats['target_tokens']:,} = "
        f"{stats['target_tokens'] / max(1, stats['tokens']):.1%} of {stats['tokens']:,}, padding "
        f"{stats['padding_share']:.1%}{images}"
    )
