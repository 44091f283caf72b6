"""The reference-free objectives: SimPO and ORPO (no reference log-probs, no second pass)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from trainer.objectives.pairs import PairObjective


class SimPO(PairObjective):
    """SimPO (Meng et al. 2024): -log sigmoid(beta (mean chosen log-prob - mean rejected log-prob) -
    gamma), each response's log-prob averaged over its tokens. Rewards: beta x the averages."""

    name = "simpo"
    default_beta = 2.0

    def describe(self) -> str:
        return f"simpo (beta {self.beta:g}, gamma {self.gamma:g})"

    def pair_losses(self, c: Any, r: Any, nc: Any, nr: Any, ref: Any) -> tuple[Any, Any, Any]:
        ac, ar = c / nc.clamp(min=1), r / nr.clamp(min=1)
        return -F.logsigmoid(self.beta * (ac - ar) - self.gamma), self.beta * ac, self.beta * ar


class ORPO(PairObjective):
    """ORPO (Hong et al. 2024): the chosen response's negative log-likelihood (mean over its tokens)
    minus beta x log sigmoid(log odds ratio), the odds p / (1 - p) of each response's mean token
    probability p. Rewards: beta x the mean log-probs (as TRL logs them)."""

    name = "orpo"
    default_beta = 0.1

    def pair_losses(self, c: Any, r: Any, nc: Any, nr: Any, ref: Any) -> tuple[Any, Any, Any]:
        ac, ar = c / nc.clamp(min=1), r / nr.clamp(min=1)
        log_odds = (ac - ar) - (torch.log1p(-torch.exp(ac)) - torch.log1p(-torch.exp(ar)))  # TRL's, unclamped
        return -ac - self.beta * F.logsigmoid(log_odds), self.beta * ac, self.beta * ar
