"""GRPO's metrics (trainer/objectives/grpo.py): each reward function's mean and std and the combined
reward's, the share of groups whose rewards are all equal, the completions' length and truncated share,
the clip ratios (low, high, region), the KL when beta > 0, the entropy, and generation's share of the
time; summed over a log interval's steps and reduced over the ranks at a log step."""

from __future__ import annotations

from typing import Any

import torch

from trainer.objectives.grpo_loss import STATS


class RLMetrics:
    def __init__(self, rl: Any) -> None:
        self.rl = rl
        self.device: Any = "cpu"
        self.names: list[str] = []
        self.sums: Any = None
        self.max_length = 0
        self.t0: float | None = None

    def count_loss(self, mask: Any, low: Any, high: Any, region: Any, kl: Any, ent: Any) -> None:
        at = {k: i for i, k in enumerate(STATS)}
        row = torch.zeros(len(STATS), dtype=torch.float64, device=mask.device)
        row[at["tokens"]] = mask.sum()
        row[at["clip_low"]] = (low * mask).sum()
        row[at["clip_high"]] = (high * mask).sum()
        row[at["clip_region"]] = (region * mask).sum()
        row[at["kl"]] = (kl * mask).sum()
        row[at["entropy"]] = (ent * mask).sum()
        self._add(row)

    def count_generation(self, scored: Any, rewards: list[Any]) -> None:
        from trainer.objectives.grpo_loss import combined

        self.names = [r.name for r in rewards]
        r = scored.rewards
        total = combined(r, torch.tensor(self.rl.weights(), dtype=torch.float64))
        cols = torch.cat([r, total.unsqueeze(1)], dim=1)  # every function's, then the combined reward
        ok = ~torch.isnan(cols)
        vals = torch.nan_to_num(cols, nan=0.0)
        lengths = torch.tensor([len(c) for c, _ in scored.completions], dtype=torch.float64)
        g = self.rl.num_generations
        row = torch.zeros(len(STATS) + 3 * cols.shape[1], dtype=torch.float64)
        at = {k: i for i, k in enumerate(STATS)}
        row[at["completions"]] = len(lengths)
        row[at["groups"]] = len(lengths) // g
        row[at["zero_std_groups"]] = (
            float(scored.zero_std.reshape(-1, g)[:, 0].sum()) if scored.zero_std is not None else 0
        )
        row[at["length_sum"]] = lengths.sum()
        row[at["truncated"]] = sum(1 for _, ended in scored.completions if not ended)
        row[at["generation_s"]] = scored.seconds
        k = len(STATS)
        row[k : k + cols.shape[1]] = vals.sum(0)
        row[k + cols.shape[1] : k + 2 * cols.shape[1]] = (vals**2).sum(0)
        row[k + 2 * cols.shape[1] :] = ok.sum(0)
        self.max_length = max(self.max_length, int(lengths.max()) if len(lengths) else 0)
        self._add(row.to(self.device))

    def _add(self, row: Any) -> None:
        """Add a row of sums: STATS (a micro batch's loss terms), then the rewards' (a generation's)."""
        if self.sums is None:
            self.sums = torch.zeros(
                len(STATS) + 3 * (len(self.names) + 1), dtype=torch.float64, device=self.device
            )
        self.sums[: len(row)] += row.to(self.sums.device)

    def flush(self, world_size: int) -> dict[str, Any]:
        """The interval's metrics over every rank (one all-reduce; every rank calls it)."""
        import time

        import torch.distributed as dist

        k = len(STATS)
        f = len(self.names) + 1
        sums = (
            self.sums
            if self.sums is not None
            else torch.zeros(k + 3 * f, dtype=torch.float64, device=self.device)
        )
        longest = torch.tensor([self.max_length], dtype=torch.float64, device=sums.device)
        if dist.is_initialized() and world_size > 1:
            dist.all_reduce(sums)
            dist.all_reduce(longest, op=dist.ReduceOp.MAX)  # every rank's longest completion
        self.sums = None
        s = {name: float(v) for name, v in zip(STATS, sums[:k].tolist(), strict=True)}
        out: dict[str, Any] = {}
        n = max(s["completions"], 1.0)
        tokens = max(s["tokens"], 1.0)
        for j, name in enumerate([*self.names, "reward"]):
            total, sq, cnt = (float(sums[k + j]), float(sums[k + f + j]), float(sums[k + 2 * f + j]))
            mean = total / max(cnt, 1.0)
            std = max(sq / max(cnt, 1.0) - mean**2, 0.0) ** 0.5
            key = "reward" if name == "reward" else f"reward_{name}"
            out[key], out[f"{key}_std"] = mean, std
        now = time.perf_counter()
        elapsed = now - self.t0 if self.t0 is not None else None
        self.t0 = now
        out.update({
            "zero_std_share": s["zero_std_groups"] / max(s["groups"], 1.0),
            "completion_length": s["length_sum"] / n, "completion_length_max": int(longest[0]),
            "truncated_share": s["truncated"] / n, "clip_low": s["clip_low"] / tokens,
            "clip_high": s["clip_high"] / tokens, "clip_region": s["clip_region"] / tokens,
            "entropy": s["entropy"] / tokens, "generation_s": s["generation_s"] / max(world_size, 1),
        })  # fmt: skip
        if self.rl.beta > 0:
            out["kl"] = s["kl"] / tokens
        if elapsed:
            out["generation_share"] = min(1.0, out["generation_s"] / elapsed)
        self.max_length = 0
        return out
