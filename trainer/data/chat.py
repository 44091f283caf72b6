"""Fine-tuning examples -> token ids and the tokens the loss trains on (the targets).

- `chat`: a conversation, passed to the chat template as the data holds it: every key of every
  message (`tool_calls`, `tool_call_id`, `name`, `reasoning_content`, `thinking`...), content parts
  and the example's tool schemas (`tools=`). The targets are each trained assistant turn's tokens up
  to and including its end-of-turn token; system, user and tool turns and the template's own markup
  never are (unless data.train_on_prompt). A message `training: false` (Axolotl's key) keeps an
  assistant turn as context only.
- `prompt_completion`: the prompt's tokens, then the completion's and an EOS; the targets are the
  completion and the EOS. Lists of messages (TRL's conversational form) render as a chat whose
  completion's assistant turns are the targets.

The targets come from where the template itself puts each assistant turn, never from searching the
text: rendering the conversation up to the turn with the generation prompt gives where the turn
starts, rendering it with the turn gives where it ends: at the template's end-of-turn token
(`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`, EOS: templates.Profile.eot), so that text the template
adds after it (Llama 3.0's template appends the next assistant header to every rendering) is not the
turn's. The rendering is tokenized with character offsets, and a token is a target when it starts
inside the turn, up to the turn's last special token.

How a conversation of several assistant turns becomes examples is the template profile's strategy
(trainer/data/templates.py, data.multi_turn): `all` renders it once and trains every turn (the
turn's rendering must then be the same with later turns after it, or the template's generation
markers must say where it is); `each` makes one example per turn, rendered as inference sees it (the
history as the template renders history, the turn as it renders the last one: Qwen3's `<think>`
block included); `last` trains the final turn only. Under auto, a conversation on which a consistent
template still renders a turn otherwise is rendered turn by turn too, and counted. With
data.train_on_prompt every token is a target, so `each` makes one example of a conversation (its last
trained turn, the history before it as the template renders history): one example a turn would train
the early turns once for every later answer.

Truncation keeps the example's start (the prompt's start, then as much of the answer as fits);
an example with no target left is dropped, and counted by the caller.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainer.common.errors import UserError
from trainer.config import ROLES
from trainer.data.templates import Profile, as_parts, profile
from trainer.data.tokenizer import special_edges

TRAINING = "training"  # a message's own flag: false keeps an assistant turn out of the targets
# Keys of what the model itself says: refused when the template never renders them (the turn would be
# trained without them); other keys it never renders (a tool result's name, metadata) are reported.
MEANINGFUL = ("tool_calls", "reasoning_content", "thinking")


@dataclass(frozen=True)
class Example:
    """One training example: token ids and, per token, whether the loss trains on it."""

    ids: list[int]
    targets: list[bool]
    text: str | None = (
        None  # the rendering the ids were cut from (a chat example's; its images are expanded from it)
    )

    @property
    def n_targets(self) -> int:
        return sum(self.targets)

    def truncated(self, seq_len: int) -> Example:
        """The first `seq_len` tokens (the prompt's start and as much of the answer as fits)."""
        return Example(self.ids[:seq_len], self.targets[:seq_len])

    def show(self, tok: Any, limit: int | None = 400) -> str:
        """The rendered example with its targets in [[...]] (the banner line), shortened to `limit`
        characters."""
        out, run, inside = [], [], False
        for i, t in zip(self.ids, self.targets, strict=True):
            if t != inside and run:
                text = tok.decode(run)
                out.append(f"[[{text}]]" if inside else text)
                run = []
            inside = t
            run.append(i)
        if run:
            text = tok.decode(run)
            out.append(f"[[{text}]]" if inside else text)
        shown = "".join(out).replace("\n", "\\n")
        return shown if limit is None or len(shown) <= limit else shown[: limit - 3] + "..."


@dataclass(frozen=True)
class Conversation:
    """A checked conversation: its messages as the data holds them (less the `training` flag), the
    example's tool schemas, and which assistant messages are trained."""

    messages: list[dict[str, Any]]
    tools: list[Any] | None
    trained: tuple[int, ...]
    where: str


def _check_content(content: Any, n: int, where: str) -> None:
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise UserError(
            f"{where}: message {n}: content is {type(content).__name__}; give a string or a list of content "
            'parts [{"type": "text", "text": ...}]'
        )
    for k, part in enumerate(content):
        if not isinstance(part, Mapping) or "type" not in part:
            raise UserError(
                f"{where}: message {n}: content part {k} is not a {{type, ...}} mapping: {str(part)[:80]}"
            )
        if (
            part["type"] == "image" and len(part) == 1
        ):  # an image, where the data's were found (trainer/data/images.py)
            continue
        if part["type"] != "text":
            raise UserError(
                f"{where}: message {n}: content part {k} is of type '{part['type']}'; this trains text models, "
                "so only text parts can be trained on: remove the example or the part"
            )
        if not isinstance(part.get("text"), str):
            raise UserError(f"{where}: message {n}: text part {k} has no string 'text'")


def check_conversation(
    messages: Any, where: str, tools: Any = None, completion_from: int | None = None
) -> Conversation:
    """A conversation as the data holds it, checked: a list of messages with known roles, contents that
    are strings, None (a tool call's) or text parts, and at least one trained assistant message.
    `completion_from`: TRL's prompt/completion form, only assistant turns from this index are trained."""
    if not isinstance(messages, list) or not messages:
        raise UserError(
            f"{where}: expected a non-empty list of {{role, content}} messages, got {type(messages).__name__}"
        )
    out, trained = [], []
    for n, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") is None:
            raise UserError(f"{where}: message {n} is not a {{role, content}} mapping: {str(m)[:80]}")
        if m["role"] not in ROLES:
            raise UserError(
                f"{where}: message {n} has role '{m['role']}'; roles are {', '.join(ROLES)} (map others with "
                "format_map.roles)"
            )
        if m.get("content") is None and not m.get("tool_calls"):
            raise UserError(f"{where}: message {n} has neither content nor tool_calls")
        _check_content(m.get("content"), n, where)
        flag = m.get(TRAINING, True)
        if not isinstance(flag, bool):
            raise UserError(f"{where}: message {n}: {TRAINING} is {flag!r}; give true or false")
        if TRAINING in m and m["role"] != "assistant" and flag:
            raise UserError(
                f"{where}: message {n}: {TRAINING}: true on a {m['role']} message; only assistant turns are "
                "targets (data.train_on_prompt trains on everything)"
            )
        if m["role"] == "assistant" and flag and (completion_from is None or n >= completion_from):
            if n == 0:
                raise UserError(
                    f"{where}: message 0 is an assistant turn with nothing before it to answer; add the turn "
                    f"that prompts it, or give it {TRAINING}: false"
                )
            trained.append(n)
        out.append({k: v for k, v in m.items() if k != TRAINING})
    if not trained:
        raise UserError(f"{where}: no assistant message to train on")
    if isinstance(tools, str):  # data sets often hold the schemas as a JSON string
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise UserError(
                f"{where}: tools is a string that is not JSON ({e}); give a list of tool schemas"
            ) from None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, Mapping) for t in tools)):
        raise UserError(
            f"{where}: tools must be a list of tool schemas (mappings), got {type(tools).__name__}"
        )
    return Conversation(out, tools or None, tuple(trained), where)


def prepared(conv: Conversation, p: Profile, tok: Any) -> tuple[Conversation, set[str]]:
    """The conversation as the template takes it: text parts joined where the template does not read
    parts. Every other key is tested by rendering the conversation (as the strategy renders it) without
    it: a key of what the model says (tool calls, reasoning) or tools that change nothing are refused,
    the other keys that change nothing are returned (reported, not refused)."""
    messages = []
    for m in as_parts(conv.messages) if p.parts_only else conv.messages:
        content = m.get("content")
        # a message with an image keeps its parts (trainer/data/image_rows.py checks the template placed them)
        if (
            isinstance(content, list)
            and not p.renders_parts
            and not p.parts_only
            and all(part["type"] == "text" for part in content)
        ):
            m = {**m, "content": "\n".join(part["text"] for part in content)}
        messages.append(m)
    conv = dataclasses.replace(conv, messages=messages)
    keys = sorted(
        {k for m in messages for k, v in m.items() if k not in ("role", "content") and v not in ("", [], {})}
    )
    if not keys and not conv.tools:
        return conv, set()
    seen = _texts(p, tok, conv)
    unread = set()
    for key in keys:
        if _unchanged(
            p,
            tok,
            seen,
            dataclasses.replace(conv, messages=[{k: v for k, v in m.items() if k != key} for m in messages]),
        ):
            n = next(i for i, m in enumerate(messages) if key in m)
            if key in MEANINGFUL:
                raise UserError(
                    f"{conv.where}: message {n} has '{key}', which the chat template never renders: the turn "
                    "would be trained without it; give a template that renders it (data.chat_template) or "
                    "remove the key"
                )
            unread.add(key)
    if conv.tools and _unchanged(p, tok, seen, dataclasses.replace(conv, tools=None)):
        raise UserError(
            f"{conv.where}: the example has tools, which the chat template never renders; give a template "
            "with tool support (data.chat_template) or remove them"
        )
    return conv, unread


def _texts(p: Profile, tok: Any, conv: Conversation) -> list[str]:
    """What the strategy renders of a conversation: the whole (all), or each trained turn as the last."""
    if p.strategy == "all":
        return [_render(p, tok, conv)]
    turns = conv.trained[-1:] if p.strategy == "last" else conv.trained
    return [_render(p, tok, conv, i + 1) for i in turns]


def _unchanged(p: Profile, tok: Any, seen: list[str], conv: Conversation) -> bool:
    try:
        return _texts(p, tok, conv) == seen
    except UserError:  # the template needs what was taken away: it reads it
        return False


def _render(p: Profile, tok: Any, conv: Conversation, upto: int | None = None, prompt: bool = False) -> str:
    messages = conv.messages if upto is None else conv.messages[:upto]
    try:
        return p.render(tok, messages, conv.tools, prompt)
    except Exception as e:  # noqa: BLE001 (jinja2's errors and the template's raise_exception)
        raise UserError(
            f"{conv.where}: the chat template cannot render this conversation ({type(e).__name__}: {e}); "
            "fix the example or give a template that renders it: data.chat_template"
        ) from None


def _targets(tok: Any, text: str, spans: list[tuple[int, int]], train_on_prompt: bool) -> Example:
    """Tokenize `text`; a token is a target where it overlaps an assistant span (as transformers' own
    assistant mask: a token that joins the prompt's last space to the answer's first word is the
    answer's), up to the span's last special token."""
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    if train_on_prompt:  # everything up to the last turn's end; not what the template adds after it
        last = max(end for _, end in spans)
        return Example(ids, [a < last for a, _ in offsets], text)
    special = set(tok.all_special_ids)
    targets = [False] * len(ids)
    for start, end in spans:
        inside = [j for j, (a, b) in enumerate(offsets) if a < end and max(b, a + 1) > start]
        ends = [j for j in inside if ids[j] in special]
        last = ends[-1] if ends else (inside[-1] if inside else -1)
        for j in inside:
            if j <= last:
                targets[j] = True
    return Example(ids, targets, text)


def _turn(p: Profile, tok: Any, conv: Conversation, i: int) -> tuple[str, str] | None:
    """(the rendering up to turn i with the generation prompt, the rendering with turn i last), or None
    when the first is not the start of the second."""
    before = _render(p, tok, conv, i, prompt=True)
    upto = _render(p, tok, conv, i + 1)
    return (before, upto) if upto.startswith(before) else None


def _as_inference_sees(p: Profile, tok: Any, conv: Conversation, i: int) -> tuple[str, str] | None:
    """Turn i of a conversation whose prompt the template renders otherwise once the turn follows it
    because of its system prompt (Mistral's templates put it in the last user turn only): (the prompt
    inference sees, that prompt + the turn as the template renders it after the same history without
    the system prompt, where that history renders consistently). None otherwise."""
    if i < 2 or conv.messages[0].get("role") != "system":
        return None
    rest = dataclasses.replace(conv, messages=conv.messages[1:])
    found = _turn(p, tok, rest, i - 1)
    if found is None:
        return None
    before, (plain, upto) = _render(p, tok, conv, i, prompt=True), found
    return before, before + upto[len(plain) : p.turn_end(upto, len(plain))]


def render_each(
    p: Profile, tok: Any, conv: Conversation, turns: tuple[int, ...], train_on_prompt: bool
) -> list[Example]:
    """One example per turn in `turns`: the conversation up to it, the turn rendered as the last."""
    out = []
    for i in turns:
        found = _turn(p, tok, conv, i) or _as_inference_sees(p, tok, conv, i)
        if found is None:
            raise UserError(
                f"{conv.where}: the chat template renders the prompt of assistant turn {i} otherwise once the "
                "turn follows it (the prompt with the generation prompt is not the start of the conversation "
                "with the answer: e.g. a system prompt the template drops when the last message is an "
                "answer), so where the answer lies cannot be known; give a template that keeps it: "
                "data.chat_template"
            )
        before, upto = found
        out.append(_targets(tok, upto, [(len(before), p.turn_end(upto, len(before)))], train_on_prompt))
    return out


def render_all(p: Profile, tok: Any, conv: Conversation, train_on_prompt: bool) -> Example | None:
    """The conversation rendered once, every trained turn a target; None when a turn's rendering changes
    once later turns follow (and the template has no generation markers to say where it lies)."""
    full = _render(p, tok, conv)
    spans = []
    for i in conv.trained:
        found = _turn(p, tok, conv, i)
        end = p.turn_end(found[1], len(found[0])) if found is not None else 0
        if found is None or not full.startswith(found[1][:end]):
            return _marked(p, tok, conv, train_on_prompt) if p.markers else None
        spans.append((len(found[0]), end))
    return _targets(tok, full, spans, train_on_prompt)


def _marked(p: Profile, tok: Any, conv: Conversation, train_on_prompt: bool) -> Example:
    """The template's own generation markers say where the assistant turns are (every one of them:
    the markers cannot tell a `training: false` turn)."""
    if len(conv.trained) != sum(m["role"] == "assistant" for m in conv.messages):
        raise UserError(
            f"{conv.where}: {TRAINING}: false needs the turns rendered one by one, and this template rewrites "
            "history: set data.multi_turn: each"
        )
    out = tok.apply_chat_template(
        conv.messages, tools=conv.tools, chat_template=p.text, tokenize=True, return_dict=True,
        return_assistant_tokens_mask=True, **dict(p.kwargs),
    )  # fmt: skip
    ids = list(out["input_ids"])
    return Example(ids, [True] * len(ids) if train_on_prompt else [bool(x) for x in out["assistant_masks"]])


def render_conversation(
    conv: Conversation, tok: Any, p: Profile, *, train_on_prompt: bool = False
) -> tuple[list[Example], bool]:
    """A checked conversation -> its examples under the profile's strategy, and whether (auto) it had to
    be rendered turn by turn although the template passed the probe."""
    # data.train_on_prompt trains every token: one example a turn would train a conversation's early
    # turns once per later answer, so a conversation is one example, rendered as its last turn is seen
    each = conv.trained[-1:] if train_on_prompt else conv.trained
    if p.strategy == "last":
        return render_each(p, tok, conv, conv.trained[-1:], train_on_prompt), False
    if p.strategy == "each":
        return render_each(p, tok, conv, each, train_on_prompt), False
    ex = render_all(p, tok, conv, train_on_prompt)
    if ex is not None:
        return [ex], False
    if p.why.startswith("auto"):
        return render_each(p, tok, conv, each, train_on_prompt), True
    raise UserError(
        f"{conv.where}: the chat template renders an assistant turn of this conversation otherwise once later "
        "turns follow (it rewrites history), so one rendering cannot train every turn as inference sees it; "
        "set data.multi_turn: each (one example per turn) or last"
    )


def render_prompt_completion(
    prompt: str, completion: str, tok: Any, *, train_on_prompt: bool = False
) -> Example:
    """Prompt (after the special tokens the tokenizer begins a text with by default: BOS for Llama 3,
    Gemma, Mistral) then completion then EOS; the completion and the EOS are the targets."""
    p = special_edges(tok)[0] + tok(prompt, add_special_tokens=False)["input_ids"]
    c = tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return Example(p + c, [train_on_prompt] * len(p) + [True] * len(c))


def render_chat(
    messages: Any,
    tok: Any,
    template: str,
    *,
    train_on_prompt: bool = False,
    multi_turn: str = "auto",
    tools: Any = None,
    kwargs: Mapping[str, Any] | None = None,
    where: str = "conversation",
) -> list[Example]:
    """One conversation as data holds it -> its examples (the template profiled for it alone)."""
    p = profile(tok, template, kwargs or {}, multi_turn, "data.chat_template")
    conv, _ = prepared(check_conversation(messages, where, tools), p, tok)
    return render_conversation(conv, tok, p, train_on_prompt=train_on_prompt)[0]
