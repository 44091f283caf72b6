"""GRPO's metrics (trainer/objectives/grpo.py), as TRL's GRPOTrainer logs them.

Of a generation (steps that generate only: with num_iterations > 1 the steps that reuse one log none of
these, as TRL): each reward function's mean and std and the combined reward's over the step's completions
of every rank (`reward_std` is the step's Bessel-corrected std, TRL's), the share of completions whose
advantage's std was zero (`zero_std_share`: TRL's frac_reward_zero_std), the completions' mean and longest
length and truncated share, generation's time, and what the reward functions logged with `log_metric` (a
name the run logs itself under log_metric/<name>); a log line averages them over the interval's generations
(NaN values left out, as TRL).
Of every micro step: the clip ratios (low, high and region: of tokens, or of completions at the sequence
level), the KL when beta > 0 (with its ratio correction where the loss has it), the entropy, VESPO's weight;
pooled over the interval's tokens (TRL averages its micro batches' ratios), reduced over the ranks at a log
step."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch

from trainer.metrics.recorder import FIELDS
from trainer.objectives.grpo_loss import CLIPPED, STATS, nanstd

# the names GRPO logs itself (and reward_<label>, reward_<label>_std): a reward function's log_metric of one of
# these, of a field of the run's record (recorder.FIELDS, the tags), of an eval_ name or of one under the prefix
# is written as log_metric/<name> (docs/rl.md)
OWN = ("reward", "reward_std", "zero_std_share", "rounds", "completion_length", "completion_length_max",
       "truncated_share", "generation_s", "generation_share", "clip_low", "clip_high", "clip_region", "entropy",
       "kl", "vespo_phi")  # fmt: skip
PREFIX = "log_metric/"


class RLMetrics:
    def __init__(self, rl: Any) -> None:
        self.rl = rl
        self.device: Any = "cpu"
        self.sums: Any = None  # STATS, this rank's, since the last log line
        self.steps: list[dict[str, float]] = []  # each generation's metrics (the same on every rank)
        self.user: list[dict[str, list[float]]] = []  # each generation's log_metric values (this rank's)
        self.pending: dict[str, list[float]] = defaultdict(list)
        self.max_length = 0
        self.t0: float | None = None
        self.completions: Any = None  # trainer/rl/completions.py: CompletionLog, where log_completions > 0
        self.reserved: set[str] = {*FIELDS, *OWN}  # rl.prepare adds the run's tags

    def log_metric(self, name: str, value: float) -> None:
        """A reward function's `log_metric(name, value)` (TRL's): averaged over the generation and the ranks;
        a name the run logs itself is the function's under log_metric/<name>."""
        self.pending[self.metric_name(str(name))].append(float(value))

    def metric_name(self, name: str) -> str:
        taken = name in self.reserved or name.startswith(("reward_", "eval_", PREFIX))
        return PREFIX + name if taken else name

    def count_loss(self, mask: Any, terms: Any, ent: Any) -> None:
        at = {k: i for i, k in enumerate(STATS)}
        row = torch.zeros(len(STATS), dtype=torch.float64, device=mask.device)
        m = mask.to(torch.float64)
        row[at["tokens"]] = m.sum()
        if terms.high is not None:
            if terms.high.shape[1] == 1:  # the sequence level: a ratio a completion, counted a completion
                n, of = float(terms.high.shape[0]), lambda x: x.to(torch.float64).sum()  # noqa: E731
            else:
                n, of = m.sum(), lambda x: (x.to(torch.float64) * m).sum()  # noqa: E731
            row[at["clip_low"]], row[at["clip_high"]] = of(terms.low), of(terms.high)
            row[at["clip_region"]], row[at["clip_n"]] = of(terms.low | terms.high), n
        if terms.kl is not None:
            row[at["kl"]] = (terms.kl.expand_as(m) * m).sum()
        if terms.phi is not None:
            row[at["phi"]], row[at["phi_n"]] = terms.phi.to(torch.float64).sum(), float(terms.phi.shape[0])
        row[at["entropy"]] = (ent * m).sum()
        self._add(row)

    def count_generation(self, scored: Any, rewards: list[Any]) -> None:
        """A generation: its metrics over every rank's completions (`scored.extra["step"]`: the step's rewards,
        whether each one's std was zero), its lengths (this rank's, summed over the ranks at a log step)."""
        from trainer.objectives.grpo_loss import combined

        everyone, zero, _ = scored.extra["step"]
        step: dict[str, float] = {}
        for j, r in enumerate(rewards):
            col = everyone[:, j]
            label = getattr(r, "label", r.name)  # (a path's function name: TRL's rewards/<name>/mean)
            step[f"reward_{label}"] = float(torch.nanmean(col))
            step[f"reward_{label}_std"] = float(nanstd(col))
        total = combined(everyone, torch.tensor(self.rl.weights(), dtype=everyone.dtype))
        step["reward"], step["reward_std"] = float(torch.nanmean(total)), float(nanstd(total))
        step["zero_std_share"] = float(zero.to(torch.float64).mean())
        step["rounds"] = float(scored.extra.get("rounds", 1))
        self.steps.append(step)
        self.user.append(dict(self.pending))
        self.pending.clear()
        lengths = torch.tensor([len(c) for c, _ in scored.completions], dtype=torch.float64)
        at = {k: i for i, k in enumerate(STATS)}
        row = torch.zeros(len(STATS), dtype=torch.float64)
        row[at["completions"]] = len(lengths)
        row[at["length_sum"]] = lengths.sum()
        row[at["truncated"]] = sum(1 for _, ended in scored.completions if not ended)
        row[at["generation_s"]] = scored.seconds
        self.max_length = max(self.max_length, int(lengths.max()) if len(lengths) else 0)
        self._add(row.to(self.device))
        if self.completions is not None:
            self.completions.keep(scored, rewards)

    def _add(self, row: Any) -> None:
        if self.sums is None:
            self.sums = torch.zeros(len(STATS), dtype=torch.float64, device=self.device)
        self.sums += row.to(self.sums.device)

    def flush(self, world_size: int) -> dict[str, Any]:
        """The interval's metrics over every rank (every rank calls it: one all-reduce, and the names the
        reward functions logged gathered)."""
        import time

        import torch.distributed as dist

        distributed = dist.is_initialized() and world_size > 1
        sums = (
            self.sums
            if self.sums is not None
            else torch.zeros(len(STATS), dtype=torch.float64, device=self.device)
        )
        user = sorted({k for u in self.user for k in u})
        if distributed:
            names: list[Any] = [None] * world_size
            dist.all_gather_object(names, user)
            user = sorted({k for n in names for k in n})
        # per generation and name: the sum and the count of what the functions logged (TRL: over the ranks)
        logged = torch.tensor([[f(u.get(k, [])) for k in user for f in (sum, len)] for u in self.user] or [[]],
                              dtype=torch.float64, device=sums.device)  # fmt: skip
        longest = torch.tensor([self.max_length], dtype=torch.float64, device=sums.device)
        if distributed:
            dist.all_reduce(sums)
            if user:
                dist.all_reduce(logged)
            dist.all_reduce(longest, op=dist.ReduceOp.MAX)  # every rank's longest completion
        s = {name: float(v) for name, v in zip(STATS, sums.tolist(), strict=True)}
        out: dict[str, Any] = {}
        if self.steps:  # the interval generated: its generations' metrics, averaged (NaN left out)
            for key in self.steps[-1]:
                if key == "rounds" and not self.rl.dynamic_sampling:
                    continue
                valid = [st[key] for st in self.steps if key in st and not math.isnan(st[key])]
                if valid:
                    out[key] = sum(valid) / len(valid)
            n = max(s["completions"], 1.0)
            out.update({"completion_length": s["length_sum"] / n, "completion_length_max": int(longest[0]),
                        "truncated_share": s["truncated"] / n,
                        "generation_s": s["generation_s"] / max(world_size, 1)})  # fmt: skip
            for i, k in enumerate(user):
                per = [
                    (a / c)
                    for a, c in zip(logged[:, 2 * i].tolist(), logged[:, 2 * i + 1].tolist(), strict=True)
                    if c
                ]
                if per:
                    out[k] = sum(per) / len(per)
        tokens = max(s["tokens"], 1.0)
        if self.rl.loss_type in (*CLIPPED, "cispo") and s["clip_n"]:
            clip_n = s["clip_n"]
            out.update({"clip_low": s["clip_low"] / clip_n, "clip_high": s["clip_high"] / clip_n,
                        "clip_region": s["clip_region"] / clip_n})  # fmt: skip
        if s["tokens"]:
            out["entropy"] = s["entropy"] / tokens
            if self.rl.beta > 0:
                out["kl"] = s["kl"] / tokens
        if s["phi_n"]:
            out["vespo_phi"] = s["phi"] / s["phi_n"]
        now = time.perf_counter()
        elapsed = now - self.t0 if self.t0 is not None else None
        self.t0 = now
        if elapsed and "generation_s" in out:
            out["generation_share"] = min(1.0, out["generation_s"] / elapsed)
        if self.completions is not None and self.steps:
            self.completions.write()
        self.sums, self.steps, self.user, self.max_length = None, [], [], 0
        return out
