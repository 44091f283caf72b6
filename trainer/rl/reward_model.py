"""`function: model` (train.rl.rewards): a local reward model scores completions as TRL's GRPOTrainer scores
them with a sequence-classification model given as a reward function: the prompt and its completion as one
text (chat prompts: the messages and the completion's assistant message rendered by the reward model's own
chat template, with data.chat_template_kwargs; text prompts: the two strings joined), tokenized without
special tokens, padded on the right with the reward model's pad token (its EOS where it has none), and the
first logit of the sequence's last token is the reward. It runs in `batch_size` completions a forward
(options.batch_size, default 8), on every rank, in eval mode under torch.no_grad, on the run's device in the
run's precision; its weights and one forward are in the plan (trainer/strategy/planning/generation.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer.errors import UserError


def check_path(path: str, key: str) -> Path:
    p = Path(path)
    if not (p / "config.json").is_file():
        raise UserError(f"{key}.options.path: {path} is not a model directory (no config.json there); give the "
                        "directory save_pretrained wrote for a sequence-classification model and its tokenizer")  # fmt: skip
    return p


class RewardModel:
    """A reward function over a sequence-classification model (see the module's doc)."""

    def __init__(self, path: str, *, device: Any, dtype: Any, batch_size: int = 8, template_kwargs: Any = None,
                 key: str = "train.rl.rewards") -> None:  # fmt: skip
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        where = check_path(path, key)
        try:
            self.tok = AutoTokenizer.from_pretrained(where)
            model = AutoModelForSequenceClassification.from_pretrained(where, dtype=dtype)
        except (OSError, ValueError, KeyError) as e:
            raise UserError(f"{key}.options.path: {path} does not load as a sequence-classification model and "
                            f"tokenizer: {e}") from None  # fmt: skip
        if self.tok.pad_token_id is None:
            self.tok.pad_token = self.tok.eos_token
        # the model scores the last token that is not padding: it finds it by the pad token (TRL sets it so)
        model.config.get_text_config().pad_token_id = self.tok.pad_token_id
        self.model = model.to(device).eval().requires_grad_(False)
        self.device, self.batch_size = device, batch_size
        self.template_kwargs = dict(template_kwargs or {})
        self.__name__ = Path(path).name

    def texts(self, prompts: list[Any], completions: list[Any]) -> list[str]:
        if prompts and not isinstance(prompts[0], str):  # chat messages: the reward model's template
            return [self.tok.apply_chat_template([*p, *c], tokenize=False, **self.template_kwargs)
                    for p, c in zip(prompts, completions, strict=True)]  # fmt: skip
        return [p + c for p, c in zip(prompts, completions, strict=True)]

    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        import torch

        texts = self.texts(prompts, completions)
        out: list[float] = []
        with torch.no_grad():
            for at in range(0, len(texts), self.batch_size):
                enc = self.tok(text=texts[at : at + self.batch_size], return_tensors="pt", padding=True,
                               padding_side="right", add_special_tokens=False).to(self.device)  # fmt: skip
                out += self.model(**enc, use_cache=False).logits[:, 0].float().tolist()
        return out
