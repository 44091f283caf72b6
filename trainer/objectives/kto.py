"""train.objective kto: Kahneman-Tversky Optimization over unpaired rows (data kind unpaired), as TRL 1.16's
KTOTrainer computes it (`_compute_loss`).

Each row's response has a log-ratio z = log pi(y|x) - log pi_ref(y|x) (summed over its targets; the reference as
DPO's, reference.py: the model as training starts, with LoRA the base). With KL the reference point,

    desirable:    desirable_weight   x (1 - sigmoid(beta (z - KL)))
    undesirable:  undesirable_weight x (1 - sigmoid(beta (KL - z)))

(loss_type apo_zero_unpaired: 1 - sigmoid(beta z) and sigmoid(beta z), no KL), the mean over the step's rows.

**The KL reference point.** TRL estimates it over a micro batch: the mean of log pi - log pi_ref over the batch's
mismatched pairs (each prompt with another row's completion), averaged over the ranks, clamped at 0, detached; so
it depends on how the step is cut into micro batches and ranks (and TRL needs sequential sampling for its pairs to be
the batch's). Here the mismatched pairs are data (trainer/data/unpaired.py: each row's prompt with the previous row's
completion), and the KL is the mean over **every pair of the step**, on every rank: at the step's start `KLStream`
takes the step's micro batches, runs the policy over their pairs without gradients, and one all-reduce gives the
same KL to every micro batch of every rank. A step's loss and gradients are therefore the same however it is split
(ranks, accumulation); where TRL's batch is the whole data in order, on one rank, they are TRL's. An eval's KL is
the mean over every eval pair, every rank's (`eval_start`, before the eval's batches).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from trainer.data.step_stream import StepStream
from trainer.objectives.pairs import PairObjective, response_logps

log = logging.getLogger("trainer")

# the per-interval sums each rank keeps (reduced at a log step)
STATS = ("rows", "desirable", "undesirable", "rewards_chosen", "rewards_rejected", "logps_chosen", "logps_rejected",
         "kl", "steps")  # fmt: skip


class KTO(PairObjective):
    """See the module's doc. A micro batch is stream.Pairs: its rows, then their mismatched pairs."""

    name = "kto"
    needs_reference = True
    default_beta = 0.1

    def __init__(self, settings: Any, kto: Any) -> None:
        super().__init__(settings)
        self.loss_type = kto.loss_type
        self.weights = (kto.desirable_weight, kto.undesirable_weight)
        self.labels: dict[str, Any] = {"train": None, "eval": None}  # by row: 1.0 desirable, 0.0 undesirable
        self.kl = 0.0  # the step's reference point (KLStream sets it)
        self.eval_kl: float | None = None  # the eval set's (eval_start, for one eval)

    def describe(self) -> str:
        d, u = self.weights
        weights = f", weights {d:g}/{u:g}" if (d, u) != (1.0, 1.0) else ""
        if self.loss_type == "apo_zero_unpaired":
            return f"kto (apo_zero_unpaired, beta {self.beta:g}{weights}, no KL)"
        return (f"kto (beta {self.beta:g}{weights}; the KL reference point the mean over the step's mismatched pairs, "
                "every rank's)")  # fmt: skip

    def attach(self, data: Any) -> None:
        self.labels = {"train": data.margins, "eval": data.eval_margins}

    def losses(self, z: Any, desirable: Any, kl: Any) -> Any:
        """Each row's weighted loss from its log-ratio `z`, its label and the reference point `kl`."""
        b = self.beta
        if self.loss_type == "kto":
            good, bad = 1 - F.sigmoid(b * (z - kl)), 1 - F.sigmoid(b * (kl - z))
        else:
            good, bad = 1 - F.sigmoid(b * z), F.sigmoid(b * z)
        return torch.where(desirable, self.weights[0] * good, self.weights[1] * bad)

    def pair_kl(self, ds: Any, batch: Any, split: str = "train", logps: Any = None) -> tuple[Any, int]:
        """(the summed log pi - log pi_ref over a micro batch's mismatched pairs, their count), without gradients."""
        m = batch.pairs
        if logps is None:
            with torch.no_grad():
                logps, _ = response_logps(ds, batch.rows[m:])
        ref = torch.as_tensor(self.reference[split][batch.index.numpy(), 1], device=logps.device)
        return (logps.detach().double() - ref).sum(), m

    def forward(self, ds: Any, batch: Any, training: bool = True, split: str = "train") -> Any:
        """The rows' losses of one micro batch, summed: training with the step's KL; an eval with the eval set's
        (`eval_start`); any other batch without gradients (a probe) with its own pairs'."""
        m = batch.pairs
        idx = batch.index.numpy()
        if training or (split == "eval" and self.eval_kl is not None):
            logps, _ = response_logps(ds, batch.rows[:m])
            kl = torch.tensor(self.kl if training else self.eval_kl, device=logps.device, dtype=logps.dtype)
        else:  # (no gradients: the rows and their pairs in one forward)
            both, _ = response_logps(ds, batch.rows)
            logps = both[:m]
            s, n = self.pair_kl(ds, batch, split, both[m:])
            kl = (
                (s / n).clamp(min=0).to(logps.dtype)
                if self.loss_type == "kto"
                else torch.zeros_like(logps[0])
            )
        ref = torch.as_tensor(self.reference[split][idx, 0], device=logps.device, dtype=logps.dtype)
        desirable = torch.as_tensor(self.labels[split][idx] > 0.5, device=logps.device)
        z = logps - ref
        losses = self.losses(z, desirable, kl)
        if training or split == "eval":
            self._tally(z.detach(), logps.detach(), desirable, "sums" if training else "eval_sums")
        return losses.sum()

    def _tally(self, z: Any, logps: Any, desirable: Any, name: str) -> None:
        d = desirable.to(torch.float64)
        r, lp = self.beta * z.double(), logps.double()
        row = torch.zeros(len(STATS), dtype=torch.float64, device=z.device)
        row[0] = float(len(z))
        row[1:7] = torch.stack([d.sum(), (1 - d).sum(), (r * d).sum(), (r * (1 - d)).sum(), (lp * d).sum(),
                                (lp * (1 - d)).sum()])  # fmt: skip
        self._add(name, row)

    def _add(self, name: str, row: Any) -> None:
        setattr(self, name, row if getattr(self, name) is None else getattr(self, name) + row)

    def _count_kl(self, name: str, kl: float) -> None:
        """A reference point counted once (a step's, an eval's) for the mean the log shows."""
        row = torch.zeros(len(STATS), dtype=torch.float64, device=self.device)
        row[STATS.index("kl")], row[STATS.index("steps")] = kl, 1.0
        self._add(name, row)

    def eval_start(self, engine: Any, batches: Any) -> None:
        """An eval's KL: the mean over every eval batch's pairs on every rank (one pass without gradients and one
        all-reduce before the eval's batches), so that the eval loss does not depend on how the eval set is split."""
        if self.loss_type == "kto":
            self.eval_kl = kl_over(self, engine, batches, "eval")
            self._count_kl("eval_sums", self.eval_kl)

    def step_kl(self, kl: float) -> None:
        """The step's reference point (every rank's), counted once for the interval's mean."""
        self.kl = kl
        self._count_kl("sums", kl)

    def flush(self, world_size: int, split: str = "train") -> dict[str, Any]:
        """The interval's (or the eval's) means over every rank's rows: the rewards (beta x the log-ratio) and
        log-probs of the desirable (chosen) and undesirable (rejected) rows, their margin, the KL (one all-reduce)."""
        import torch.distributed as dist

        name = "sums" if split == "train" else "eval_sums"
        sums = getattr(self, name)
        sums = sums if sums is not None else torch.zeros(len(STATS), dtype=torch.float64, device=self.device)
        if dist.is_initialized() and world_size > 1:
            dist.all_reduce(sums)
        setattr(self, name, None)
        if split == "eval":
            self.eval_kl = None
        s = dict(zip(STATS, sums.tolist(), strict=True))
        out: dict[str, Any] = {"rows": int(s["rows"]), "desirable": int(s["desirable"])}
        for side, n in (("chosen", s["desirable"]), ("rejected", s["undesirable"])):
            if n:
                out[f"rewards_{side}"] = s[f"rewards_{side}"] / n
                out[f"logps_{side}"] = s[f"logps_{side}"] / n
        if s["desirable"] and s["undesirable"]:
            out["reward_margin"] = out["rewards_chosen"] - out["rewards_rejected"]
        # the reference point: the mean of the steps' (or the eval's), every rank's
        if self.loss_type == "kto" and s["steps"]:
            out["kl"] = s["kl"] / s["steps"]
        return out


class KLStream(StepStream):
    """The run's TrainStream with KTO's step start: the step's micro batches taken, the policy's log-probs of their
    mismatched pairs summed on every rank, one all-reduce, the objective's KL set; then the batches fed in order."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.objective: Any = None
        self.engine: Any = None
        self.fed: int | None = None  # the step's tokens, counted before its batches were taken

    def loss_denominator(self, micro_steps: int) -> float | None:
        out = self.inner.loss_denominator(micro_steps)
        self.fed = self.inner.step_tokens(
            micro_steps
        )  # (before its batches are taken: the inner is then ahead)
        self.queue = [self.inner.next() for _ in range(micro_steps)]
        self.step_start(self.queue)
        return out

    def step_tokens(self, micro_steps: int) -> int | None:
        return self.fed if self.queue is not None else self.inner.step_tokens(micro_steps)

    def step_start(self, batches: list[Any]) -> None:
        """The objective's KL from this rank's micro batches of the step and every other rank's (--overfit-batch
        calls it with its fixed batch)."""
        self.objective.step_kl(kl_over(self.objective, self.engine, batches, "train"))


def kl_over(objective: KTO, engine: Any, batches: Any, split: str) -> float:
    """The mean of log pi - log pi_ref over the mismatched pairs of `batches` on every rank (one all-reduce; every
    rank calls it), clamped at 0."""
    import torch.distributed as dist

    total = torch.zeros(2, dtype=torch.float64, device=engine.device)
    for batch in batches:
        s, n = objective.pair_kl(engine.ds, batch.to(engine.device), split)
        total += torch.stack([s, torch.tensor(float(n), dtype=torch.float64, device=engine.device)])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    return max(float(total[0] / total[1].clamp(min=1)), 0.0)


def imbalance(desirable: int, undesirable: int, dw: float, uw: float) -> str | None:
    """TRL's warning where the two classes' counts and weights are out of the KTO paper's range (its Eq. 8: the
    desirable weight x count over the undesirable's within [1, 4/3]), the same bounds; None where they are in it."""
    d = max(desirable, 1)  # (TRL's counts: the undesirable are the rest of the rows after that)
    u = max(desirable + undesirable - d, 1)
    if d == u:
        return None
    dl, dh = round(u * uw / d, 2), round(u * uw / d * 1.33, 2)
    ul, uh = round(d * dw / u / 1.33, 2), round(d * dw / u, 2)
    if dl <= dw <= dh or ul <= uw <= uh:
        return None
    return (f"warning: kto: {desirable:,} desirable and {undesirable:,} undesirable rows with weights {dw:g}/{uw:g}: "
            f"out of the KTO paper's range (its Eq. 8); set EITHER train.kto.desirable_weight in [{dl}, {dh}] OR "
            f"train.kto.undesirable_weight in [{ul}, {uh}] (not both), as TRL recommends")  # fmt: skip


def prepare(objective: KTO, engine: Any, data: Any, stream: Any, is_main: bool) -> list[str]:
    """The labels attached, the stream given the engine; the banner's lines (TRL's imbalance warning, rank 0's)."""
    objective.attach(data)
    if isinstance(stream, KLStream):
        stream.objective, stream.engine = objective, engine
    labels = data.margins
    desirable = int((labels > 0.5).sum())
    warning = imbalance(desirable, len(labels) - desirable, *objective.weights)
    if warning and is_main:
        log.warning(warning)
    return [f"objective: {objective.describe()}; each row and its mismatched pair, {desirable:,} desirable of "
            f"{len(labels):,} rows"]  # fmt: skip
