"""train.objective: grpo -- GRPO and its relatives (train.rl; docs/rl.md): the objective of a run. The math
(advantages, the clipped loss and its normalisers: grpo_loss.py), a step's rollouts as micro batches
(grpo_batches.py) and the metrics (grpo_metrics.py) are its own modules; generation and the rewards are
trainer/rl/."""

from __future__ import annotations

from typing import Any

import torch

from trainer.objectives.grpo_loss import (  # noqa: F401 (the math, re-exported)
    LOSS_TYPES,
    STATS,
    Settings,
    advantages,
    aggregate,
    combined,
    high_entropy,
    micro_loss,
    nanstd,
    reduce,
    step_normaliser,
    token_logps,
    token_losses,
)


class GRPO:
    """train.objective: grpo (train.rl): the loss of a micro batch of rollouts; the step's rollouts
    (trainer/rl/batches.py) and the metrics (trainer/rl/metrics.py) are built beside it. See the module's doc."""

    name = "grpo"
    needs_reference = False

    def __init__(self, rl: Any, world: int, accum: int) -> None:
        from trainer.objectives.grpo_metrics import RLMetrics

        self.rl, self.world, self.accum = rl, world, accum
        self.s = settings(rl)
        self.engine: Any = None
        self.metrics = RLMetrics(rl)

    @property
    def device(self) -> Any:
        return self.metrics.device

    @device.setter
    def device(self, value: Any) -> None:
        self.metrics.device = value

    def describe(self) -> str:
        r = self.rl
        if r.advantage == "rloo":
            clip = f"epsilon {r.epsilon:g}" + (f"/{r.epsilon_high:g}" if r.epsilon_high is not None else "")
            more = (", advantages normalised over the step" if r.normalize_advantages else "") + (
                f", rewards clipped to {list(r.reward_clip_range)}" if r.reward_clip_range else "")  # fmt: skip
            kl = "no reference" if r.beta == 0 else "the KL to the reference in the reward"
            return (f"rloo ({r.num_generations} completions a prompt, a leave-one-out baseline, the ratio of each "
                    f"whole completion clipped at {clip}, beta {r.beta:g}: {kl}, num_iterations "
                    f"{r.num_iterations}{more})")  # fmt: skip
        clip = f"epsilon {r.epsilon:g}" + (f"/{r.epsilon_high:g}" if r.epsilon_high is not None else "")
        more = [f"importance sampling at the {r.importance_sampling_level} level"]
        if r.multi_objective_aggregation != "sum_then_normalize":
            more.append(f"rewards {r.multi_objective_aggregation.replace('_', ' ')}")
        if r.top_entropy_quantile < 1:
            more.append(f"the policy term on the top {r.top_entropy_quantile:g} of tokens by entropy")
        kl = ", KL corrected by the ratio" if r.beta and r.use_bias_correction_kl else ""
        return (f"grpo ({r.loss_type}, {r.num_generations} completions a prompt, rewards scaled by {r.scale_rewards}, "
                f"{clip}, beta {r.beta:g}{', no reference' if r.beta == 0 else kl}, num_iterations {r.num_iterations}, "
                f"{', '.join(more)})")  # fmt: skip

    def rollouts(self, stream: Any, scored: Any) -> list[Any]:
        from trainer.objectives.grpo_batches import rollouts

        return rollouts(self, stream, scored)

    def loss(self, ds: Any, batch: Any) -> Any:
        """A micro batch's share of the step's loss (micro_loss), its clip, KL and entropy counted."""
        logps, ent = token_logps(ds, batch.rows, self.rl.temperature, entropy=True)
        mask = (batch.rows[:, 1, 1:] != -100).to(logps.dtype) * batch.counts.to(logps.dtype).unsqueeze(1)
        adv = batch.advantages.to(logps.dtype)
        old = batch.old.to(logps) if batch.old is not None else logps.detach()
        ref = batch.ref.to(logps) if batch.ref is not None else None
        keep = (
            high_entropy(ent, mask, self.s.top_entropy_quantile, self.world)
            if self.s.top_entropy_quantile < 1
            else None
        )
        terms = token_losses(logps, old, ref, adv, mask, self.s, keep)
        loss = reduce(terms.loss, mask, self.s, batch.normaliser)
        with torch.no_grad():
            self.metrics.count_loss(mask, terms, ent)
        return loss

    def count_generation(self, scored: Any, rewards: list[Any]) -> None:
        self.metrics.count_generation(scored, rewards)

    def flush(self, world_size: int, split: str = "train") -> dict[str, Any]:
        return self.metrics.flush(world_size)


def settings(rl: Any) -> Settings:
    """The loss's settings from train.rl."""
    names = Settings.__dataclass_fields__
    return Settings(**{k: getattr(rl, k) for k in names})
