"""What --plan prints of a plan (ladder.py's `Plan`): its table and the text around it."""

from __future__ import annotations

from typing import Any

from trainer.config import format_size


def plan_table(self: Any) -> str:
    """The plan's table: each candidate's bytes, its estimated step under the chosen levers, whether it fits."""
    gen = any(e.generation for e in self.estimates)  # grpo: what generation holds between steps
    head = ("candidate", "params", "grads", "optimizer", "activations", "step", *(("generation",) if gen else ()),
            "buffers", "total/rank", "host/node", "step est.", "fits")  # fmt: skip
    rows = [head]
    times = self.row_seconds or (None,) * len(self.estimates)
    for e, sec in zip(self.estimates, times, strict=True):
        mark = " <-" if e.candidate == self.candidate else ""
        fits = "yes" if e.fits else ("no (host)" if e.fits_device else "no")
        if e.candidate.offload == "nvme" and not e.fits and e.total <= self.budget:
            fits = "no (needs strategy.nvme_path)"
        if e.refused:
            fits = f"no ({e.refused})"
        rows.append(
            (
                e.candidate.name,
                *(
                    format_size(x)
                    for x in (
                        e.params,
                        e.grads,
                        e.optimizer,
                        e.activations,
                        e.step,
                        *((e.generation,) if gen else ()),
                        e.buffers,
                        e.total,
                        e.host,
                    )  # fmt: skip
                ),
                f"{sec:.2f} s" if sec is not None else "-",
                fits + mark,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    last = len(head) - 1
    lines = [
        "  ".join(
            c.ljust(w) if i in (0, last) else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def describe(plan_: Any) -> str:
    """--plan's text: the table, the budget, the levers, the decision and its estimated step."""
    mem = f"{format_size(plan_.device_memory)} {plan_.device_type} memory x headroom -> {format_size(plan_.budget)} usable per rank"
    host = (
        f"host memory {format_size(plan_.host_memory)} per node"
        if plan_.host_memory is not None
        else "host memory not checked (set strategy.host_memory for the target machine)"
    )
    snap = plan_.estimate.snapshot
    if snap:
        host += (
            f" (host/node counts the copy an asynchronous save takes, checkpoint.async: {format_size(snap)})"
        )
    levers = (
        f"\nactivation levers: {plan_.levers.describe()} ({plan_.levers_reason})"
        if plan_.levers_reason
        else ""
    )
    speed = (
        f"\nestimated step: {plan_.speed.describe()} of {len(plan_.fastest)} setting(s) that fit, timed on "
        f"{plan_.hardware} (docs/strategies.md: the step's cost)"
        if plan_.speed is not None and plan_.fastest
        else ""
    )
    from trainer.strategy.planning.axes import layout

    lv = plan_.levers
    ranks = f"\nlayout: {layout(plan_.world_size, lv.sp, lv.tp, lv.ep, lv.pp)}"
    return (
        f"{plan_.table()}\n\n{mem}; {host}; world size {plan_.world_size} ({plan_.gpus_per_node} per node); "
        f"precision {plan_.precision}{ranks}{levers}\ndecision: {plan_.candidate.name}: {plan_.reason}{speed}"
    )
