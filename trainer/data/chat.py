"""Fine-tuning examples -> token ids and the tokens the loss trains on (the targets).

- `chat`: a list of `{role, content}` messages rendered with a chat template (the tokenizer's, a
  user's `.jinja` file, or BYTE_TEMPLATE for the built-in byte tokenizer). The targets are each
  assistant message's tokens up to and including its end-of-turn token; system and user turns, and
  the template's own markup, never are.
- `prompt_completion`: the prompt's tokens, then the completion's and an EOS; the targets are the
  completion and the EOS.

The targets come from where the template itself puts each assistant message, never from searching
the text for the message: rendering the conversation up to the assistant turn with the generation
prompt gives where the turn starts, rendering it with the turn gives where it ends (in characters of
the full rendering, which must start with both; a template that renders earlier turns differently
once later ones follow is refused). The full rendering is tokenized once, with character offsets, and
a token is a target when it starts inside an assistant turn, up to the turn's last special token
(the end-of-turn: `<|im_end|>`, `<|eot_id|>`, EOS), so text the template adds after it (a newline)
is not. A template with generation markers (`{% generation %}`) gives the same targets.

Truncation keeps the example's start (the prompt's start, then as much of the answer as fits);
an example with no target left is dropped, and counted by the caller.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trainer.errors import UserError

# The built-in byte tokenizer's template: role markers in plain bytes, each assistant turn ending
# with EOS (the byte tokenizer's only special token), so that everything works offline.
BYTE_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Example:
    """One training example: token ids and, per token, whether the loss trains on it."""

    ids: list[int]
    targets: list[bool]

    @property
    def n_targets(self) -> int:
        return sum(self.targets)

    def truncated(self, seq_len: int) -> Example:
        """The first `seq_len` tokens (the prompt's start and as much of the answer as fits)."""
        return Example(self.ids[:seq_len], self.targets[:seq_len])

    def show(self, tok: Any, limit: int = 400) -> str:
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
        return shown if len(shown) <= limit else shown[: limit - 3] + "..."


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


def render_text(
    tok: Any, template: str, messages: Sequence[Mapping[str, Any]], generation_prompt: bool = False
) -> str:
    """The conversation as the template renders it (text; with the assistant's generation prompt)."""
    return tok.apply_chat_template(
        list(messages), chat_template=template, tokenize=False, add_generation_prompt=generation_prompt
    )


def check_messages(messages: Any, where: str) -> list[dict[str, str]]:
    """A conversation as the data holds it, checked: a list of {role, content} with known roles and
    at least one assistant message."""
    if not isinstance(messages, list) or not messages:
        raise UserError(
            f"{where}: expected a non-empty list of {{role, content}} messages, got {type(messages).__name__}"
        )
    out = []
    for n, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise UserError(f"{where}: message {n} is not a {{role, content}} mapping: {str(m)[:80]}")
        if m["role"] not in ROLES:
            raise UserError(f"{where}: message {n} has role '{m['role']}'; roles are {', '.join(ROLES)}")
        out.append({"role": str(m["role"]), "content": str(m["content"] or "")})
    if not any(m["role"] == "assistant" for m in out):
        raise UserError(f"{where}: no assistant message: nothing to train on")
    return out


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    tok: Any,
    template: str,
    *,
    train_on_prompt: bool = False,
) -> Example:
    """A conversation -> ids and targets (see the module docstring)."""
    full = render_text(tok, template, messages)
    spans = []  # (start, end) characters of each assistant turn in `full`
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render_text(tok, template, messages[:i], True)
        upto = render_text(tok, template, messages[: i + 1])
        if not (upto.startswith(before) and full.startswith(upto)):
            raise UserError(
                f"data.chat_template: the template renders turn {i} differently once later turns follow, so "
                "where each assistant turn lies cannot be known (a template that rewrites earlier turns, e.g. "
                "dropping their reasoning); give a template that renders each turn the same way: "
                "data.chat_template: FILE.jinja"
            )
        spans.append((len(before), len(upto)))
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    if train_on_prompt:
        return Example(list(ids), [True] * len(ids))
    special = set(tok.all_special_ids)
    targets = [False] * len(ids)
    for start, end in spans:
        inside = [j for j, (a, _) in enumerate(offsets) if start <= a < end]
        ends = [j for j in inside if ids[j] in special]
        last = ends[-1] if ends else (inside[-1] if inside else -1)
        for j in inside:
            if j <= last:
                targets[j] = True
    return Example(list(ids), targets)


def render_prompt_completion(
    prompt: str, completion: str, tok: Any, *, train_on_prompt: bool = False
) -> Example:
    """Prompt then completion then EOS; the completion and the EOS are the targets."""
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    c = tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return Example(p + c, [train_on_prompt] * len(p) + [True] * len(c))
