"""Training objectives beyond the next-token loss: the preference objectives, one module per family.

- `pairs.py`: what every preference objective shares: each response's log-probability under the
  policy (one forward over the micro batch's chosen and rejected rows together), the per-step metrics
  users read (rewards, margin, accuracy, log-probs), and the loss of a micro batch: the mean of its
  pairs' losses (every micro batch holds as many pairs, so DeepSpeed's mean over micro batches and
  ranks is the mean over the step's pairs however the global batch is split);
- `reference_based.py`: DPO (with label smoothing) and IPO, against the reference's log-probs;
- `reference_free.py`: SimPO and ORPO;
- `reference.py`: the reference's log-probs, computed once before training from the model as it
  starts (with LoRA: the base, the adapters adding nothing yet) and cached with the data;
- `kto.py`: KTO over unpaired rows (each beside its mismatched pair), against the reference's log-probs;
- `reward.py`: a reward model (train.objective reward): TRL's RewardTrainer's loss over each pair's scores;
- `grpo.py`: GRPO and its relatives (train.objective: grpo): the advantages of a step's completions and
  the clipped policy loss (generation and rewards: trainer/rl/).

`make(exp)` gives the objective of train.objective (None for sft: the model's own loss).
"""

from __future__ import annotations

from typing import Any

from trainer.objectives.pairs import PairObjective


def check_data(exp: Any, data: Any) -> None:
    """What the objective needs of the data, checked as soon as it is built (exit 2): reward's pairs."""
    from trainer.objectives.reward import check_data as reward_data

    reward_data(exp, data)


def make(exp: Any) -> Any:
    """train.objective's objective, or None for sft."""
    from trainer.objectives.reference_based import DPO, IPO
    from trainer.objectives.reference_free import ORPO, SimPO

    if exp.train.objective == "grpo":
        from trainer.objectives.grpo import GRPO

        return GRPO(exp.train.rl, 1, exp.train.grad_accum)  # its world is set when the run is prepared

    if exp.train.objective == "kto":
        from trainer.objectives.kto import KTO

        return KTO(exp.train.preference, exp.train.kto)
    if exp.train.objective == "reward":
        from trainer.objectives.reward import Reward

        return Reward(exp.train.reward)
    kinds = {"dpo": DPO, "ipo": IPO, "simpo": SimPO, "orpo": ORPO}
    name = exp.train.objective
    return kinds[name](exp.train.preference) if name in kinds else None


__all__ = ["PairObjective", "make"]
