"""GRPO and its relatives (train.objective: grpo; train.rl): the advantages of a step's completions and the
policy loss of a micro batch, as TRL's GRPOTrainer (1.16) computes them at its defaults and options, with
normalisers that do not depend on how the step is split.

Advantages (`aggregate`): with `multi_objective_aggregation: sum_then_normalize` (TRL's default) each
completion's reward is the weighted sum of its reward functions' values (None counts as missing: NaN in the
mean; a completion every function left None gets advantage 0), minus its group's mean (G completions of one
prompt), over the group's standard deviation (`scale_rewards: group`), the whole step's (`batch`, every
rank's completions) or 1 (`none`), +1e-4 in the denominator. With `normalize_then_sum` (GDPO) each function's
values are normalised within the group first, then summed with the weights, then normalised over the step.

The loss of a token t of completion i, with w = logp - old_logp (`importance_sampling_level: token`) or its
mean over the completion's tokens (`sequence`, GSPO) and the ratio r = exp(w) (the old log-probs those of
the policy that generated: the current ones, detached, at num_iterations 1, so r = 1 exactly):

    grpo, bnpo, dr_grpo, dapo, luspo:  -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)  (r capped at delta)
    cispo:  -sg(min(r, epsilon_high)) A logp                                     (MiniMax-M1)
    sapo:   -sigmoid(tau (r - 1)) 4 / tau A, tau = sapo_temperature_pos / _neg by the sign of A
    vespo:  -sg(phi(W)) A logp, phi(W) = e^lambda W^k e^(-lambda W), W the sequence's product of ratios
    each times the high-entropy mask (top_entropy_quantile < 1), then
    + beta (exp(ref - logp) - (ref - logp) - 1) [x r: use_bias_correction_kl, TRL's default]  (beta > 0)

summed over the completion's tokens (mask: its tokens; with mask_truncated_completions a completion that
did not end is out of both the sum and the normaliser) and normalised over the step:

| loss_type | the step's loss | its normaliser |
|---|---|---|
| grpo, sapo | mean over completions of each one's token mean | completions of the step |
| luspo | mean over completions of each one's token sum | completions of the step |
| dapo, cispo, vespo | sum over every token of the step | tokens of the step |
| dr_grpo | sum over every token | completions x max_new_tokens |
| bnpo | each micro batch's token mean, averaged (TRL's: the only one that depends on the split) | tokens of the micro batch |

A micro batch's loss is its share of the step's sum over the step's normaliser times ranks x micro steps,
so that DeepSpeed's mean over micro steps and ranks gives the step's loss, however the step is split
(1 rank x 4 micro steps = 2 x 2 = 4 x 1). For one micro batch on one rank every type equals TRL's
`_compute_loss`, value and gradient, at TRL's defaults and at every option here but one
(tests/unit/test_grpo_trl.py, fp64, TRL's code called): with mask_truncated_completions TRL zeroes a truncated
completion's tokens but still counts it among the completions it averages over or in its normaliser, so there
grpo, sapo, luspo and dr_grpo are TRL's times B / (B - truncated) (B completions, `TRUNCATED_APART`); bnpo,
dapo, cispo and vespo equal TRL's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from trainer.rl.rewards import combined  # (the weighted sum: the rewards' own)

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # the types whose ratio is clipped (clip metrics)
PER_COMPLETION = ("grpo", "sapo", "luspo")  # normalised by the step's completions
PER_TOKEN = ("dapo", "cispo", "vespo")  # normalised by the step's tokens
# with mask_truncated_completions: TRL's loss times B / (B - truncated) (TRL counts a truncated completion still)
TRUNCATED_APART = ("grpo", "sapo", "luspo", "dr_grpo")


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
    consecutive ones; rewards (combined) NaN where unscorable (their advantage 0)."""
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


def aggregate(
    per_function: Any, weights: Any, group: int, scale: str, how: str = "sum_then_normalize"
) -> tuple[Any, Any]:
    """The step's advantages from its rewards (completions, functions), NaN for None: see the module's doc."""
    if how == "sum_then_normalize":
        return advantages(combined(per_function, weights), group, scale)
    if how != "normalize_then_sum":
        raise ValueError(f"multi_objective_aggregation: {how}")
    k = per_function.shape[1]
    grouped = per_function.view(-1, group, k)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    std = nanstd(grouped, dim=1, keepdim=True) if group > 1 else torch.zeros_like(mean)
    each = ((grouped - mean) / (std + 1e-4)).view(-1, k)
    rewards = combined(each, weights)
    rewards[torch.isnan(per_function).all(dim=1)] = float("nan")
    total = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    adv = (rewards - torch.nanmean(rewards)) / (total + 1e-4)
    return torch.nan_to_num(adv, nan=0.0), torch.isclose(total, torch.zeros_like(total))


def loo_advantages(rewards: Any, kl: Any, group: int, beta: float, normalize: bool,
                   clip: Any = None) -> tuple[Any, Any]:  # fmt: skip
    """RLOO's advantages (TRL's RLOOTrainer): the combined rewards (NaN where unscorable) clipped to `clip`, minus
    beta x each completion's summed log-ratio to the reference `kl`; each minus the mean of its group's other
    scorable completions (a group with one scorable completion: advantage 0); with `normalize`, the step's to mean
    0 and std 1 (+1e-4). Returns (the advantages, whether each group's std of the rewards is zero)."""
    r = rewards if clip is None else rewards.clamp(min=clip[0], max=clip[1])
    if beta != 0.0:
        r = r - beta * kl
    grouped = r.view(-1, group)
    scorable = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    total = torch.nansum(grouped, dim=1, keepdim=True)
    adv = r - ((total - grouped) / (scorable - 1)).view(-1)
    if normalize:
        adv = (adv - torch.nanmean(adv)) / (nanstd(adv) + 1e-4)
    std = nanstd(grouped, dim=1).repeat_interleave(group)
    return torch.nan_to_num(adv, nan=0.0), torch.isclose(std, torch.zeros_like(std))


@dataclass(frozen=True)
class Settings:
    """What the loss reads of train.rl (the defaults: TRL 1.16's GRPOConfig's, max_new_tokens its
    max_completion_length; train.rl's own max_new_tokens default is 64, docs/rl.md)."""

    loss_type: str = "dapo"
    advantage: str = "group"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    max_new_tokens: int = 512
    use_bias_correction_kl: bool = True
    importance_sampling_level: str = "token"
    top_entropy_quantile: float = 1.0
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0

    @property
    def high(self) -> float:
        """epsilon_high, or epsilon where it is not set (TRL's)."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclass
class Terms:
    """A micro batch's per-token loss (rows, tokens) and what the metrics count: the KL term (None with
    beta 0), the clip indicators (rows, tokens), or (rows, 1) at the sequence level, and VESPO's weights."""

    loss: Any
    kl: Any = None
    low: Any = None
    high: Any = None
    phi: Any = None


def gamma_weights(adv: Any, log_ratio: Any, mask: Any, s: Settings) -> Any:
    """VESPO's phi(W) per completion (rows, 1), no gradient: W = exp(sum of the token log-ratios), each
    clamped to [-20, 20], the sum to [log 1e-8, 20]; phi = exp(lambda + k log W - lambda W), 0 where not finite."""
    with torch.no_grad():
        low = math.log(1e-8)
        log_w = torch.clamp((torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True), low, 20.0)
        positive = adv >= 0
        k = torch.where(positive, s.vespo_k_pos, s.vespo_k_neg)
        lam = torch.where(positive, s.vespo_lambda_pos, s.vespo_lambda_neg).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def token_losses(logps: Any, old: Any, ref: Any, adv: Any, mask: Any, s: Settings, keep: Any = None) -> Terms:
    """Per-token loss and its metrics' terms (see the module's doc); `keep`: the high-entropy mask (or None)."""
    a = adv.unsqueeze(1) if adv.dim() == 1 else adv
    m = mask.to(logps.dtype)
    log_ratio = logps - old
    if s.importance_sampling_level == "sequence":
        w = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    elif s.importance_sampling_level == "token":
        w = log_ratio
    else:
        raise ValueError(f"importance_sampling_level: {s.importance_sampling_level}")
    if s.advantage == "rloo":  # TRL's RLOOTrainer: the whole completion's ratio, the KL in the reward
        ratio = torch.exp((log_ratio * m).sum(-1, keepdim=True))
        low, high = 1 - s.epsilon, 1 + s.high
        t = Terms(loss=-torch.min(ratio * a, torch.clamp(ratio, low, high) * a))
        t.low, t.high = (ratio < low) & (a < 0), (ratio > high) & (a > 0)
        if ref is not None:  # the metric only: (old - ref), as TRL logs it
            t.kl = (old - ref).detach()
        return t
    ratio = torch.exp(w)
    t = Terms(loss=None)
    if s.beta != 0.0:
        t.kl = torch.exp(ref - logps) - (ref - logps) - 1
        if s.use_bias_correction_kl:  # the ratio's gradient even where it is 1 (DeepSeek-V3.2)
            t.kl = t.kl * ratio
    if s.loss_type == "cispo":
        t.loss = -torch.clamp(ratio, max=s.high).detach() * a * logps
        t.high, t.low = (ratio > s.high) & (a > 0), torch.zeros_like(ratio, dtype=torch.bool)
    elif s.loss_type == "sapo":
        tau = torch.where(a > 0, s.sapo_temperature_pos, s.sapo_temperature_neg)
        t.loss = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * a
    elif s.loss_type == "vespo":
        t.phi = gamma_weights(a, log_ratio, m, s)
        t.loss = -t.phi * a * logps
    elif s.loss_type in CLIPPED:
        low, high = 1 - s.epsilon, 1 + s.high
        capped = torch.clamp(ratio, max=s.delta) if s.delta is not None else ratio
        t.loss = -torch.min(capped * a, torch.clamp(ratio, low, high) * a)
        t.low, t.high = (ratio < low) & (a < 0), (ratio > high) & (a > 0)
    else:
        raise ValueError(f"loss_type: {s.loss_type}")
    if keep is not None:
        t.loss = t.loss * keep
    if t.kl is not None:
        t.loss = t.loss + s.beta * t.kl
    return t


def micro_loss(logps: Any, old: Any, ref: Any, adv: Any, mask: Any, s: Settings, normaliser: float,
               keep: Any = None) -> Any:  # fmt: skip
    """A micro batch's share of the step's loss (see the module's doc): `normaliser` is the step's
    (`step_normaliser`) over ranks x micro steps, or for bnpo this micro batch's tokens."""
    return reduce(token_losses(logps, old, ref, adv, mask, s, keep).loss, mask, s, normaliser)


def reduce(per_token: Any, mask: Any, s: Settings, normaliser: float) -> Any:
    m = mask.to(per_token.dtype)
    if s.advantage == "rloo":  # a loss a completion (rows, 1): over the completions counted
        return (per_token[:, 0] * (m.sum(-1) > 0)).sum() / normaliser
    if s.loss_type in ("grpo", "sapo"):
        total = ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).sum()
    else:
        total = (per_token * m).sum()
    return total / normaliser


def step_normaliser(s: Settings, completions: int, tokens: int) -> float:
    """The step's normaliser (every rank's completions and their masked tokens) of every type but bnpo."""
    if s.advantage == "rloo":
        return float(max(completions, 1))
    if s.loss_type in PER_COMPLETION:
        return float(max(completions, 1))
    if s.loss_type in PER_TOKEN:
        return float(max(tokens, 1))
    if s.loss_type == "dr_grpo":
        return float(max(completions, 1) * s.max_new_tokens)
    raise ValueError(f"step_normaliser: {s.loss_type} normalises each micro batch by its own tokens")


def high_entropy(ent: Any, mask: Any, quantile: float, world: int = 1) -> Any:
    """top_entropy_quantile: the tokens whose entropy is at least the (1 - quantile) quantile of the micro
    batch's completion tokens over every rank (TRL's: of one micro batch, so it depends on the split)."""
    import torch.distributed as dist

    local = ent[mask.bool()].float()
    if world > 1 and dist.is_initialized():
        n = torch.tensor([local.numel()], device=local.device)
        sizes = [torch.zeros_like(n) for _ in range(world)]
        dist.all_gather(sizes, n)
        width = int(max(int(x) for x in sizes))
        padded = torch.full((width,), -1e9, dtype=local.dtype, device=local.device)
        padded[: local.numel()] = local
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded)
        local = torch.cat(parts)
        local = local[local != -1e9]
    if local.numel() == 0:
        return torch.zeros_like(ent, dtype=torch.bool)
    threshold = torch.quantile(local, 1 - quantile)
    return ((ent * mask) >= threshold) & mask.bool()


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


# a rank's sums of the metrics over a log interval (reduced over the ranks at a log step: grpo_metrics.py)
STATS = ("completions", "length_sum", "truncated", "generation_s", "tokens", "clip_low", "clip_high", "clip_region",
         "clip_n", "kl", "entropy", "phi", "phi_n")  # fmt: skip
