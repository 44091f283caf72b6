"""The decision: the first rung of the ladder that fits, or the pinned candidate and why
(`plan`), the `Plan` that records it with the evidence, and its table (`describe_plan`); the errors
when nothing fits or a pin needs a justification.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainer.config import Experiment, chunked_loss_problem, format_size
from trainer.errors import UserError
from trainer.strategy.planning.activations import activations_for, host_activations, rows_per_micro
from trainer.strategy.planning.candidates import LADDER, Candidate, ModelInfo, next_rung, pinned_choice
from trainer.strategy.planning.estimate import Estimate, estimate_all
from trainer.strategy.planning.generation import generation_bytes, host_bytes, row_length
from trainer.strategy.planning.levers import Levers, lever_sets, tiled_loss_by_default
from trainer.strategy.planning.speed import StepTime, step_time
from trainer.strategy.planning.states import low_precision_bytes


@dataclass(frozen=True)
class Plan:
    """The decision and the evidence for it."""

    candidate: Candidate
    reason: str
    estimates: tuple[Estimate, ...]
    budget: int  # device bytes the plan may use (device memory x headroom)
    device_memory: int
    host_memory: int | None  # None: planning for another machine whose host memory was not given
    world_size: int
    gpus_per_node: int
    precision: str
    device_type: str
    pinned: bool = False
    justification: str = ""
    auto_choice: Candidate | None = None
    levers: Levers = Levers()  # the activation levers the plan chose (levers.py)
    levers_reason: str = ""
    # every (levers, rung) the plan would try, in its order: the run-time escalation climbs it
    order: tuple[tuple[Levers, Candidate], ...] = ()
    offload_pin: str | None = None  # strategy.offload as the experiment pins it (None: auto)
    # the estimated step of the choice, and of every setting that fits, fastest first (speed.py)
    speed: StepTime | None = None
    fastest: tuple[tuple[Levers, Candidate, StepTime], ...] = ()
    row_seconds: tuple[float, ...] = ()  # the estimated step of each row of `estimates` (the chosen levers)

    @property
    def sp(self) -> int:
        return self.levers.sp

    @property
    def dp_world(self) -> int:
        """The data-parallel world: the ranks that hold different sequences (world / sequence parallel)."""
        return self.world_size // self.levers.sp

    def next_after(self) -> tuple[Levers, Candidate] | None:
        """What the run-time escalation tries after an out-of-memory here (`escalation_after`)."""
        return escalation_after(self)

    @property
    def estimate(self) -> Estimate:
        return next(e for e in self.estimates if e.candidate == self.candidate)

    def checkpoint_async(self, setting: Any) -> tuple[bool, str]:
        """checkpoint.async for the chosen candidate: (on, why). auto is on unless the host copy does
        not fit in host memory beside what the candidate needs there."""
        e = self.estimate
        copy = f"a host copy of {format_size(e.snapshot)} per node"
        if setting is False:
            return False, "checkpoint.async: false"
        if setting is True:
            return True, copy
        if self.host_memory is not None and e.host > self.host_memory:
            return False, (
                f"checkpoint.async: auto: {copy} does not fit beside the rest in host memory "
                f"({format_size(e.host)} of {format_size(self.host_memory)}); saving synchronously"
            )
        return True, copy

    def table(self) -> str:
        from trainer.strategy.planning.tables import plan_table

        return plan_table(self)

    def summary(self) -> dict[str, Any]:
        """What goes into logs and trainer_state.json."""
        e = self.estimate
        return {
            "stage": self.candidate.stage,
            "offload": self.candidate.offload,
            "levers": self.levers.describe(),
            "sequence_parallel": self.levers.sp,
            "offload_params": self.candidate.offload_params,
            "reason": self.reason,
            "pinned": self.pinned,
            "justification": self.justification,
            "estimate_bytes": {
                "params": e.params,
                "grads": e.grads,
                "optimizer": e.optimizer,
                "activations": e.activations,
                "step": e.step,
                "buffers": e.buffers,
                "total": e.total,
                "host_per_node": e.host,
                "checkpoint_snapshot_per_node": e.snapshot,
                "gathered_layer": e.gather,
            },
            "budget_bytes": self.budget,
            "device_memory_bytes": self.device_memory,
            "world_size": self.world_size,
            "precision": self.precision,
        }


def escalation_after(plan: Plan) -> tuple[Levers, Candidate] | None:
    """What the run-time escalation tries after an out-of-memory on the plan's (levers, rung): the
    rung above on the ladder (a pinned stage is where the climb starts; an experiment that pins
    `strategy.offload: none` never climbs into offload, and NVMe needs its path), then, past the
    last rung it may take, the next setting of the activation levers in the plan's order on that
    rung. Nothing the failed attempt had is given up (no lower rung, no lever turned off, no
    smaller sequence-parallel degree), so every attempt holds less than the last."""
    by = {(e.candidate.stage, e.candidate.offload): e.candidate for e in plan.estimates}
    # a rung refused for another reason than memory (NVMe offload without strategy.nvme_path)
    blocked = {e.candidate for e in plan.estimates if not e.fits_device and e.total <= plan.budget}
    up = next_rung(plan.candidate.stage, plan.candidate.offload)
    while up is not None:
        rung = by.get(up)
        if rung is not None and rung not in blocked and not (plan.offload_pin == "none" and up[1] != "none"):
            return plan.levers, rung
        up = next_rung(*up)
    for levers in dict.fromkeys(lv for lv, _ in plan.order):
        if levers != plan.levers and levers.covers(plan.levers):
            return levers, plan.candidate
    return None


def plan(
    exp: Experiment,
    info: ModelInfo,
    *,
    world_size: int,
    gpus_per_node: int,
    device_type: str,
    device_memory: int,
    host_memory: int | None,
    precision: str,
    template: Mapping[str, Any] | None = None,
    force: bool = False,
) -> Plan:
    """Estimate every candidate and choose by the escalation rules (see module docstring).

    Raises UserError when a pinned candidate is above the rules' choice without a justification,
    or is predicted not to fit (unless `force`), or when nothing fits."""
    if exp.train.micro_batch_size == "auto":  # decided first (strategy/batch.py), then planned as given
        from trainer.strategy.batch import resolve

        kw = dict(world_size=world_size, gpus_per_node=gpus_per_node, device_type=device_type, device_memory=device_memory,
                  host_memory=host_memory, precision=precision, template=template, force=force)  # fmt: skip
        exp = resolve(exp, world_size, lambda e: plan(e, info, **kw))[0]
    return _plan(exp, info, world_size=world_size, gpus_per_node=gpus_per_node, device_type=device_type,
                 device_memory=device_memory, host_memory=host_memory, precision=precision, template=template,
                 force=force)  # fmt: skip


def _plan(
    exp: Experiment,
    info: ModelInfo,
    *,
    world_size: int,
    gpus_per_node: int,
    device_type: str,
    device_memory: int,
    host_memory: int | None,
    precision: str,
    template: Mapping[str, Any] | None = None,
    force: bool = False,
) -> Plan:
    s = exp.strategy
    lp = low_precision_bytes(precision)
    budget = int(device_memory * s.headroom)
    pinned = pinned_choice(exp, template)
    is_pinned = pinned[0] is not None or pinned[1] is not None

    def estimates_for(levers: Levers) -> list[Estimate]:
        # sequence parallelism runs sdpa where auto would have picked eager (CPU, bf16, short sequences)
        sp_info = info
        if levers.sp > 1 and info.attn_implementation == "eager" and exp.model.attn_implementation == "auto":
            sp_info = dataclasses.replace(info, attn_implementation="sdpa")
        act = activations_for(exp, sp_info, lp, levers)
        extra = (
            host_activations(info, rows_per_micro(exp), row_length(exp), lp, levers.sp)
            if levers.offload
            else 0
        )
        return estimate_all(
            exp, info, pinned, act=act, lp=lp, world_size=world_size, gpus_per_node=gpus_per_node,
            on_gpu=device_type == "cuda", budget=budget, host_memory=host_memory, template=template,
            host_activations=(extra + host_bytes(exp)) * gpus_per_node, generation=generation_bytes(exp, info, lp),
        )  # fmt: skip

    settings = list(lever_sets(exp, info, world_size, device_type, precision))

    def seconds(levers: Levers, c: Candidate) -> StepTime:
        return step_time(exp, info, levers, c, world_size=world_size, gpus_per_node=gpus_per_node,
                         device_type=device_type, lp=lp)  # fmt: skip

    found, first, order, fastest = _search(settings, estimates_for, pinned, seconds)
    levers, estimates, by, options, chosen = (*first, None) if found is None else found
    auto_choice = next((c for c in LADDER if by[c].fits), None)
    hint = _chunked_loss_hint(exp, info, by, levers, budget, lp)
    if found is None:
        if not (is_pinned and force and options):
            raise _no_fit(exp, by, options if is_pinned else [], auto_choice, hint, budget, device_memory, world_size,
                          levers, len(settings))  # fmt: skip
        chosen = options[0]
    return Plan(
        candidate=chosen,
        reason=_reason(exp, by, chosen, auto_choice, is_pinned, hint, budget),
        estimates=tuple(estimates),
        budget=budget,
        device_memory=device_memory,
        host_memory=host_memory,
        world_size=world_size,
        gpus_per_node=gpus_per_node,
        precision=precision,
        device_type=device_type,
        pinned=is_pinned,
        justification=s.justification.strip(),
        auto_choice=auto_choice,
        levers=levers,
        levers_reason=(
            "the tiled loss by default on CPU in bf16, where it is the faster loss; "
            if tiled_loss_by_default(exp, info, device_type, precision)
            else ""
        )
        + _levers_reason(levers, settings, estimates_for, pinned, budget, fastest),
        order=tuple(order),
        offload_pin=pinned[1],
        speed=seconds(levers, chosen),
        fastest=tuple(fastest),
        row_seconds=tuple(seconds(levers, e.candidate).seconds for e in estimates),
    )


def _search(
    settings: list[Levers], estimates_for: Any, pinned: Any, seconds: Any
) -> tuple[Any, Any, list[tuple[Levers, Candidate]], list[tuple[Levers, Candidate, StepTime]]]:
    """Every setting of the levers, each with the rungs the experiment allows: (the fastest (levers,
    rung) that fits by its estimated step (speed.py; ties: the cheaper in memory order): levers,
    estimates, by candidate, options, the rung; or None), (the cheapest setting's levers, estimates,
    by, options), every (levers, rung) in the memory order (the run-time escalation climbs it), and
    every (levers, rung, step) that fits, fastest first."""
    found, first, order, fits = None, None, [], []
    for levers in settings:
        estimates = estimates_for(levers)
        by = {e.candidate: e for e in estimates}
        options = _options(by, pinned)
        order += [(levers, c) for c in options]
        if first is None:
            first = (levers, estimates, by, options)
        for c in options:
            if by[c].fits:
                fits.append(
                    (seconds(levers, c).per_token, len(fits), levers, c, (levers, estimates, by, options, c))
                )
    # sequence parallelism shrinks the data-parallel world, and with it the sequences a step trains: its degree
    # is the memory order's (the first setting that fits), never a choice of speed that changes the batch
    if fits:
        first_fit = min(fits, key=lambda x: x[1])
        fits = [x for x in fits if x[2].sp == first_fit[2].sp]
    # and offload comes last (the escalation rules): only when nothing on the devices alone fits
    if any(x[3].offload == "none" for x in fits):
        fits = [x for x in fits if x[3].offload == "none"]
    fits.sort(key=lambda x: (x[0], x[1]))
    if fits:
        found = fits[0][4]
    fastest = [(lv, c, seconds(lv, c)) for _, _, lv, c, _ in fits]
    return found, first, order, fastest


def _levers_reason(
    levers: Levers, settings: list[Levers], estimates_for: Any, pinned: Any, budget: int, fastest: Any = ()
) -> str:
    """Why these levers: none needed, or the fastest setting that fits, and what the cheaper settings'
    lowest rung would need."""
    fixed = len(settings) == 1
    if levers == settings[0]:
        return "as the experiment sets them" if fixed else "the cheapest setting: a rung fits without more"
    cheapest = {e.candidate: e for e in estimates_for(settings[0])}
    best = min((cheapest[c] for c in _options(cheapest, pinned)), key=lambda e: e.total)
    seen, others = {fastest[0][1]} if fastest else set(), []
    for lv, c, t in fastest[1:]:  # the fastest on each other rung
        if c not in seen and len(others) < 2:
            seen.add(c)
            others.append(f"{c.name} with {lv.describe()} {t.seconds:.2f} s")
    return (
        "the fastest setting that fits"
        + (
            f" (est. {fastest[0][2].seconds:.2f} s a step"
            + (f"; next: {'; '.join(others)}" if others else "")
            + ")"
            if fastest
            else ""
        )  # fmt: skip
        + f"; without levers the smallest candidate ({best.candidate.name}) "
        f"needs {format_size(best.total)} per rank ({format_size(best.activations)} of activations) of "
        f"{format_size(budget)}"
    )


def _options(by: dict[Candidate, Estimate], pinned: tuple[int | None, str | None, bool]) -> list[Candidate]:
    """The candidates to choose from, cheapest first: the ladder; or, when the experiment pins a
    stage or an offload, the candidates with that part fixed (stage 1 only when named)."""
    want_stage, want_offload, offload_params = pinned
    if want_stage is None and want_offload is None:
        return list(LADDER)
    return sorted(
        (
            c
            for c in by
            if (want_stage is None or c.stage == want_stage)
            and (want_offload is None or c.offload == want_offload)
            and (c.stage != 1 or want_stage == 1)
            and (c.stage < 3 or c.offload == "none" or c.offload_params == offload_params)
        ),
        key=lambda c: c.cost,
    )


def _no_fit(
    exp: Experiment,
    by: dict[Candidate, Estimate],
    pinned_options: list[Candidate],
    auto_choice: Candidate | None,
    hint: str,
    budget: int,
    device_memory: int,
    world_size: int,
    levers: Levers = Levers(),
    settings: int = 1,
) -> UserError:
    """The error when the pinned candidate (`pinned_options[0]`), or anything at all, does not fit
    (the table: under the cheapest setting of the levers, `levers`, of the `settings` tried)."""
    headroom = exp.strategy.headroom
    if pinned_options:
        c, e = pinned_options[0], by[pinned_options[0]]
        msg = (
            f"strategy: the pinned {c.name} is predicted not to fit: {format_size(e.total)} per rank "
            f"(host {format_size(e.host)}) against {format_size(budget)} usable of {format_size(device_memory)}. "
            + (
                f"The rules would pick {auto_choice.name}; set strategy.zero_stage/offload: auto. "
                if auto_choice
                else ""
            )
            + "Pass --force to run anyway."
        )
    else:
        tried = (
            f" under any of the {settings} settings of the activation levers the experiment allows"
            if settings > 1
            else ""
        )
        msg = (
            f"strategy: nothing fits in {format_size(budget)} per rank ({format_size(device_memory)} x headroom "
            f"{headroom}) on {world_size} rank(s){tried}: lower train.micro_batch_size or data.seq_len, "
            "let the levers help (model.activation_checkpointing, model.tiled_mlp, strategy.sequence_parallel: "
            "auto), add ranks, or give strategy.nvme_path for NVMe offload."
        )
    return UserError(
        msg
        + (f" Or {hint}." if hint else "")
        + "\n\n"
        + _table_for(by, budget, device_memory, headroom, world_size)
    )


def _reason(
    exp: Experiment,
    by: dict[Candidate, Estimate],
    chosen: Candidate,
    auto_choice: Candidate | None,
    is_pinned: bool,
    hint: str,
    budget: int,
) -> str:
    """Why `chosen`: the first rung that fits (and what the rungs below need), or pinned (and, above
    the rules' choice, the justification it requires)."""
    s = exp.strategy
    e = by[chosen]
    use = f"{format_size(e.total)} of {format_size(budget)} per rank"
    if not is_pinned:
        skipped = LADDER[: LADDER.index(chosen)]
        why = "; ".join(
            f"{c.name} needs {format_size(by[c].total)}" + (" (host)" if by[c].fits_device else "")
            for c in skipped
        )
        return (
            f"{chosen.name} is the first rung that fits ({use})"
            + (f"; {why}" if why else "")
            + (f"; {hint}" if hint else "")
        )
    reason = f"{chosen.name} pinned by the experiment ({use})"
    if auto_choice is not None and chosen.cost > auto_choice.cost:
        if not s.justification.strip():
            raise UserError(
                f"strategy: {chosen.name} is pinned, but the cheaper {auto_choice.name} fits "
                f"({format_size(by[auto_choice].total)} of {format_size(budget)} per rank). Set "
                f"strategy.zero_stage/offload to auto to use {auto_choice.name}, or say why in "
                "strategy.justification."
            )
        reason += f"; the rules would pick {auto_choice.name}; justification: {s.justification.strip()}"
    if not e.fits:
        reason += "; predicted NOT to fit (--force)"
    return reason


def _chunked_loss_hint(
    exp: Experiment, info: ModelInfo, by: dict[Candidate, Estimate], levers: Levers, budget: int, lp: int
) -> str:
    """When nothing fits and the whole logits cost a rung of the ladder (or every rung): what
    model.chunked_loss would save per rank, and the rung that would then fit. Empty when it would
    change nothing."""
    if (
        levers.chunked_loss
        or exp.model.factory is not None
        or info.chunked_problem
        or chunked_loss_problem(info.model_type)
    ):
        return ""
    import dataclasses as dc

    saved = activations_for(exp, info, lp, levers) - activations_for(
        exp, info, lp, dc.replace(levers, chunked_loss=True)
    )
    ladder = [by[c] for c in LADDER]
    for e in ladder:
        if e.fits or e.candidate.offload == "nvme":
            return ""  # the rungs below the chosen one would not fit even without the logits
        if e.fits_host and dataclasses.replace(e, activations=e.activations - saved).total <= budget:
            return (
                f"set model.chunked_loss: true (no whole logits: {format_size(saved)} less per rank) "
                f"and {e.candidate.name} fits"
            )
    return ""


def _table_for(
    by: dict[Candidate, Estimate], budget: int, device_memory: int, headroom: float, world: int
) -> str:
    plan_ = Plan(
        candidate=Candidate(-1),
        reason="",
        estimates=tuple(by.values()),
        budget=budget,
        device_memory=device_memory,
        host_memory=0,
        world_size=world,
        gpus_per_node=1,
        precision="",
        device_type="",
    )
    return (
        plan_.table()
        + f"\nusable per rank: {format_size(budget)} ({format_size(device_memory)} x {headroom})"
    )


def describe_plan(plan_: Plan) -> str:
    from trainer.strategy.planning.tables import describe

    return describe(plan_)
