"""The decision: the fastest setting that fits under the escalation rules (search.py), or the pinned
candidate and why (`plan`), the `Plan` that records it with the evidence, and its table (`describe_plan`);
the errors when nothing fits or a pin needs a justification.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from trainer.common.errors import UserError
from trainer.config import Experiment, format_size
from trainer.strategy.batch import accumulation
from trainer.strategy.planning import pins, stages
from trainer.strategy.planning.activations import activations_for, host_activations, rows_per_micro
from trainer.strategy.planning.axes import axes_reason, degrees, rank_model, refuse_zero3, zero_world
from trainer.strategy.planning.candidates import LADDER, Candidate, ModelInfo, pinned_choice
from trainer.strategy.planning.estimate import Estimate, estimate_all, with_activations
from trainer.strategy.planning.generation import generation_bytes, host_bytes, row_length
from trainer.strategy.planning.hardware import machine
from trainer.strategy.planning.hints import fit_hint
from trainer.strategy.planning.levers import Levers, lever_sets, tiled_loss_by_default
from trainer.strategy.planning.search import Search, rung_reason, search
from trainer.strategy.planning.speed import StepTime, Timer
from trainer.strategy.planning.states import low_precision_bytes, model_states


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
    hardware: str = ""  # the machine the steps are timed on, and where its figures come from (hardware.py)

    @property
    def sp(self) -> int:
        return self.levers.sp

    @property
    def tp(self) -> int:
        return self.levers.tp

    @property
    def ep(self) -> int:
        return self.levers.ep

    @property
    def pp(self) -> int:
        return self.levers.pp

    @property
    def dp_world(self) -> int:
        """The data-parallel world: the ranks that hold different sequences (world / sequence or tensor
        parallel: the ranks of a group read the same rows)."""
        return self.world_size // self.levers.mp

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
            "tensor_parallel": self.levers.tp,
            "expert_parallel": self.levers.ep,
            "pipeline_stages": self.levers.pp,
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


def _covers(r: Candidate, c: Candidate) -> bool:
    """Rung `r` keeps whatever `c` moves off a rank's device: as high a stage, as much offloaded."""
    level = {"none": 0, "cpu": 1, "nvme": 3}
    return r.stage >= c.stage and level[r.offload] + r.offload_params >= level[c.offload] + c.offload_params


def escalation_after(plan: Plan) -> tuple[Levers, Candidate] | None:
    """What the run-time escalation tries after an out-of-memory on the plan's (levers, rung): the
    next rung up the ladder that keeps what this one moved off the device and is estimated to hold no
    more (an experiment that pins `strategy.offload: none` never climbs into offload, and NVMe needs its
    path), then, past the last rung it may take, the next setting of the activation levers in the plan's
    order on that rung. Nothing the failed attempt had is given up (no lower stage, no less offloaded, no
    lever turned off, no smaller sequence-parallel degree), so every attempt holds less than the last."""
    by = {e.candidate: e for e in plan.estimates}
    now = by.get(plan.candidate)
    # a rung refused for another reason than memory (NVMe offload without strategy.nvme_path)
    blocked = {e.candidate for e in plan.estimates if not e.fits_device and e.total <= plan.budget}
    for rung in LADDER[LADDER.index(plan.candidate) + 1 :] if plan.candidate in LADDER else ():
        if (
            rung in by
            and rung not in blocked
            and _covers(rung, plan.candidate)
            and not (plan.offload_pin == "none" and rung.offload != "none")
            and (now is None or by[rung].total <= now.total)
        ):
            return plan.levers, rung
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
    device_name: str | None = None,
) -> Plan:
    """Estimate every candidate and choose by the escalation rules (see the module docstring).
    `device_name`: this machine's GPU (torch.cuda.get_device_name), for strategy.hardware.gpu: auto.

    Raises UserError when a pinned candidate is above the rules' choice without a justification,
    or is predicted not to fit (unless `force`), or when nothing fits."""
    kw = dict(world_size=world_size, gpus_per_node=gpus_per_node, device_type=device_type, device_memory=device_memory,
              host_memory=host_memory, precision=precision, template=template, force=force,
              device_name=device_name)  # fmt: skip
    narrowing = pins.constraints(
        exp, template
    )  # offload none, offload_params: no pin, only fewer rungs (pins.py)
    try:
        p = _planned(exp, info, kw)
    except pins.Blocked as err:
        free = _free(exp, info, kw)
        raise err if free is None else pins.blocks(narrowing, err, free) from None
    if narrowing:
        free = _free(exp, info, kw)
        why = pins.needs_justification(narrowing, p, free, exp)
        p = dataclasses.replace(
            p, reason="; ".join(filter(None, [p.reason, pins.note(narrowing, p, free), why]))
        )
    return p


def _planned(exp: Experiment, info: ModelInfo, kw: dict[str, Any]) -> Plan:
    if exp.train.micro_batch_size == "auto":  # decided first (strategy/batch.py), then planned as given
        from trainer.strategy.batch import resolve

        exp = resolve(exp, kw["world_size"], lambda e: _plan(e, info, **kw))[0]
    return _plan(exp, info, **kw)


def _free(exp: Experiment, info: ModelInfo, kw: dict[str, Any]) -> Plan | None:
    """The plan without the experiment's constraints (None: nothing fits then either)."""
    exp, template = pins.lifted(exp, kw["template"])
    try:
        return _planned(exp, info, {**kw, "template": template})
    except UserError:
        return None


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
    device_name: str | None = None,
) -> Plan:
    s = exp.strategy
    lp = low_precision_bytes(precision)
    budget = int(device_memory * s.headroom)
    pinned = pinned_choice(exp, template)
    is_pinned = pins.is_pin(pinned)  # a stage or an offload to the host; the rest only narrows (pins.py)
    hardware, hardware_why = machine(device_type, s.hardware, device_name)

    estimates_for = _estimator(exp, info, pinned, lp=lp, world_size=world_size, gpus_per_node=gpus_per_node,
                               on_gpu=device_type == "cuda", budget=budget, host_memory=host_memory,
                               template=template, bf16=precision == "bf16")  # fmt: skip
    large = sum(model_states(Candidate(0), info.params, info.largest_layer, world_size, lp)) > budget
    axes = (*degrees(exp, info, world_size, gpus_per_node, hardware.peers, precision, template, large, device_type),
            stages.degrees(exp, info, world_size, device_type, large))  # fmt: skip
    settings = list(lever_sets(exp, info, world_size, device_type, precision, axes))
    times: dict[tuple[Levers, Candidate], StepTime] = {}
    timer = Timer(exp, info, world_size=world_size, gpus_per_node=gpus_per_node, lp=lp, hardware=hardware)

    def seconds(levers: Levers, c: Candidate) -> StepTime:
        t = times.get((levers, c))
        if t is None:
            t = times[levers, c] = timer(levers, c)
        return t

    found = search(settings, estimates_for, pinned, seconds)
    # the rules' own choice, which a pin above needs a justification against
    auto = search(settings, estimates_for, (None, None, None), seconds) if is_pinned else found
    auto_choice = auto.chosen.candidate if auto.chosen else None
    if found.chosen is not None:
        levers, chosen = found.chosen.levers, found.chosen.candidate
    else:
        allowed = set(found.order)  # the closest setting on a rung the pins allow and the axes do not refuse
        levers = min(found.estimates, key=lambda lv: min((e.total for e in found.estimates[lv] if (lv, e.candidate)
                                                          in allowed and not e.refused), default=float("inf")))  # fmt: skip
        chosen = None
    estimates = found.estimates[levers]
    by = {e.candidate: e for e in estimates}
    hint = fit_hint(exp, info, by, levers, budget, lp, device_type)
    if chosen is None:
        pinned_options = [c for c, _ in _pinned_order(found, levers)] if is_pinned else []
        if not (is_pinned and force and pinned_options):
            table = _table_for(by, budget, device_memory, s.headroom, world_size)
            err = pins.no_fit(exp, by, pinned_options, auto_choice, hint, budget, device_memory, world_size, found,
                              host_memory, len(settings), table)  # fmt: skip
            raise pins.Blocked(str(err)) if any(x is not None for x in pinned) and not is_pinned else err
        chosen = pinned_options[0]
    reason = (
        _reason(exp, by, chosen, auto_choice, auto, budget)
        if is_pinned
        else rung_reason(found, by, hint, budget)
    )
    default_tiled = tiled_loss_by_default(exp, info, device_type, precision)
    return Plan(
        candidate=chosen, reason=reason, estimates=tuple(estimates), budget=budget, device_memory=device_memory,
        host_memory=host_memory, world_size=world_size, gpus_per_node=gpus_per_node, precision=precision,
        device_type=device_type, pinned=is_pinned, justification=s.justification.strip(), auto_choice=auto_choice,
        levers=levers,
        levers_reason=("the tiled loss by default on CPU in bf16, where it is the faster loss; " if default_tiled else "")
        + _levers_reason(levers, settings, found, budget),
        order=tuple(found.order), offload_pin=pinned[1], speed=seconds(levers, chosen),
        fastest=tuple((f.levers, f.candidate, f.time) for f in found.fits),
        row_seconds=tuple(seconds(levers, e.candidate).seconds for e in estimates), hardware=hardware_why,
    )  # fmt: skip


def _estimator(
    exp: Experiment, info: ModelInfo, pinned: Any, *, lp: int, world_size: int, gpus_per_node: int, on_gpu: bool,
    budget: int, host_memory: int | None, template: Mapping[str, Any] | None, bf16: bool = False,
) -> Callable[[Levers], list[Estimate]]:  # fmt: skip
    """Every rung's estimate under one setting of the levers: the model states, buffers and host needs of
    every rung, which no lever changes but the accumulation (ZeRO-1/2 keep more gradients with it; a global
    batch's accumulation follows the sequence-parallel degree: `accumulation`), counted once each, and each
    setting's activations beside them."""
    bases: dict[tuple[bool, int, int, int], list[Estimate]] = {}

    def base_for(accum: int, tp: int, ep: int, pp: int) -> list[Estimate]:
        if (accum > 1, tp, ep, pp) not in bases:
            e = exp.model_copy(update={"train": exp.train.model_copy(update={"grad_accum": accum})})
            # one rank's model under the axes (axes.py)
            local = rank_model(info, tp, ep, pp, exp.data.seq_len)
            made = estimate_all(
                e, info, pinned, act=0, lp=lp, world_size=world_size, gpus_per_node=gpus_per_node, on_gpu=on_gpu,
                budget=budget, host_memory=host_memory, template=template,
                host_activations=host_bytes(e) * gpus_per_node, generation=generation_bytes(e, local, lp),
                states=(local, zero_world(info, local, world_size, tp * pp, ep)),
            )  # fmt: skip
            bases[accum > 1, tp, ep, pp] = stages.refuse_sharded(refuse_zero3(made, tp), pp, bf16)
        return bases[accum > 1, tp, ep, pp]

    def estimates_for(levers: Levers) -> list[Estimate]:
        # sequence parallelism runs sdpa where auto would have picked eager (CPU, bf16, short sequences)
        sp_info = rank_model(info, levers.tp, levers.ep, levers.pp, exp.data.seq_len)
        if levers.sp > 1 and info.attn_implementation == "eager" and exp.model.attn_implementation == "auto":
            sp_info = dataclasses.replace(sp_info, attn_implementation="sdpa")
        accum = accumulation(exp, world_size, levers.mp)
        act = stages.stage_activations(
            lambda i: activations_for(exp, i, lp, levers, "cuda" if on_gpu else "cpu"),
            sp_info,
            levers.pp,
            accum,
        )  # (pipeline stages: the micro batches in flight)
        extra = (
            host_activations(info, rows_per_micro(exp), row_length(exp), lp, levers.sp)
            if levers.offload
            else 0
        )
        copy = exp.checkpoint.async_ is True
        base = base_for(accum, levers.tp, levers.ep, levers.pp)
        return with_activations(base, act, extra * gpus_per_node, budget, host_memory, copy)

    return estimates_for


def _pinned_order(found: Search, levers: Levers) -> list[tuple[Candidate, Estimate]]:
    """The rungs the pin allows under `levers`, cheapest first, with their estimates."""
    by = {e.candidate: e for e in found.estimates[levers]}
    return [(c, by[c]) for lv, c in found.order if lv == levers]


def _levers_reason(levers: Levers, settings: list[Levers], found: Search, budget: int) -> str:
    """Why these levers: none needed, or the fastest setting that fits, and what the cheaper settings'
    lowest rung would need."""
    fixed = len(settings) == 1
    if levers == settings[0]:
        return "as the experiment sets them" if fixed else "the cheapest setting: a rung fits without more"
    cheapest = found.estimates[settings[0]]
    allowed = {c for lv, c in found.order if lv == settings[0]}
    best = min((e for e in cheapest if e.candidate in allowed), key=lambda e: e.total)
    chosen = found.chosen
    seen, others = {chosen.candidate} if chosen else set(), []
    for f in found.fits:  # the fastest on each other rung
        if f.candidate not in seen and len(others) < 2 and not (found.device_only and f.offloads):
            seen.add(f.candidate)
            others.append(f"{f.candidate.name} with {f.levers.describe()} {f.time.seconds:.2f} s")
    return (
        "the fastest setting that fits"
        + (
            f" (est. {chosen.time.seconds:.2f} s a step"
            + (f"; next: {'; '.join(others)}" if others else "")
            + ")"
            if chosen
            else ""
        )  # fmt: skip
        + f"; without levers the smallest candidate ({best.candidate.name}) "
        f"needs {format_size(best.total)} per rank ({format_size(best.activations)} of activations) of "
        f"{format_size(budget)}" + axes_reason(levers, found)
    )


def _reason(
    exp: Experiment,
    by: dict[Candidate, Estimate],
    chosen: Candidate,
    auto_choice: Candidate | None,
    auto: Search,
    budget: int,
) -> str:
    """Why `chosen`, pinned by the experiment (and, above the rules' choice, the justification it requires)."""
    s = exp.strategy
    e = by[chosen]
    reason = (
        f"{chosen.name} pinned by the experiment ({format_size(e.total)} of {format_size(budget)} per rank)"
    )
    if auto_choice is not None and chosen.cost > auto_choice.cost:
        if not s.justification.strip():
            assert auto.chosen is not None
            a = auto.estimates[auto.chosen.levers]
            total = next(x.total for x in a if x.candidate == auto_choice)
            raise UserError(
                f"strategy: {chosen.name} is pinned, but the cheaper {auto_choice.name} fits "
                f"({format_size(total)} of {format_size(budget)} per rank). Set "
                f"strategy.zero_stage/offload/offload_params to auto to use {auto_choice.name}, or say why in "
                "strategy.justification."
            )
        reason += f"; the rules would pick {auto_choice.name}; justification: {s.justification.strip()}"
    if not e.fits:
        reason += "; predicted NOT to fit (--force)"
    return reason


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
