"""`bin/train EXP.yaml --plan --max-seq-len`: the longest sequence this job can train here, each
setting of the activation levers and every ZeRO rung allowed, by the same plan (ladder.py) at every
length tried: doubled from 256 tokens until nothing fits, then halved back to 256 tokens' precision."""

from __future__ import annotations

from typing import Any

from trainer.config import Experiment
from trainer.errors import UserError
from trainer.strategy.planning.candidates import ModelInfo
from trainer.strategy.planning.ladder import Plan, plan

STEP = 256  # the precision of the answer, and a multiple of every sequence-parallel degree


def longest_sequence(exp: Experiment, info: ModelInfo, **kwargs: Any) -> tuple[int, Plan | None]:
    """(the longest multiple of STEP tokens a plan fits, that plan; (0, None) when not even STEP does).
    The model's positions cap it (`info.positions`)."""

    def fits(seq: int) -> Plan | None:
        data = exp.data.model_copy(update={"seq_len": seq})
        try:
            return plan(exp.model_copy(update={"data": data}), info, **kwargs)
        except UserError:
            return None

    cap = info.positions or 1 << 26
    lo, best = 0, None
    hi = STEP
    while hi <= cap and (p := fits(hi)) is not None:
        lo, best, hi = hi, p, hi * 2
    hi = min(hi, cap + STEP)
    while hi - lo > STEP:  # lo fits, hi does not (or is past the positions)
        mid = (lo + hi) // 2 // STEP * STEP
        p = fits(mid) if mid <= cap else None
        lo, hi, best = (mid, hi, p) if p is not None else (lo, mid, best)
    return lo, best


def describe_longest(seq: int, p: Plan | None, exp: Experiment, info: ModelInfo) -> str:
    if p is None:
        return (
            f"longest sequence: none: not even {STEP} tokens fit at micro batch {exp.train.micro_batch_size}"
        )
    cap = f"; the model's positions allow {info.positions:,}" if info.positions else ""
    return (
        f"longest sequence: {seq:,} tokens at micro batch {exp.train.micro_batch_size} on {p.world_size} rank(s), "
        f"{p.candidate.name} with activation levers: {p.levers.describe()} "
        f"({p.estimate.total / 2**30:.2f} GiB of {p.budget / 2**30:.2f} GiB per rank){cap}"
    )
