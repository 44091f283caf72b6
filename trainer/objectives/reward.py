"""train.objective reward: a reward model, as TRL 1.16's RewardTrainer trains one (`compute_loss`).

The model is the causal family's sequence-classification form with one label (model.head: score;
AutoModelForSequenceClassification, num_labels 1: the language model's head replaced by a `score` layer from the
hidden size to 1, newly initialised from the run's seed). A response's reward is the score at the last token of
its row that is not the pad token (transformers' own pooling, so what is trained is what `function: model` and any
AutoModelForSequenceClassification user read), the pad token the tokenizer's, else its EOS (TRL's rule; the
model's config.pad_token_id is set to it, and exported with it). A pair's loss is

    -log sigmoid(r_chosen - r_rejected - margin)  +  center_rewards_coefficient x (r_chosen + r_rejected)^2

(margin 0 where the data has no margin column; the second term only with train.reward.center_rewards_coefficient),
the mean over the step's pairs however they are split (pairs.py), which is TRL's mean over a batch's pairs plus its
mean of the squares. Metrics: the mean rewards, accuracy (r_chosen > r_rejected) and margin (r_chosen - r_rejected).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from trainer.common.errors import UserError
from trainer.model.score import pad_of, set_pad
from trainer.objectives.pairs import PairObjective


def real_lengths(rows: Any) -> Any:
    """Each row's tokens before its padding: the padding's positions restart at 0 (pack.pack_examples)."""
    pos = rows[:, 2]
    restart = (pos[:, 1:] == 0).to(torch.int64)
    first = torch.argmax(restart, dim=1) + 1
    return torch.where(restart.any(dim=1), first, torch.full_like(first, pos.shape[1]))


class Reward(PairObjective):
    """See the module's doc."""

    name = "reward"
    needs_reference = False

    def __init__(self, settings: Any) -> None:
        self.center = settings.center_rewards_coefficient
        self.margins: dict[str, Any] = {
            "train": None,
            "eval": None,
        }  # each pair's margin (NaN: none), by index
        self.pad_id: int | None = None
        self.sums: Any = None
        self.eval_sums: Any = None
        self.device: Any = "cpu"

    def describe(self) -> str:
        margin = " - margin" if self.margins["train"] is not None else ""
        center = f" + {self.center:g} x (r_c + r_r)^2" if self.center else ""
        return f"reward (-log sigmoid(r_chosen - r_rejected{margin}){center}, the score at each response's last token)"

    def attach(self, data: Any, module: Any) -> None:
        """The data's margins (checked by `check_data`) and pad token, and the model's pad token set to it."""
        for split, margins in (("train", data.margins), ("eval", data.eval_margins)):
            if margins is not None and np.isfinite(margins).any():
                self.margins[split] = margins
        set_pad(module, data.tokenizer)
        self.pad_id = pad_of(data.tokenizer)

    def scores(self, ds: Any, rows: Any) -> Any:
        """Each row's reward: the model's score at its last token that is not the pad token (fp32 at least)."""
        lengths = real_lengths(rows)
        width = int(lengths.max())
        ids = rows[:, 0, :width].clone()
        ids[torch.arange(width, device=ids.device).unsqueeze(0) >= lengths.unsqueeze(1)] = self.pad_id
        out = ds(input_ids=ids, position_ids=rows[:, 2, :width], use_cache=False)
        score = out.logits[:, 0]
        return score.float() if score.dtype in (torch.bfloat16, torch.float16) else score

    def forward(self, ds: Any, batch: Any, training: bool = True, split: str = "train") -> Any:
        """The pairs' losses of one micro batch (stream.Pairs), summed; the rewards counted for the metrics."""
        r = self.scores(ds, batch.rows)
        m = batch.pairs
        rc, rr = r[:m], r[m:]
        margins = self.margins.get(split)
        diff = rc - rr
        if margins is not None:
            diff = diff - torch.as_tensor(margins[batch.index.numpy()], device=rc.device).to(rc.dtype)
        losses = -F.logsigmoid(diff)
        if self.center:
            losses = losses + self.center * (rc + rr) ** 2
        if training or split == "eval":
            self._count(rc.detach(), rr.detach(), rc.detach(), rr.detach(), "train" if training else "eval")
        return losses.sum()

    def flush(self, world_size: int, split: str = "train") -> dict[str, Any]:
        out = super().flush(world_size, split)
        for k in ("logps_chosen", "logps_rejected"):  # (a reward model has no log-probabilities)
            out.pop(k, None)
        return out


def check_data(exp: Any, data: Any) -> None:
    """train.objective reward: the data's pairs checked as soon as the data is built (the run, --prepare-data), each
    split's: a margin that is not a finite number, margins on some pairs only, a margin_field no row has, two
    responses that are the same tokens (exit 2, naming the file's row)."""
    if exp.train.objective != "reward":
        return
    stats = data.finetune or {}
    fix = "give each pair's margin as a number (the chosen response's reward must exceed the rejected one's by it), "
    for key, s, margins in (
        ("data.train", stats, data.margins),
        ("data.eval", stats.get("eval") or {}, data.eval_margins),
    ):
        if s.get("margin_problem"):
            raise UserError(f"{s['margin_problem']}: {fix}or remove the column")
        if s.get("identical"):
            raise UserError(f"{', '.join(s['identical'])}: the chosen and the rejected response are the same text (the "
                            "same tokens), which a reward model cannot rank; fix or remove the pair")  # fmt: skip
        if margins is not None and np.isfinite(margins).any() and not np.isfinite(margins).all():
            raise UserError(f"{key}: {int(np.isfinite(margins).sum())} of {len(margins)} pairs have a margin: {fix}"
                            "0 for none, or remove the column")  # fmt: skip
    for key, src in exp.data.sources:
        if src.margin_field != "margin" and not stats.get("margin_rows"):
            raise UserError(f"{key}.margin_field: {src.margin_field}: no row of {key} has that column; name the column "
                            "of the pairs' margins, or remove margin_field (no margins)")  # fmt: skip
