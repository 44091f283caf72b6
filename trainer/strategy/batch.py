"""The global batch and how it is split: `train.global_batch_size` (sequences an optimizer step, every
rank together) kept exactly, and `train.micro_batch_size: auto`, the micro batch the plan fits that
trains fastest.

A micro step's host work (launching a layer's operators, ZeRO-3's hooks) costs the same however many
rows it carries, so a larger micro batch spends less of the host per token: at micro 1 an 8B's LoRA step
on an H200 kept the GPU busy 40-70% of the time (issue 55). `auto` plans every micro batch that divides
the rank's share of the global batch, largest first, and takes the one whose plan (rung and levers) has
the lowest estimated seconds per token (strategy/planning/speed.py), the larger on a tie (estimates within
a relative 1e-9 of each other: float noise is no difference), and offload only when no micro batch fits
without it (the escalation rules hold across micro batches too); accumulation makes up the rest, so the step
trains the global batch the experiment asked for whatever the micro batch. The banner says what was chosen
and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer.common.errors import UserError

MAX_MICRO = 512  # the largest micro batch auto tries
TIE = 1e-9  # relative: estimated times closer than this are equal (float noise, not a faster setting)
SP_DEGREES = (2, 4, 8, 16, 32, 64)  # the sequence-parallel degrees strategy.sequence_parallel: auto tries


@dataclass(frozen=True)
class Batch:
    micro: int
    accum: int
    why: str  # for the banner: how the global batch is split and why ("" when as written)


def accumulation(exp: Any, world_size: int, sp: int) -> int:
    """The micro steps a step accumulates under sequence parallelism of degree `sp`: with a global batch, what
    the world / sp data-parallel ranks need to train it at the experiment's micro batch (so that every degree
    trains the same sequences a step, and the plan compares them, and counts their memory, as they will run);
    else train.grad_accum."""
    t = exp.train
    dp = max(1, world_size // max(1, sp))
    if (
        t.global_batch_size
        and isinstance(t.micro_batch_size, int)
        and t.global_batch_size % (t.micro_batch_size * dp) == 0
    ):
        return t.global_batch_size // (t.micro_batch_size * dp)
    return t.grad_accum


def sp_degrees(exp: Any, world_size: int) -> list[int]:
    """The sequence-parallel degrees the plan may choose from, before the model's own limits (levers.py's
    `sp_problem`): the pinned one, or under auto 1 and every degree of SP_DEGREES that divides the world (1
    alone for the preference objectives, not verified under sequence parallelism)."""
    sp = exp.strategy.sequence_parallel
    if sp != "auto":
        return [int(sp)]
    if exp.train.objective != "sft":
        return [1]
    return [1] + [d for d in SP_DEGREES if d <= world_size and world_size % d == 0]


def data_parallel_worlds(exp: Any, world_size: int) -> list[int]:
    """The data-parallel worlds the plan may choose from (world / sp for each of `sp_degrees`), largest first:
    a global batch is kept whatever the degree, so it must divide by one of them."""
    return sorted({world_size // d for d in sp_degrees(exp, world_size) if world_size % d == 0}, reverse=True)


def keeps(exp: Any, world_size: int, sp: int, micro: int) -> bool:
    """Whether sequence parallelism of degree `sp` keeps train.global_batch_size at micro batch `micro` (its
    world / sp data-parallel ranks divide it); True without a global batch."""
    target = exp.train.global_batch_size
    return not target or target % (micro * max(1, world_size // max(1, sp))) == 0


def _ranks(exp: Any, world_size: int, dps: list[int]) -> str:
    """The data-parallel ranks that share the batch, for the errors: the world's, or world / sp's."""
    sp = exp.strategy.sequence_parallel
    if dps == [world_size]:
        return f"{world_size} data-parallel rank(s)"
    if sp != "auto":
        return f"{dps[0]} data-parallel rank(s) ({world_size} / strategy.sequence_parallel {sp})"
    return f"{' or '.join(map(str, dps))} data-parallel rank(s) ({world_size} / each sequence-parallel degree auto tries)"


def divisors(n: int) -> list[int]:
    """The divisors of `n` up to MAX_MICRO, largest first."""
    return sorted((d for d in range(1, min(n, MAX_MICRO) + 1) if n % d == 0), reverse=True)


def with_batch(exp: Any, micro: int, accum: int) -> Any:
    """`exp` with its micro batch and accumulation set."""
    return exp.model_copy(
        update={"train": exp.train.model_copy(update={"micro_batch_size": micro, "grad_accum": accum})}
    )


def resolve(exp: Any, world_size: int, plan_for: Any) -> tuple[Any, Batch | None]:
    """The experiment with train.micro_batch_size and grad_accum decided (unchanged, and None, when neither
    auto nor a global batch asks for it). `plan_for(exp)` plans an experiment (raising UserError where
    nothing fits); its plan's data-parallel world (world / sequence parallel) divides the global batch."""
    t = exp.train
    micro, target = t.micro_batch_size, t.global_batch_size
    if micro != "auto" and target is None:
        return exp, None
    if target is None:  # the rules refuse it first; kept for callers that skip them
        raise UserError(
            "train.micro_batch_size: auto needs train.global_batch_size (sequences an optimizer step)"
        )
    set_accum = "grad_accum" in t.model_fields_set
    if micro != "auto":
        return _fixed(exp, micro, target, world_size, plan_for, set_accum)
    dps = data_parallel_worlds(exp, world_size)
    kept = [dp for dp in dps if target % dp == 0]
    if not kept:
        raise UserError(
            f"train.global_batch_size {target} does not divide by the {_ranks(exp, world_size, dps)}; give a "
            f"multiple of {dps[-1]}"
        )
    # every micro batch that divides the share of some degree's data-parallel ranks, largest first
    micros = sorted({m for dp in kept for m in divisors(target // dp)}, reverse=True)
    tried, last_error = [], None
    for m in micros:
        dp = next(dp for dp in kept if target % (m * dp) == 0)
        e = with_batch(exp, m, target // (m * dp))
        try:
            p = plan_for(e)
        except UserError as err:  # does not fit at this micro batch
            last_error = err
            continue
        if target % (m * p.dp_world):  # (a plan that does not keep it, a caller's: no split it keeps)
            continue
        if target // (m * p.dp_world) != e.train.grad_accum:  # the accumulation of the degree it chose
            e = with_batch(exp, m, target // (m * p.dp_world))
            dp, p = (
                p.dp_world,
                plan_for(e),
            )  # the same choice: the plan counts each degree at its accumulation
            if p.dp_world != dp:
                continue
        tried.append((p.speed.per_token if p.speed is not None else 0.0, -m, e, p))
    if not tried:  # the smallest micro batch's error: what blocks the job even there
        raise last_error or UserError("train.micro_batch_size: auto: nothing fits")
    # offload only when no micro batch fits without it (the escalation rules, across micro batches too); then
    # the fastest per token, estimates within TIE of it equal and the larger micro batch taking the tie
    pool = [x for x in tried if x[3].candidate.offload == "none"] or tried
    fastest = min(x[0] for x in pool)
    best = min((x for x in pool if x[0] <= fastest * (1 + TIE)), key=lambda x: x[1])
    _, _, e, p = best
    m, a = e.train.micro_batch_size, e.train.grad_accum
    if set_accum and a != t.grad_accum:
        raise UserError(
            f"train.grad_accum {t.grad_accum} and train.global_batch_size {target}: micro_batch_size auto chose {m}, "
            f"which needs grad_accum {a}; remove train.grad_accum (auto sets it) or set the micro batch"
        )
    others = ", ".join(
        f"{-x[1]}: {x[0] * 1e6:.1f} us/token" + ("" if x[3].candidate.offload == "none" else " with offload")
        for x in sorted(tried, key=lambda x: x[1])
        if x is not best
    )
    why = (
        f"micro_batch_size auto: {m} (x accumulation {a} x {p.dp_world} data-parallel rank(s) = global batch {target}), "
        f"the fastest that fits (est. {best[0] * 1e6:.1f} us a token"
        + (f"; {others}" if others else "")
        + ")"
    )
    return e, Batch(m, a, why)


def _fixed(
    exp: Any, micro: int, target: int, world_size: int, plan_for: Any, set_accum: bool
) -> tuple[Any, Batch]:
    """A global batch with a micro batch given: accumulation = global / (micro x data-parallel ranks)."""
    dps = data_parallel_worlds(exp, world_size)
    kept = [dp for dp in dps if target % (micro * dp) == 0]
    if not kept:
        raise UserError(
            f"train.global_batch_size {target} is not a multiple of micro_batch_size {micro} x "
            f"{_ranks(exp, world_size, dps)}; give a global batch it divides, or micro_batch_size: auto"
        )
    dp = plan_for(with_batch(exp, micro, target // (micro * kept[0]))).dp_world
    if target % (micro * dp):  # (a plan that does not keep it, a caller's)
        raise UserError(
            f"train.global_batch_size {target} is not a multiple of micro_batch_size {micro} x {dp} data-parallel "
            "rank(s) of the plan; give a global batch it divides, or micro_batch_size: auto"
        )
    accum = target // (micro * dp)
    if set_accum and accum != exp.train.grad_accum:
        raise UserError(
            f"train.grad_accum {exp.train.grad_accum} contradicts train.global_batch_size {target} = micro_batch_size "
            f"{micro} x {dp} rank(s) x {accum}; remove train.grad_accum (the global batch sets it)"
        )
    why = f"global batch {target} = micro {micro} x {dp} data-parallel rank(s) x accumulation {accum}"
    return with_batch(exp, micro, accum), Batch(micro, accum, why)
