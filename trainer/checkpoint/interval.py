"""`checkpoint.every_minutes: auto`: the checkpoint interval that minimises the expected lost work
plus the saves' overhead (Young 1974, with Daly's 2006 higher-order correction).

A job of N nodes, each failing on average every `checkpoint.mtbf_hours` (M_node), fails every
M = M_node / N. A save stops training for delta seconds (the blocked time: with asynchronous saves the
host copy, the write goes on in the background; synchronous, the whole write). Saving every tau
seconds costs delta / tau of the time, and a failure loses on average tau / 2 of work (plus, for
asynchronous saves, the write time, during which the newest save is not yet committed: a constant
that does not move the optimum). Young's optimum is tau = sqrt(2 delta M); Daly's, used here:

    tau = sqrt(2 delta M) (1 + sqrt(delta / 2M) / 3 + (delta / 2M) / 9) - delta   for delta < 2M, else M.

Until a save is measured, delta is estimated from the plan's host copy per node (at 2 GB/s for the
copy of an asynchronous save, 0.5 GB/s for a synchronous write); every committed save then measures
it (the median of the saves so far), and the interval is logged at start and whenever it moves by
more than 10%.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

HOST_COPY_BYTES_PER_S = 2e9
DISK_BYTES_PER_S = 0.5e9
MIN_COST_S = 1e-3


def daly(cost_s: float, mtbf_s: float) -> float:
    """Daly's optimal interval (seconds of work between saves) for a save costing `cost_s` and a job
    failing every `mtbf_s` seconds on average."""
    if cost_s >= 2 * mtbf_s:
        return mtbf_s
    r = cost_s / (2 * mtbf_s)
    return math.sqrt(2 * cost_s * mtbf_s) * (1 + math.sqrt(r) / 3 + r / 9) - cost_s


@dataclass
class AutoInterval:
    """The interval of `every_minutes: auto`, re-estimated as saves are measured."""

    mtbf_s: float  # the job's: a node's over the nodes
    cost_s: float  # a save's blocked time
    source: str  # how cost_s is known
    measured: list[float] = field(default_factory=list)

    @property
    def minutes(self) -> float:
        return daly(max(self.cost_s, MIN_COST_S), self.mtbf_s) / 60

    def describe(self) -> str:
        return (
            f"checkpoint.every_minutes: auto = {self.minutes:.2f} min (Young/Daly: a save blocks training "
            f"{self.cost_s:.3g} s, {self.source}; the job fails every {self.mtbf_s / 3600:,.1f} h on average)"
        )

    def observe(self, blocked_s: float) -> str | None:
        """A committed save's blocked time; the new interval's line when it moved by more than 10%."""
        before = self.minutes
        self.measured.append(blocked_s)
        self.cost_s = statistics.median(self.measured)
        self.source = f"the median of {len(self.measured)} measured save(s)"
        return self.describe() if abs(self.minutes - before) > 0.1 * before else None


def auto_interval(mtbf_node_hours: float, nodes: int, snapshot_bytes: int, background: bool) -> AutoInterval:
    """The interval before any save is measured: the cost from the host copy per node (the plan's)."""
    rate = HOST_COPY_BYTES_PER_S if background else DISK_BYTES_PER_S
    how = "the host copy" if background else "the synchronous write"
    cost = snapshot_bytes / rate
    source = f"estimated from {how} of {snapshot_bytes / 1e9:.3g} GB per node at {rate / 1e9:g} GB/s until measured"
    return AutoInterval(mtbf_s=mtbf_node_hours * 3600 / max(1, nodes), cost_s=cost, source=source)


def for_plan(section: Any, plan: Any, nodes: int) -> AutoInterval:
    """The interval of `section` (checkpoint: every_minutes auto) for a job of `nodes` nodes on `plan`
    (strategy.Plan): its host copy per node, its saves asynchronous or not, before any is measured."""
    background, _ = plan.checkpoint_async(section.async_)
    return auto_interval(section.mtbf_hours, nodes, plan.estimate.snapshot, background)
