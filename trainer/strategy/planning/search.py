"""The choice among every (activation levers, ZeRO rung) that fits (`search`): the lowest estimated seconds a
token (speed.py), under the escalation rules as constraints: ZeRO's offload (of the optimizer, and at stage 3
the parameters) only when no setting without it fits, and a costlier rung only where
the cheaper ones do not fit or are slower by the model (`rung_reason` says which, for the banner). Ties,
within `TIE` of each other, go to the cheaper in memory order: fewer levers (levers.py's order), then the
lower rung. (The checkpointed activations' host copies are a lever like the others, timed by what
crosses the host link, not an offload rung.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from trainer.config import format_size
from trainer.strategy.batch import TIE
from trainer.strategy.planning.candidates import LADDER, Candidate
from trainer.strategy.planning.estimate import Estimate
from trainer.strategy.planning.levers import Levers
from trainer.strategy.planning.speed import StepTime


@dataclass(frozen=True)
class Fit:
    """One (levers, rung) that fits, with its estimated step."""

    levers: Levers
    candidate: Candidate
    time: StepTime
    setting: int  # the levers' position in the memory order (levers.py: cheapest first)

    @property
    def offloads(self) -> bool:
        """ZeRO's offload: the optimizer (and at stage 3 perhaps the parameters) off the devices."""
        return self.candidate.offload != "none"

    @property
    def order(self) -> tuple[int, int]:
        return self.setting, self.candidate.cost


@dataclass
class Search:
    """What `search` found."""

    fits: list[Fit] = field(default_factory=list)  # every (levers, rung) that fits, fastest first
    order: list[tuple[Levers, Candidate]] = field(default_factory=list)  # every one tried, memory order
    estimates: dict[Levers, list[Estimate]] = field(default_factory=dict)  # every setting's estimates
    chosen: Fit | None = None
    device_only: bool = False  # some setting fits without ZeRO's offload (so none with it was considered)

    def best_on(self, c: Candidate) -> Fit | None:
        """The fastest setting of the levers that fits on rung `c`."""
        return next((f for f in self.fits if f.candidate == c), None)


def fastest(fits: list[Fit]) -> Fit | None:
    """The fastest of `fits`; among those within TIE of it, the cheapest in memory order."""
    if not fits:
        return None
    best = min(f.time.per_token for f in fits)
    return min((f for f in fits if f.time.per_token <= best * (1 + TIE)), key=lambda f: f.order)


def options(pinned: tuple[int | None, str | None, bool | None]) -> list[Candidate]:
    """The rungs to choose from, cheapest first: the ladder, less what the experiment pins away."""
    want_stage, want_offload, want_params = pinned
    return [
        c
        for c in LADDER
        if (want_stage is None or c.stage == want_stage)
        and (want_offload is None or c.offload == want_offload)
        and (want_params is None or c.stage < 3 or c.offload == "none" or c.offload_params == want_params)
    ]


def search(
    settings: list[Levers],
    estimates_for: Callable[[Levers], list[Estimate]],
    pinned: tuple[int | None, str | None, bool | None],
    seconds: Callable[[Levers, Candidate], StepTime],
) -> Search:
    """Every setting of the levers on every rung the experiment allows; the fastest that fits under the
    escalation rules (see the module docstring)."""
    out, allowed = Search(), options(pinned)
    for i, levers in enumerate(settings):
        estimates = estimates_for(levers)
        out.estimates[levers] = estimates
        by = {e.candidate: e for e in estimates}
        out.order += [(levers, c) for c in allowed]
        out.fits += [Fit(levers, c, seconds(levers, c), i) for c in allowed if by[c].fits]
    out.fits.sort(key=lambda f: (f.time.per_token, f.order))
    device = [f for f in out.fits if not f.offloads]
    out.device_only = bool(device)
    out.chosen = fastest(device or out.fits)
    return out


def rung_reason(found: Search, by: dict[Candidate, Estimate], hint: str, budget: int) -> str:
    """Why this rung (unpinned): the first that fits, or the fastest, and for each cheaper rung why not (it
    does not fit: what it needs under the chosen levers; or it is slower by the model); offload, when taken,
    because no rung fits without it, and when not, the faster offload the rules passed over."""
    chosen = found.chosen
    assert chosen is not None
    c, t = chosen.candidate, chosen.time
    e = by[c]
    use = f"{format_size(e.total)} of {format_size(budget)} per rank"
    slower, needs = [], []
    allowed = {r for _, r in found.order}  # (offload none and offload_params leave some out: pins.py says so)
    for r in (r for r in LADDER[: LADDER.index(c)] if r in allowed):
        other = found.best_on(r)
        if other is not None:
            slower.append(f"{r.name} fits ({other.levers.describe()}) but is slower by the model: "
                          f"{_us(other.time)} against {_us(t)} us a token")  # fmt: skip
        elif by[r].refused:
            needs.append(f"{r.name}: {by[r].refused}")
        else:
            host = " (host)" if by[r].fits_device else ""
            needs.append(f"{r.name} needs {format_size(by[r].total)}{host}")
    what = "the fastest setting that fits" if slower else "the first rung that fits"
    parts = [f"{c.name} is {what} ({use}; est. {t.seconds:.2f} s a step, {_us(t)} us a token)"]
    if chosen.offloads:
        parts.append("offload because no rung fits without it")
    else:
        passed = next((f for f in found.fits if f.offloads), None)
        if passed is not None and passed.time.per_token < t.per_token * (1 - 1e-6):
            parts.append(f"not {passed.candidate.name} ({passed.levers.describe()}, est. {_us(passed.time)} us a "
                         "token): offload only when no rung fits without it")  # fmt: skip
    return "; ".join(parts + slower + needs + ([hint] if hint else []))


def _us(t: StepTime) -> str:
    return f"{t.per_token * 1e6:,.1f}"


def blocker(
    found: Search, budget: int, host_memory: int | None, nvme_path: bool, copy: bool = False
) -> tuple[str, str]:
    """When nothing fits: (what blocks it, the advice for that resource). Host memory when some setting fits
    the devices but not the host; an NVMe rung that would fit without a path; else device memory, with the
    setting that comes closest (and the host's advice too where that setting misses the host as well). The host
    figures are those the fit was judged by: the copy an asynchronous save takes only with `copy`
    (checkpoint.async: true; auto saves synchronously where it does not fit)."""
    allowed = set(found.order)  # the rungs the experiment allows (offload none, offload_params narrow them)
    every = [
        e for lv, es in found.estimates.items() for e in es if (lv, e.candidate) in allowed and not e.refused
    ]

    def host(e: Estimate) -> int:
        return e.host if copy else e.host - e.snapshot

    on_device = [e for e in every if e.total <= budget]
    # NVMe helps where its rung fits the device and its swap buffers the host, and only a path is missing
    nvme = not nvme_path and any(
        e.candidate.offload == "nvme" and (host_memory is None or host(e) <= host_memory) for e in on_device
    )
    host_fix = (
        "give the nodes more host memory (strategy.host_memory when planning for another machine) or spread the "
        "job over more nodes"
        + (", give strategy.nvme_path for NVMe offload" if nvme else "")
        + (", or set checkpoint.async: auto or false (true counts the copy a save takes)" if copy else "")
    )
    copied = " (with the copy a save takes: checkpoint.async: true)" if copy else ""
    host_short = [e for e in on_device if not e.fits_host]
    if host_short and host_memory is not None:
        e = min(host_short, key=host)
        return (
            f"host memory blocks it: {e.candidate.name} fits the device ({format_size(e.total)} of "
            f"{format_size(budget)} per rank) but needs {format_size(host(e))} of host memory a node{copied}, "
            f"{format_size(host_memory)} here",
            host_fix,
        )
    if nvme:
        return (
            f"only NVMe offload fits the device ({format_size(min(e.total for e in on_device))} per rank)",
            "give strategy.nvme_path, a directory on a fast local disk",
        )
    e = min(every or [e for es in found.estimates.values() for e in es], key=lambda e: e.total)
    levers = next(lv for lv, es in found.estimates.items() if e in es)
    host_too = host_memory is not None and not e.fits_host
    what = (
        f", and host memory too: it needs {format_size(host(e))} a node{copied}, {format_size(host_memory)} here"
        if host_too
        else ""
    )
    return (
        f"device memory blocks it: the smallest setting, {e.candidate.name} with {levers.describe()}, needs "
        f"{format_size(e.total)} per rank ({format_size(e.activations)} of activations"
        + (f", {format_size(e.generation)} while generating" if e.generation > e.activations else "")
        + f"){what}",
        "lower train.micro_batch_size or data.seq_len, let the levers help (model.activation_checkpointing, "
        "model.tiled_mlp, strategy.sequence_parallel: auto) or add ranks"
        + (f"; and for the host memory, {host_fix}" if host_too else ""),
    )
