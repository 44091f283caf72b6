"""A step's rollouts as micro batches (GRPO's `rollouts`, trainer/objectives/grpo.py): the advantages over the
step (every rank's rewards gathered, in the data's order), each completion a row of [input_ids, labels,
position_ids] after its prompt, the normalisers, and the old and reference per-token log-probs where the
settings need them. `self` is the objective (trainer/objectives/grpo.py: GRPO)."""

from __future__ import annotations

from typing import Any

import torch

from trainer.objectives.grpo_loss import step_normaliser, token_logps


def rollouts(self: Any, stream: Any, scored: Any) -> list[Any]:
    """Advantages over the step (every rank's rewards), rows and normalisers, old and reference log-probs."""
    import torch.distributed as dist

    from trainer.objectives.grpo_loss import aggregate
    from trainer.rl.rollout import Rollout

    weights = torch.tensor(self.rl.weights(), dtype=torch.float64)
    local = scored.rewards.to(torch.float64)
    everyone = local
    distributed = self.world > 1 and dist.is_initialized()
    if distributed:  # the step's completions in the data's order (rank r holds the r-th slice)
        parts = [torch.empty_like(local).to(self.device) for _ in range(self.world)]
        dist.all_gather(parts, local.to(self.device))
        everyone = torch.cat([p.cpu() for p in parts])
    adv_all, zero_all = aggregate(everyone, weights, self.rl.num_generations, self.rl.scale_rewards,
                                  self.rl.multi_objective_aggregation)  # fmt: skip
    scored.extra["step"] = (everyone, zero_all, adv_all)  # the step's, every rank's: its metrics (TRL's)
    n = len(local)
    mine = slice(stream.rank * n, (stream.rank + 1) * n) if distributed else slice(0, n)
    adv, zero = adv_all[mine], zero_all[mine]
    scored.advantages, scored.zero_std = adv, zero
    rows, counts = [], []
    for (completion, ended), i in zip(scored.completions, [p for p in scored.prompts for _ in range(stream.group)],
                                      strict=True):  # fmt: skip
        prompt = [int(t) for t in stream.prompts[i] if t != -100]
        rows.append((prompt, completion))
        counts.append(0.0 if (self.rl.mask_truncated_completions and not ended) else 1.0)
    counts_t = torch.tensor(counts, dtype=torch.float64)
    lengths = torch.tensor([len(c) for _, c in rows], dtype=torch.float64)
    totals = torch.stack([counts_t.sum(), (lengths * counts_t).sum()])
    if distributed:
        totals = totals.to(self.device)
        dist.all_reduce(totals)
        totals = totals.cpu()
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
        out.append(Rollout(arr, adv[at : at + stream.micro], counts=c_part, normaliser=norm))
    old_and_reference(self, out)
    return out


def old_and_reference(self: Any, batches: list[Any]) -> None:
    """num_iterations > 1: the generating policy's log-probs (the old ones); beta > 0: the reference's
    (with LoRA: the model with its adapters off). Without gradients, micro batch by micro batch."""
    if self.rl.num_iterations == 1 and self.rl.beta == 0:
        return
    ds = self.engine.ds
    was = ds.module.training
    ds.module.train(False)
    try:
        with torch.no_grad():
            for b in batches:
                rows = b.rows.to(self.engine.device)
                if self.rl.num_iterations > 1:
                    b.old = token_logps(ds, rows, self.rl.temperature)[0].cpu()
                if self.rl.beta > 0:
                    with ds.module.disable_adapter():
                        b.ref = token_logps(ds, rows, self.rl.temperature)[0].cpu()
    finally:
        ds.module.train(was)
