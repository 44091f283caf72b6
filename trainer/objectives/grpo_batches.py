"""A step's rollouts as micro batches (GRPO's `rollouts`, trainer/objectives/grpo.py): the advantages over the
step (every rank's rewards gathered, in the data's order), each completion a row of [input_ids, labels,
position_ids] after its prompt, the normalisers, and the old and reference per-token log-probs where the
settings need them. `self` is the objective (trainer/objectives/grpo.py: GRPO)."""

from __future__ import annotations

from typing import Any

import torch

from trainer.objectives.grpo_loss import combined, step_normaliser, token_logps


def rollouts(self: Any, stream: Any, scored: Any) -> list[Any]:
    """Advantages over the step (every rank's rewards), rows and normalisers, old and reference log-probs."""
    from trainer.rl.rollout import Rollout

    rows, counts = [], []
    for (completion, ended), i in zip(scored.completions, [p for p in scored.prompts for _ in range(stream.group)],
                                      strict=True):  # fmt: skip
        prompt = [int(t) for t in stream.prompts[i] if t != -100]
        rows.append((prompt, completion))
        counts.append(0.0 if (self.rl.mask_truncated_completions and not ended) else 1.0)
    counts_t = torch.tensor(counts, dtype=torch.float64)
    lengths = torch.tensor([len(c) for _, c in rows], dtype=torch.float64)
    totals = self_sum(self, torch.stack([counts_t.sum(), (lengths * counts_t).sum()]))
    step_norm = (
        None if self.s.loss_type == "bnpo" else step_normaliser(self.s, int(totals[0]), int(totals[1]))
    )
    out = []
    for at in range(0, len(rows), stream.micro):
        part = rows[at : at + stream.micro]
        width = max(len(p) + len(c) for p, c in part)
        arr = torch.full((len(part), 3, width), -100, dtype=torch.long)
        for j, (p, c) in enumerate(part):
            seq = p + c
            arr[j, 0, : len(seq)] = torch.tensor(seq)
            arr[j, 0, len(seq) :] = seq[-1]  # padding after the end: never attended to by the real tokens
            arr[j, 1, len(p) : len(seq)] = torch.tensor(c)
            arr[j, 2] = torch.arange(width)
        c_part = counts_t[at : at + stream.micro]
        if self.s.loss_type == "bnpo":
            norm = float(max((lengths[at : at + stream.micro] * c_part).sum(), 1.0))
        else:
            norm = step_norm / (self.world * self.accum)
        out.append(Rollout(arr, None, counts=c_part, normaliser=norm))
    kl = old_and_reference(self, out)
    adv = step_advantages(self, stream, scored, kl)
    for at, b in zip(range(0, len(rows), stream.micro), out, strict=True):
        b.advantages = adv[at : at + stream.micro]
    return out


def self_sum(self: Any, x: Any) -> Any:
    """x summed over the ranks (float64, on the CPU)."""
    import torch.distributed as dist

    if self.world > 1 and dist.is_initialized():
        x = x.to(self.device)
        dist.all_reduce(x)
        x = x.cpu()
    return x


def gathered(self: Any, local: Any) -> Any:
    """Every rank's `local` (float64) in the ranks' order: the step's, in the data's order."""
    import torch.distributed as dist

    if not (self.world > 1 and dist.is_initialized()):
        return local
    parts = [torch.empty_like(local).to(self.device) for _ in range(self.world)]
    dist.all_gather(parts, local.to(self.device))
    return torch.cat([p.cpu() for p in parts])


def step_advantages(self: Any, stream: Any, scored: Any, kl: Any) -> Any:
    """This rank's advantages from the step's rewards (every rank's; RLOO's with the completions' KL)."""
    from trainer.objectives.grpo_loss import aggregate, loo_advantages

    weights = torch.tensor(self.rl.weights(), dtype=torch.float64)
    local = scored.rewards.to(torch.float64)
    everyone = gathered(self, local)
    if self.rl.advantage == "rloo":
        kl_all = gathered(self, kl) if kl is not None else None
        adv_all, zero_all = loo_advantages(combined(everyone, weights), kl_all, self.rl.num_generations,
                                           self.rl.beta, self.rl.normalize_advantages, self.rl.reward_clip_range)  # fmt: skip
    else:
        adv_all, zero_all = aggregate(everyone, weights, self.rl.num_generations, self.rl.scale_rewards,
                                      self.rl.multi_objective_aggregation)  # fmt: skip
    scored.extra["step"] = (everyone, zero_all, adv_all)  # the step's, every rank's: its metrics (TRL's)
    n = len(local)
    mine = slice(stream.rank * n, (stream.rank + 1) * n) if len(everyone) > n else slice(0, n)
    scored.advantages, scored.zero_std = adv_all[mine], zero_all[mine]
    return adv_all[mine]


def old_and_reference(self: Any, batches: list[Any]) -> Any:
    """num_iterations > 1: the generating policy's log-probs (the old ones); beta > 0: the reference's
    (with LoRA: the model with its adapters off). Without gradients, micro batch by micro batch. RLOO with
    beta > 0: returns each completion's summed (policy - reference) log-probs over its counted tokens (float64,
    this rank's), the KL its reward pays; else None."""
    rloo_kl = self.rl.advantage == "rloo" and self.rl.beta > 0
    if self.rl.num_iterations == 1 and self.rl.beta == 0:
        return None
    ds = self.engine.ds
    was = ds.module.training
    ds.module.train(False)
    kl = []
    try:
        with torch.no_grad():
            for b in batches:
                rows = b.rows.to(self.engine.device)
                old = None
                if self.rl.num_iterations > 1 or rloo_kl:
                    old = token_logps(ds, rows, self.rl.temperature)[0].cpu()
                    b.old = old if self.rl.num_iterations > 1 else None
                if self.rl.beta > 0:
                    with ds.module.disable_adapter():
                        b.ref = token_logps(ds, rows, self.rl.temperature)[0].cpu()
                if rloo_kl:
                    mask = (b.rows[:, 1, 1:] != -100).to(torch.float64) * b.counts.unsqueeze(1)
                    kl.append(((old.double() - b.ref.double()) * mask).sum(-1))
    finally:
        ds.module.train(was)
    return torch.cat(kl) if rloo_kl else None
