"""GRPO and its relatives (train.objective: grpo; train.rl): the advantages of a step's completions and the
clipped policy loss of a micro batch, written out as TRL's GRPOTrainer computes them, with normalisers that
do not depend on how the step is split.

Advantages (`advantages`): each completion's reward is the weighted sum of its reward functions' values
(None counts as missing: NaN in the mean; a completion every function left None gets advantage 0); minus
its group's mean (G completions of one prompt); over the group's standard deviation (`scale_rewards:
group`), the whole batch's (`batch`, over every rank's completions of the step), or not scaled (`none`);
+1e-4 in the denominator, as TRL.

The loss of a token t of completion i (ratio r = exp(logp - old_logp), the old log-probs those of the
policy that generated: the current ones, detached, at num_iterations 1, so r = 1 exactly):

    l = -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)   (r capped at delta first, when set)
        + beta (exp(ref - logp) - (ref - logp) - 1)             (beta > 0: the k3 estimate of the KL)

summed over the completion's tokens (mask: its tokens; with mask_truncated_completions a completion that
did not end is out of both the sum and the normaliser) and normalised over the step:

| loss_type | the step's loss | its normaliser |
|---|---|---|
| grpo | mean over completions of each one's token mean | completions of the step |
| dapo | sum over every token of the step | tokens of the step |
| dr_grpo | sum over every token | completions x max_new_tokens |
| bnpo | each micro batch's token mean, averaged (TRL's: the only one that depends on the split) | tokens of the micro batch |

A micro batch's loss is its share of the step's sum over the step's normaliser times ranks x micro steps,
so that DeepSpeed's mean over micro steps and ranks gives the step's loss, however the step is split
(1 rank x 4 micro steps = 2 x 2 = 4 x 1). For one micro batch on one rank every type equals TRL's
`_compute_loss` (tests/unit/test_grpo.py, fp64).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trainer.rl.rewards import combined  # noqa: F401 (the weighted sum: the rewards' own)

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


def nanstd(x: Any, dim: Any = None, keepdim: bool = False) -> Any:
    """Standard deviation ignoring NaNs, with Bessel's correction (TRL's nanstd)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(var, float("nan")))
    out = torch.sqrt(var * correction)  # NaN with fewer than 2 values (TRL's)
    return out if keepdim or dim is None else out.squeeze(dim)


def advantages(rewards: Any, group: int, scale: str) -> tuple[Any, Any]:
    """(advantage of each completion, whether its scale's std is zero), completions in groups of `group`
    consecutive ones; rewards NaN where unscorable (their advantage 0)."""
    mean = torch.nanmean(rewards.view(-1, group), dim=1).repeat_interleave(group)
    if scale in ("group", "none"):
        std = (
            nanstd(rewards.view(-1, group), dim=1).repeat_interleave(group)
            if group > 1
            else torch.zeros_like(rewards)
        )
    elif scale == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        raise ValueError(f"scale_rewards: {scale}")
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0), torch.isclose(std, torch.zeros_like(std))


@dataclass(frozen=True)
class Settings:
    """What the loss reads of train.rl."""

    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    max_new_tokens: int = 256


def token_losses(logps: Any, old: Any, ref: Any, adv: Any, s: Settings) -> tuple[Any, Any, Any, Any]:
    """Per-token loss (rows, tokens), and the low, high and region clip indicators (as TRL logs them)."""
    ratio = torch.exp(logps - old)
    low, high = 1 - s.epsilon, 1 + (s.epsilon if s.epsilon_high is None else s.epsilon_high)
    clipped_ratio = torch.clamp(ratio, low, high)
    capped = torch.clamp(ratio, max=s.delta) if s.delta is not None else ratio
    a = adv.unsqueeze(1) if adv.dim() == 1 else adv
    loss = -torch.min(capped * a, clipped_ratio * a)
    if s.beta != 0.0:
        loss = loss + s.beta * (torch.exp(ref - logps) - (ref - logps) - 1)
    is_low = (ratio < low) & (a < 0)
    is_high = (ratio > high) & (a > 0)
    return loss, is_low, is_high, is_low | is_high


def micro_loss(logps: Any, old: Any, ref: Any, adv: Any, mask: Any, s: Settings, normaliser: float) -> Any:
    """A micro batch's share of the step's loss (see the module's doc): `normaliser` is the step's
    (`step_normaliser`) over ranks x micro steps, or for bnpo this micro batch's tokens."""
    per_token, _, _, _ = token_losses(logps, old, ref, adv, s)
    m = mask.to(per_token.dtype)
    if s.loss_type == "grpo":
        total = ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).sum()
    else:
        total = (per_token * m).sum()
    return total / normaliser


def step_normaliser(s: Settings, completions: int, tokens: int) -> float:
    """The step's normaliser (every rank's completions and their masked tokens) of grpo, dapo, dr_grpo."""
    if s.loss_type == "grpo":
        return float(max(completions, 1))
    if s.loss_type == "dapo":
        return float(max(tokens, 1))
    if s.loss_type == "dr_grpo":
        return float(max(completions, 1) * s.max_new_tokens)
    raise ValueError(f"step_normaliser: {s.loss_type} normalises each micro batch by its own tokens")


def token_logps(ds: Any, rows: Any, temperature: float, entropy: bool = False) -> tuple[Any, Any]:
    """Each completion token's log-probability under the model of logits / temperature (as sampling drew it)
    (rows, width - 1), aligned with the labels after the first position, 0 elsewhere; and the entropy of each
    position's distribution (None unless asked, without gradient)."""
    out = ds(input_ids=rows[:, 0], position_ids=rows[:, 2], use_cache=False)
    logits = out.logits[:, :-1].float() / temperature
    targets = rows[:, 1, 1:]
    mask = targets != -100
    logp_all = torch.log_softmax(logits, dim=-1)
    logps = logp_all.gather(-1, torch.where(mask, targets, 0).unsqueeze(-1)).squeeze(-1) * mask
    ent = None
    if entropy:
        with torch.no_grad():
            ent = -(logp_all.exp() * logp_all).sum(-1)
    return logps, ent


# the per-step sums of the metrics (reduced over ranks at a log step); per reward function: sum, sum of
# squares, count of values (NaN: None)
STATS = ("completions", "groups", "zero_std_groups", "length_sum", "truncated", "reward_sum", "reward_sq",
         "reward_n", "tokens", "clip_low", "clip_high", "clip_region", "kl", "entropy", "generation_s")  # fmt: skip
