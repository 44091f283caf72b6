"""Which chat template renders chat data (`template_for`, `load_template`: data.chat_template's file, the
tokenizer's, or the built-in `BYTE_TEMPLATE` of the byte tokenizer), and what it does, found by testing it
(never by the model's name): the profile that chat rendering (trainer/data/chat.py) follows.

- **History**: a probe conversation of three assistant turns is rendered whole and turn by turn. A
  template that renders every assistant turn the same whether or not later turns follow is
  *consistent*: one rendering of the whole conversation trains every turn (`data.multi_turn: all`).
  One that renders the last assistant turn otherwise than earlier ones rewrites history (Qwen3 and
  other reasoning templates add a `<think>` block to the last turn only; some drop or move the system
  prompt): each assistant turn becomes its own example, rendered as inference sees it (`each`).
- **Content parts**: OpenAI-style `[{"type": "text", "text": ...}]` content either renders as its text
  (Gemma 3's template reads the parts) or the template would print the list's Python repr or fail
  (most templates read `message.content` as a string): then the text parts are joined with a newline
  (as vLLM serves them) before rendering.
- **Keys read**: every `x.name` / `x['name']` the template mentions; a key of the data that the
  template never mentions (say `tool_calls` under a template without tool support) would render as
  nothing, so chat.py refuses or reports it instead of training on a turn that lost it.
- **End of turn**: the special token the template closes an assistant turn with (`<|im_end|>`,
  `<|eot_id|>`, `<end_of_turn>`, EOS), read off a probe answer's rendering. A turn's targets end with
  it; what a template renders after it (Llama 3.0's appends the assistant header to every rendering)
  is not the turn's, is never trained, and does not make the history look rewritten.
- **Generation markers** (`{% generation %}`), `tools`, and today's date (`strftime_now`, which makes
  the rendered data change from day to day unless `data.chat_template_kwargs.date_string` is set).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.common.errors import UserError

STRATEGIES = ("all", "each", "last")

# The built-in byte tokenizer's template: role markers in plain bytes, each assistant turn ending
# with EOS (the byte tokenizer's only special token), so that everything works offline.
BYTE_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# The probe: a system prompt and three exchanges, each answer with reasoning where the template reads it.
_PROBE_TURNS = [
    ("What is 1 + 1?", "It is 2."),
    ("And 2 + 2?", "It is 4."),
    ("And 3 + 3?", "It is 6."),
]
_PROBE_REASONING = "Add the two numbers."
_PART_MARKS = ("probe-part-one", "probe-part-two")


@dataclass(frozen=True)
class Profile:
    """What `profile` found out about a template (and the strategy chosen for multi-turn data)."""

    text: str
    kwargs: Mapping[str, Any]  # data.chat_template_kwargs, passed to every rendering
    strategy: str  # all | each | last
    setting: str  # data.multi_turn as given (auto falls back to each per conversation; all refuses)
    why: str  # why this strategy: said at start and in --preview-data
    consistent: bool  # the probe rendered every assistant turn the same with later turns after it
    renders_parts: bool  # content parts render as their text without joining them first
    # consistent with a system prompt first too (Mistral's templates put it in the last user turn only)
    consistent_system: bool = False
    reads: frozenset[str] = field(default_factory=frozenset)  # names the template reads off any object
    reads_tools: bool = False
    markers: bool = False  # {% generation %} blocks
    dated: bool = False  # renders today's date unless kwargs give one
    eot: str = ""  # the special token that ends an assistant turn, as text ("" when the probe found none)
    # reads content parts only: a string content renders as nothing (llava-1.5-hf's, Idefics3's templates), so
    # every string is given as one text part
    parts_only: bool = False

    def turn_end(self, rendered: str, start: int) -> int:
        """Where the assistant turn that starts at `start` of `rendered` (a rendering that ends with
        the turn) ends: just after its last end-of-turn token, so that content quoting it (`<s>old</s>`
        under Mistral's `</s>`) stays in the turn; the rendering's end when the template closes no
        turn with one (then the turn's last special token ends its targets, chat._targets)."""
        at = rendered.rfind(self.eot, start) if self.eot else -1
        return len(rendered) if at < 0 else at + len(self.eot)

    @property
    def digest(self) -> str:
        """Identifies the rendering for the data cache: template, kwargs and strategy."""
        blob = json.dumps(
            [self.text, dict(self.kwargs), self.strategy, self.setting], sort_keys=True, default=str
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def render(
        self, tok: Any, messages: list[dict[str, Any]], tools: list | None = None, prompt: bool = False
    ) -> str:
        """The messages as this template renders them (with the assistant's generation prompt)."""
        return tok.apply_chat_template(
            as_parts(messages) if self.parts_only else messages, tools=tools, chat_template=self.text, tokenize=False,
            add_generation_prompt=prompt, **dict(self.kwargs),
        )  # fmt: skip


def names_read(template: str) -> tuple[frozenset[str], bool]:
    """(attribute and item names the template reads anywhere, whether it reads `tools`): from its syntax
    tree, so that a name in a string or a comment does not count."""
    import jinja2
    from jinja2 import nodes

    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", "jinja2.ext.do"]).parse(template)
        # only for the probe's choice of keys (reasoning_content, thinking): whether a key of the data is
        # rendered is found by rendering it (chat.prepared)
    except jinja2.TemplateSyntaxError:
        # transformers' own environment has its generation tag; strip it to read the names
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", "jinja2.ext.do"]).parse(
            re.sub(r"{%-?\s*(end)?generation\s*-?%}", "", template)
        )
    names = {n.attr for n in tree.find_all(nodes.Getattr)}
    names |= {n.arg.value for n in tree.find_all(nodes.Getitem) if isinstance(n.arg, nodes.Const)}
    names |= {  # message.get('key')
        c.args[0].value
        for c in tree.find_all(nodes.Call)
        if isinstance(c.node, nodes.Getattr)
        and c.node.attr == "get"
        and c.args
        and isinstance(c.args[0], nodes.Const)
    }
    tools = any(n.name == "tools" for n in tree.find_all(nodes.Name))
    return frozenset(x for x in names if isinstance(x, str)), tools


def check_syntax(template: str, source: str) -> None:
    """A template that is not valid Jinja: exit 2 naming where it came from and the line."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)
    except Exception as e:  # noqa: BLE001 (jinja2's TemplateSyntaxError, or transformers' own checks)
        line = f" line {e.lineno}" if getattr(e, "lineno", None) else ""
        raise UserError(
            f"{source}: the chat template is not valid Jinja ({type(e).__name__}{line}: {e}); fix the template "
            "or give another: data.chat_template: FILE.jinja"
        ) from None


def profile(tok: Any, template: str, kwargs: Mapping[str, Any], multi_turn: str, source: str) -> Profile:
    """Test `template` (see the module docstring) and choose the multi-turn strategy: `multi_turn` as
    set, or for auto `all` where the template is consistent and `each` where it is not."""
    check_syntax(template, source)
    reads, reads_tools = names_read(template)
    base = Profile(
        text=template, kwargs=dict(kwargs), strategy="all", setting=multi_turn, why="", consistent=False,
        renders_parts=False,
        reads=reads, reads_tools=reads_tools,
        markers=re.search(r"{%-?\s*generation\s*-?%}", template) is not None,
        dated="strftime_now" in template and "date_string" not in kwargs,
    )  # fmt: skip
    base = Profile(**{**base.__dict__, "parts_only": _probe_parts_only(tok, base)})
    base = Profile(**{**base.__dict__, "eot": _probe_eot(tok, base)})
    # the shapes data has: without a system prompt, and with one (a conversation of that shape that a
    # template renders otherwise is rendered turn by turn under auto: chat.render_conversation)
    consistent, turn, error = _probe_history(tok, base, system=False)
    consistent_system = _probe_history(tok, base, system=True)[0]
    parts = _probe_parts(tok, base)
    if multi_turn != "auto":
        strategy, why = multi_turn, f"data.multi_turn: {multi_turn}"
        if multi_turn == "all" and not consistent and not base.markers:
            why += (
                f" (the template renders message {turn} of a probe conversation otherwise once later "
                "turns follow: a conversation where that shows is refused)"
            )
    elif consistent:
        strategy = "all"
        why = "auto: the template renders each assistant turn the same whether or not later turns follow, so one rendering trains every turn"
        if not consistent_system:
            why += (
                " (with a system prompt it renders the turns otherwise: a conversation with one is rendered turn "
                "by turn, each prompt as inference sees it)"
            )
    else:
        strategy = "each"
        why = (
            "auto: the template renders the last assistant turn otherwise than earlier ones"
            + (f" (probe message {turn})" if turn is not None else f" (the probe failed: {error})")
            + ", so each assistant turn is its own example, rendered as inference sees it"
        )
    return Profile(**{**base.__dict__, "strategy": strategy, "why": why, "consistent": consistent,
                      "consistent_system": consistent_system, "renders_parts": parts})  # fmt: skip


def _probe_messages(p: Profile, system: bool) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "system", "content": "You answer briefly."}] if system else []
    for q, a in _PROBE_TURNS:
        answer: dict[str, Any] = {"role": "assistant", "content": a}
        for key in ("reasoning_content", "thinking"):
            if key in p.reads:
                answer[key] = _PROBE_REASONING
        out += [{"role": "user", "content": q}, answer]
    return out


_EOT_MARK = "probe-answer-end"


def _probe_eot(tok: Any, p: Profile) -> str:
    """The special token right after an assistant answer's text in the template's rendering (the first
    special token after it), as text; "" when there is none."""
    special = {t for t in tok.all_special_tokens if t} | {
        t.content for t in getattr(tok, "added_tokens_decoder", {}).values() if getattr(t, "special", False)
    }
    for system in (False, True):
        messages = [
            {"role": "user", "content": "What is 1 + 1?"},
            {"role": "assistant", "content": _EOT_MARK},
        ]
        if system:
            messages.insert(0, {"role": "system", "content": "You answer briefly."})
        try:
            text = p.render(tok, messages)
        except Exception:  # noqa: BLE001 (a template that needs a system prompt, or refuses one)
            continue
        at = text.rfind(_EOT_MARK)
        if at < 0:
            continue
        after = text[at + len(_EOT_MARK) :]
        found = [(after.find(t), t) for t in special if after.find(t) >= 0]
        return min(found, key=lambda x: (x[0], -len(x[1])))[1] if found else ""
    return ""


def _probe_history(tok: Any, p: Profile, system: bool) -> tuple[bool, int | None, str | None]:
    """(consistent, the first assistant turn rendered otherwise, an error the probe met), for the probe
    conversation with or without a system prompt. A turn is compared up to its end-of-turn token: what
    the template adds after it is not the turn's."""
    messages = _probe_messages(p, system)
    try:
        full = p.render(tok, messages)
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = p.render(tok, messages[:i], prompt=True)
            upto = p.render(tok, messages[: i + 1])
            if not (upto.startswith(before) and full.startswith(upto[: p.turn_end(upto, len(before))])):
                return False, i, None
        return True, None, None
    except Exception as e:  # noqa: BLE001 (whatever the template raises: some refuse a system prompt)
        return False, None, f"{type(e).__name__}: {e}"


def as_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each string content as one text part (a template that reads parts only)."""
    return [{**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m.get("content"), str) else m
            for m in messages]  # fmt: skip


def _probe_parts_only(tok: Any, p: Profile) -> bool:
    """Whether the template renders a user's string content as nothing but the same text as a part."""
    mark = "probe-string-content"
    try:
        plain = p.render(tok, [{"role": "user", "content": mark}])
        parts = p.render(tok, as_parts([{"role": "user", "content": mark}]))
    except Exception:  # noqa: BLE001 (a template that raises on either: not this kind)
        return False
    return mark not in plain and mark in parts


def _probe_parts(tok: Any, p: Profile) -> bool:
    """Whether content parts render as their text in every role (each part's text there, no repr of the
    list): system, user and assistant messages of parts."""
    marks = [f"{m}-{r}" for r in ("system", "user", "assistant") for m in _PART_MARKS]

    def parts(role: str) -> list[dict[str, str]]:
        return [{"type": "text", "text": f"{m}-{role}"} for m in _PART_MARKS]

    messages = [{"role": r, "content": parts(r)} for r in ("system", "user", "assistant")]
    try:
        text = p.render(tok, messages)
    except Exception:  # noqa: BLE001 (a template that reads content as a string may raise)
        return False
    return all(m in text for m in marks) and "'type'" not in text and '"type"' not in text


def template_for(tok: Any, template: str | None, source: str = "data.chat_template") -> str:
    """The chat template to render with: the user's, else the tokenizer's, else (the byte tokenizer)
    the built-in one."""
    if template:
        return template
    if getattr(tok, "chat_template", None):
        return tok.chat_template
    if len(tok) == 257 and tok.eos_token == "<|endoftext|>":  # the built-in byte tokenizer
        return BYTE_TEMPLATE
    raise UserError(
        f"{source}: the tokenizer has no chat template; give one: data.chat_template: FILE.jinja "
        "(a Jinja template over `messages`, as transformers' apply_chat_template takes)"
    )


def load_template(section: Any, tok: Any) -> tuple[str, str]:
    """(the template text chat data renders with, where it came from): data.chat_template's file, else the
    tokenizer's, else (the byte tokenizer) the built-in one."""
    if section.chat_template:
        path = Path(section.chat_template).expanduser()
        try:
            return path.read_text(encoding="utf-8"), f"data.chat_template ({path})"
        except OSError as e:
            raise UserError(
                f"data.chat_template: cannot read {path}: {e.strerror}; give a .jinja file"
            ) from None
        except UnicodeDecodeError as e:
            raise UserError(
                f"data.chat_template: {path} is not UTF-8 text ({e.reason} at byte {e.start})"
            ) from None
    return template_for(tok, None), f"data.tokenizer ({section.tokenizer})'s chat template"
