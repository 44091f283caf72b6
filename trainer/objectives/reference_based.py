"""The objectives against a reference (its log-probs: reference.py): DPO and IPO."""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F

from trainer.objectives.pairs import PairObjective


class DPO(PairObjective):
    """Direct Preference Optimization (Rafailov et al. 2023): -log sigmoid(beta (chosen log-ratio -
    rejected log-ratio)), the log-ratios against the reference; with label smoothing e, the
    conservative form -(1 - e) log sigmoid(beta d) - e log sigmoid(-beta d) (e = 0: TRL's sigmoid loss).
    Rewards: beta x each response's log-ratio."""

    name = "dpo"
    needs_reference = True
    default_beta = 0.1

    def describe(self) -> str:
        smooth = f", label smoothing {self.label_smoothing:g}" if self.label_smoothing else ""
        return f"dpo (beta {self.beta:g}{smooth})"

    def pair_losses(self, c: Any, r: Any, nc: Any, nr: Any, ref: Any) -> tuple[Any, Any, Any]:
        chosen, rejected = c - ref[:, 0], r - ref[:, 1]
        d = self.beta * (chosen - rejected)
        e = self.label_smoothing
        losses = -F.logsigmoid(d) if e == 0 else -(1 - e) * F.logsigmoid(d) - e * F.logsigmoid(-d)
        return losses, self.beta * chosen, self.beta * rejected


class IPO(PairObjective):
    """Identity Preference Optimization (Azar et al. 2023): (d - 1 / (2 beta))^2, d the difference of
    the responses' log-ratios each averaged over its tokens (TRL's normalisation, which the IPO authors
    confirmed). Rewards as DPO's."""

    name = "ipo"
    needs_reference = True
    default_beta = 0.1

    def pair_losses(self, c: Any, r: Any, nc: Any, nr: Any, ref: Any) -> tuple[Any, Any, Any]:
        chosen, rejected = c - ref[:, 0], r - ref[:, 1]
        d = chosen / nc.clamp(min=1) - rejected / nr.clamp(min=1)
        return (d - 1 / (2 * self.beta)) ** 2, self.beta * chosen, self.beta * rejected
