"""`function: model` (train.rl.rewards): a local reward model scores completions as TRL's GRPOTrainer scores
them with a sequence-classification model given as a reward function: the prompt and its completion as one
text (chat prompts: the messages and the completion's assistant message rendered by the reward model's own
chat template, with data.chat_template_kwargs; text prompts: the two strings joined), tokenized without
special tokens, padded on the right with the reward model's pad token (its EOS where it has none), and the
first logit of the sequence's last token is the reward. It runs in `batch_size` completions a forward
(options.batch_size, default 8), on every rank, in eval mode under torch.no_grad, on the run's device in the
run's precision; its weights and one forward are in the plan (trainer/strategy/planning/generation.py).
It is loaded as TRL loads one (num_labels=1): a directory whose head has another number of labels, or whose
weights lack the score head (a causal LM's) or others, is refused (they would be newly initialised: noise).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer.common.errors import UserError


def check_path(path: str, key: str) -> Path:
    p = Path(path)
    if not (p / "config.json").is_file():
        raise UserError(f"{key}.options.path: {path} is not a model directory (no config.json there); give the "
                        "directory save_pretrained wrote for a sequence-classification model and its tokenizer")  # fmt: skip
    return p


def check_head(info: dict[str, Any], model: Any, path: str, key: str) -> None:
    """Refuse a model whose head is not one label (TRL's load raises on the size) or whose weights lack some
    of the model's (its score head: a causal LM's directory), which would be newly initialised: noise."""
    what = f"{key}.options.path: {path}: "
    fix = "give a reward model trained with one label (AutoModelForSequenceClassification, num_labels=1)"
    mismatched = list(info.get("mismatched_keys") or [])
    if mismatched:
        name, saved, _ = mismatched[0]
        raise UserError(f"{what}its head has {tuple(saved)[0]} labels ({name} is {list(saved)}), not one label: "
                        f"TRL loads a reward model with num_labels=1 and refuses it; {fix}")  # fmt: skip
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        kind = ", ".join(getattr(model.config, "architectures", None) or []) or "its config.json's model"
        head = "its score head would be newly initialised" if any("score" in k for k in missing) else (
            "weights would be newly initialised")  # fmt: skip
        raise UserError(f"{what}{head} (the directory holds no {', '.join(missing[:3])}"
                        f"{' ...' if len(missing) > 3 else ''}: it was saved as {kind}), so its scores would be "
                        f"noise; {fix}")  # fmt: skip


class RewardModel:
    """A reward function over a sequence-classification model (see the module's doc)."""

    def __init__(self, path: str, *, device: Any, dtype: Any, batch_size: int = 8, template_kwargs: Any = None,
                 key: str = "train.rl.rewards") -> None:  # fmt: skip
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        where = check_path(path, key)
        try:
            self.tok = AutoTokenizer.from_pretrained(where)
            # as TRL loads it (num_labels=1); a head of another size is reported, not raised, to name it
            model, info = AutoModelForSequenceClassification.from_pretrained(
                where, dtype=dtype, num_labels=1, ignore_mismatched_sizes=True, output_loading_info=True
            )
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise UserError(f"{key}.options.path: {path} does not load as a sequence-classification model and "
                            f"tokenizer: {e}") from None  # fmt: skip
        check_head(info, model, path, key)
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
