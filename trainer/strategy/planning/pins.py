"""What the experiment pins and what it only constrains (ladder.py's `plan`).

A ZeRO stage (`strategy.zero_stage`, or the stage of `strategy.deepspeed`'s template) or an offload to the host
or NVMe pins a rung: above the rules' choice it needs `strategy.justification`, and `--force` runs it when it is
predicted not to fit. `strategy.offload_params` and `strategy.offload: none` (or a template whose optimizer stays
on the device) only narrow the rungs the rules choose from: the plan is compared with the rules' choice without
them (`free`: the same job with them lifted, its micro batch chosen again), and says when they change nothing;
one that moves the choice to a costlier rung needs the justification a pin would; and when one is what blocks the
job, the error names it, the rung that would fit without it and the fix (`--force` forces nothing for it).
`no_fit` is the error when nothing fits, pinned or not, naming the resource that blocks it (search.py's
`blocker`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainer.common.errors import UserError
from trainer.config import Experiment, format_size
from trainer.strategy.batch import TIE
from trainer.strategy.planning.candidates import Candidate, pinned_choice
from trainer.strategy.planning.estimate import Estimate
from trainer.strategy.planning.search import Search, blocker


@dataclass(frozen=True)
class Constraint:
    """A setting that narrows the rungs without pinning one: `key: value`, and how to lift it."""

    key: str
    value: str
    fix: str
    params: bool = False  # offload_params (applies at stage 3 with offload), else the offload itself

    def __str__(self) -> str:
        return f"{self.key}: {self.value}"


class Blocked(UserError):
    """Nothing fits under a constraint (no pin): `plan` says whether lifting it would fit."""


def is_pin(pinned: tuple[int | None, str | None, bool | None]) -> bool:
    """A stage, or an offload to the host or NVMe, pins a rung; offload none and offload_params do not."""
    stage, offload, _ = pinned
    return stage is not None or offload not in (None, "none")


def constraints(exp: Experiment, template: Mapping[str, Any] | None) -> list[Constraint]:
    """What narrows the rungs without pinning one (none when a rung is pinned: the pin's rules apply)."""
    pinned = pinned_choice(exp, template)
    if is_pin(pinned):
        return []
    s, out = exp.strategy, []
    _, offload, params = pinned
    if offload == "none":
        if s.offload == "none":
            out.append(Constraint("strategy.offload", "none", "set strategy.offload: auto"))
        else:  # the template's zero_optimization.offload_optimizer.device
            key = f"strategy.deepspeed ({s.deepspeed})'s zero_optimization.offload_optimizer.device"
            out.append(Constraint(key, "none", "remove offload_optimizer from the template"))
    if params is not None:  # (a template's offload_param comes with an offload pin)
        out.append(
            Constraint(
                "strategy.offload_params", str(params).lower(), "set strategy.offload_params: auto", True
            )
        )
    return out


def lifted(
    exp: Experiment, template: Mapping[str, Any] | None
) -> tuple[Experiment, Mapping[str, Any] | None]:
    """The experiment and template without their constraints: the job the rules would plan freely."""
    update = {"offload_params": "auto"} | ({"offload": "auto"} if exp.strategy.offload == "none" else {})
    exp = exp.model_copy(update={"strategy": exp.strategy.model_copy(update=update)})
    zero = (template or {}).get("zero_optimization")
    if isinstance(zero, Mapping) and "offload_optimizer" in zero:
        template = copy.deepcopy(dict(template))
        template["zero_optimization"].pop("offload_optimizer")
    return exp, template


def _names(cs: list[Constraint]) -> str:
    return " and ".join(map(str, cs))


def _choice(p: Any) -> str:
    return f"{p.candidate.name} with {p.levers.describe()}"


def note(cs: list[Constraint], p: Any, free: Any) -> str:
    """For the reason of plan `p`: what the constraints did, against `free` (None: nothing fits without them)."""
    c = p.candidate
    same = (
        free is not None
        and (free.candidate, free.levers) == (c, p.levers)
        and abs(free.speed.per_token - p.speed.per_token) <= TIE * free.speed.per_token
    )
    if same:
        applies = any(not k.params or (c.stage == 3 and c.offload != "none") for k in cs)
        why = (
            f"the rules take {c.name} either way"
            if applies
            else f"it applies to ZeRO-3 with offload, and the rules take {c.name}"
        )
        return f"{_names(cs)} has no effect: {why}"
    if free is None:
        return f"as {_names(cs)} allows"
    return (
        f"as {_names(cs)} allows: without it the rules would take {_choice(free)} "
        f"(est. {free.speed.per_token * 1e6:,.1f} us a token)"
    )


def needs_justification(cs: list[Constraint], p: Any, free: Any, exp: Experiment) -> str:
    """A constraint that moves the choice to a costlier rung than the rules' needs strategy.justification, as a
    pin above it does: the reason's words for it, or the error."""
    if free is None or p.candidate.cost <= free.candidate.cost:
        return ""
    why = exp.strategy.justification.strip()
    if why:
        return f"justification: {why}"
    fix = "; ".join(k.fix for k in cs)
    raise UserError(
        f"strategy: {_names(cs)} moves the plan to {p.candidate.name}, above {free.candidate.name}, which fits "
        f"({format_size(free.estimate.total)} of {format_size(free.budget)} per rank). "
        f"{fix[:1].upper() + fix[1:]} to use {free.candidate.name}, or say why in strategy.justification."
    )


def blocks(cs: list[Constraint], err: Blocked, free: Any) -> UserError:
    """The error when nothing the constraints allow fits and the rules' choice without them (`free`) would:
    it names them, that choice and the fix, with the table of what they allow (`err`'s)."""
    first, _, rest = str(err).partition("\n\n")
    closest = first.split(": ", 1)[-1].split(". To fit")[0]  # what blocks it under the constraints
    return UserError(
        f"strategy: {_names(cs)} blocks the job, where {_choice(free)} fits ({format_size(free.estimate.total)} "
        f"of {format_size(free.budget)} per rank); with it, {closest}. To fit: {'; '.join(k.fix for k in cs)} "
        f"(--force runs no rung predicted not to fit for a constraint)." + (f"\n\n{rest}" if rest else "")
    )


def no_fit(
    exp: Experiment,
    by: dict[Candidate, Estimate],
    pinned_options: list[Candidate],
    auto_choice: Candidate | None,
    hint: str,
    budget: int,
    device_memory: int,
    world_size: int,
    found: Search,
    host_memory: int | None,
    settings: int,
    table: str,
) -> UserError:
    """The error when the pinned candidate (`pinned_options[0]`), or anything at all, does not fit, naming
    what blocks it (device or host memory, NVMe's path); the table under the setting of the levers that
    comes closest (`by`), of the `settings` tried."""
    headroom = exp.strategy.headroom
    if pinned_options:
        c, e = pinned_options[0], by[pinned_options[0]]
        host = e.host if exp.checkpoint.async_ is True else e.host - e.snapshot  # as the fit was judged
        if e.refused:  # whatever its size: --force cannot run it
            why = f"is refused ({e.refused}), whatever its size"
        elif e.total > budget or e.fits_host:
            why = (
                f"is predicted not to fit: {format_size(e.total)} per rank against {format_size(budget)} usable "
                f"of {format_size(device_memory)}"
            )
        else:
            why = (
                f"is predicted not to fit: it needs {format_size(host)} of host memory a node, "
                f"{format_size(host_memory or 0)} here"
            )
        msg = (
            f"strategy: the pinned {c.name} {why}. "
            + (
                f"The rules would pick {auto_choice.name}; set strategy.zero_stage/offload: auto. "
                if auto_choice
                else ""
            )
            + ("" if e.refused else "Pass --force to run anyway.")
        )
    else:
        tried = (
            f" under any of the {settings} settings of the activation levers the experiment allows"
            if settings > 1
            else ""
        )
        what, fix = blocker(
            found, budget, host_memory, bool(exp.strategy.nvme_path), exp.checkpoint.async_ is True
        )
        # a rung that would fit but is refused: the setting that refuses it is a fix too
        refused = [e for e in by.values() if e.refused and e.total <= budget and e.fits_host]
        but = (
            f" ({refused[0].candidate.name} would fit, but is refused: {refused[0].refused})"
            if refused
            else ""
        )
        msg = (
            f"strategy: nothing fits in {format_size(budget)} per rank ({format_size(device_memory)} x headroom "
            f"{headroom}) on {world_size} rank(s){tried}: {what}{but}. To fit: {fix}."
        )
    return UserError(msg + (f" Or {hint}." if hint else "") + "\n\n" + table)
