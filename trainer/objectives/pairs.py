"""What the preference objectives share (see __init__): the responses' log-probabilities, the loss
of a micro batch, the metrics."""

from __future__ import annotations

from typing import Any

import torch

from trainer.data.pack import IGNORE

# the per-step sums each rank keeps (reduced at a log step)
STATS = ("pairs", "rewards_chosen", "rewards_rejected", "reward_accuracy", "reward_margin", "logps_chosen",
         "logps_rejected")  # fmt: skip


def response_logps(ds: Any, rows: Any) -> tuple[Any, Any]:
    """(each row's summed log-probability of its targets, their count): rows of [input_ids, labels,
    position_ids], one response after its prompt each; the logits in fp32."""
    out = ds(input_ids=rows[:, 0], position_ids=rows[:, 2], use_cache=False)
    logits = out.logits[:, :-1].float()
    targets = rows[:, 1, 1:]
    mask = targets != IGNORE
    picked = logits.gather(-1, torch.where(mask, targets, 0).unsqueeze(-1)).squeeze(-1)
    logp = (picked - torch.logsumexp(logits, dim=-1)) * mask
    return logp.sum(dim=1), mask.sum(dim=1)


class PairObjective:
    """A preference objective: `pair_losses` in the subclass; the rest here."""

    name = ""
    needs_reference = False
    default_beta = 0.1

    def __init__(self, settings: Any) -> None:
        self.beta = settings.beta if settings.beta is not None else self.default_beta
        self.label_smoothing = settings.label_smoothing
        self.gamma = settings.gamma
        self.reference: Any = None  # reference.py: (pairs, 2) log-probs of the train set, of the eval set
        self.sums: Any = None
        self.eval_sums: Any = None  # the same, over an eval's pairs
        self.device: Any = "cpu"  # the engine's (the metrics' all-reduce runs there)

    def describe(self) -> str:
        return f"{self.name} (beta {self.beta:g})"

    def pair_losses(self, c: Any, r: Any, nc: Any, nr: Any, ref: Any) -> tuple[Any, Any, Any]:
        """(loss, chosen reward, rejected reward) per pair from the responses' summed log-probs `c`,
        `r`, their target counts `nc`, `nr` and the reference's (pairs, 2) log-probs `ref` (None
        for the reference-free)."""
        raise NotImplementedError

    def forward(self, ds: Any, batch: Any, training: bool = True, split: str = "train") -> Any:
        """The pairs' losses of one micro batch (`batch`: stream.Pairs), summed; the rewards counted
        for the metrics (the training interval's, or with split eval the eval's)."""
        logps, counts = response_logps(ds, batch.rows)
        m = batch.pairs
        c, r, nc, nr = logps[:m], logps[m:], counts[:m], counts[m:]
        ref = None
        if self.needs_reference:
            table = self.reference[split]
            ref = torch.as_tensor(table[batch.index.numpy()], dtype=torch.float32, device=c.device)
        losses, rc, rr = self.pair_losses(c, r, nc.float(), nr.float(), ref)
        if training or split == "eval":
            self._count(rc.detach(), rr.detach(), c.detach(), r.detach(), "train" if training else "eval")
        return losses.sum()

    def loss(self, ds: Any, batch: Any) -> Any:
        """The training loss of a micro batch: the mean over its pairs."""
        return self.forward(ds, batch) / batch.pairs

    def _count(self, rc: Any, rr: Any, c: Any, r: Any, split: str = "train") -> None:
        row = torch.stack([torch.tensor(float(len(rc)), device=rc.device), rc.sum(), rr.sum(),
                           (rc > rr).float().sum(), (rc - rr).sum(), c.sum(), r.sum()]).double()  # fmt: skip
        name = "sums" if split == "train" else "eval_sums"
        setattr(self, name, row if getattr(self, name) is None else getattr(self, name) + row)

    def flush(self, world_size: int, split: str = "train") -> dict[str, float]:
        """The interval's (or with split eval, the eval's) means over every rank's pairs (one
        all-reduce; every rank calls it)."""
        import torch.distributed as dist

        name = "sums" if split == "train" else "eval_sums"
        sums = (
            getattr(self, name)
            if getattr(self, name) is not None
            else torch.zeros(len(STATS), dtype=torch.float64, device=self.device)
        )
        if dist.is_initialized() and world_size > 1:
            dist.all_reduce(sums)
        setattr(self, name, None)
        n = max(float(sums[0]), 1.0)
        return {k: float(v) / n for k, v in zip(STATS[1:], sums[1:].tolist(), strict=True)} | {
            "pairs": int(sums[0])
        }
