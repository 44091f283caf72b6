"""A reward model's score head (model.head: score; trainer/objectives/reward.py): the pad token its pooling finds
a sequence's last token by."""

from __future__ import annotations

from typing import Any


def pad_of(tok: Any) -> int | None:
    """The pad id a reward model finds its last token by: the tokenizer's pad token, else its EOS (TRL's)."""
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


def set_pad(module: Any, tok: Any) -> None:
    """The model's config.pad_token_id (and its text config's) set to `pad_of(tok)`: its pooling's."""
    pad = pad_of(tok)
    for cfg in {id(c): c for c in (module.config, module.config.get_text_config())}.values():
        cfg.pad_token_id = pad
