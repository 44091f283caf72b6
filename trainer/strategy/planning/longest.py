"""`bin/train EXP.yaml --plan --max-seq-len`: the longest sequence this job can train here, each
setting of the activation levers and every ZeRO rung allowed, by the same plan (ladder.py) at every
length tried: doubled from 256 tokens until nothing fits, then halved back to 256 tokens' precision."""

from __future__ import annotations

from typing import Any

from trainer.common.errors import UserError
from trainer.config import Experiment
from trainer.strategy.planning.candidates import ModelInfo
from trainer.strategy.planning.ladder import Plan, plan
from trainer.strategy.planning.levers import SP_DEGREES, sp_problem

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


def per_degree(exp: Experiment, info: Any, kw: dict[str, Any]) -> list[str]:
    """--plan --max-seq-len under strategy.sequence_parallel: auto: the longest sequence at each degree
    the ranks and the model allow (1 too), every other lever and rung as the experiment allows."""
    if exp.strategy.sequence_parallel != "auto":
        return []
    attn = "sdpa" if exp.model.attn_implementation == "auto" else exp.model.attn_implementation
    degrees = [1] + [d for d in SP_DEGREES if not sp_problem(info, d, kw["world_size"], STEP, attn)]
    if len(degrees) == 1:  # one rank, or a model Ulysses cannot split: the one answer below
        return []
    lines = [f"longest sequence at each sequence-parallel degree ({kw['world_size']} rank(s)):"]
    for d in degrees:
        fixed = exp.model_copy(update={"strategy": exp.strategy.model_copy(update={"sequence_parallel": d})})
        seq, p = longest_sequence(fixed, info, **kw)
        what = (
            f"{seq:>12,} tokens: {p.candidate.name} with {p.levers.describe()} "
            f"({p.estimate.total / 2**30:.2f} GiB of {p.budget / 2**30:.2f} GiB per rank)"
            + ("; the model's positions end there" if seq == info.positions else "")
            if p is not None
            else f"none: not even {STEP} tokens fit"
        )
        lines.append(f"  sequence parallel {d:<2} {what}")
    return lines


def longest_command(exp: Experiment, planned_for: Any, world: int, per_node: int) -> int:
    """--plan --max-seq-len: the plan at the experiment's data.seq_len (or why nothing fits there), then
    the longest sequence that fits (trainer/strategy/planning/longest.py)."""
    try:
        p = planned_for(exp).plan
        print(
            f"at data.seq_len {exp.data.seq_len:,}: {p.candidate.name} with activation levers: {p.levers.describe()}"
        )
    except UserError as e:
        print(f"at data.seq_len {exp.data.seq_len:,}: {str(e).splitlines()[0]}")
    short = planned_for(exp.model_copy(update={"data": exp.data.model_copy(update={"seq_len": STEP})}))
    p = short.plan
    kw = {"world_size": world, "gpus_per_node": per_node, "device_type": p.device_type,
          "device_memory": p.device_memory, "host_memory": p.host_memory, "precision": p.precision}  # fmt: skip
    for line in per_degree(exp, short.info, kw):
        print(line)
    seq, best = longest_sequence(exp, short.info, **kw)
    print(describe_longest(seq, best, exp, short.info))
    return 0
