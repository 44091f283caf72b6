"""`bin/report RUN_A RUN_B ...`: runs of one experiment at different world sizes compared: scaling
efficiency per strategy, and their loss curves overlaid (see `scaling`)."""

from __future__ import annotations

import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.common.errors import EXIT_USER_ERROR, UserError
from trainer.report.runs import load


@dataclass(frozen=True)
class RunFacts:
    """What scaling needs of one run, from its metrics.jsonl."""

    run_dir: Path
    world: int
    strategy: str  # "zero2", "zero2+cpu", or "?" for a run logged before runs recorded it
    tokens_per_step: int
    step_s: float  # median step time over the log intervals after the first (warm-up)
    train: tuple[dict[str, Any], ...]

    @property
    def per_rank(self) -> float:
        return self.tokens_per_step / self.world

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def label(self) -> str:
        rank = "rank" if self.world == 1 else "ranks"
        return f"{self.run_dir.name}: {self.world} {rank}, {self.strategy}, {self.tokens_per_step:,} tok/step"


def facts(run_dir: Path) -> RunFacts:
    train, _, _ = load(run_dir)
    last = train[-1]
    world = int(last.get("world_size") or len(last.get("rank_busy_s") or [1]))
    tokens = last.get("tokens_per_step") or round(last["tokens_per_s"] * last["step_time_s"])
    steady = [r["step_time_s"] for r in train[1:]] or [last["step_time_s"]]
    return RunFacts(
        run_dir, world, str(last.get("strategy", "?")), int(tokens), statistics.median(steady), tuple(train)
    )


@dataclass(frozen=True)
class Scaling:
    """One comparison: `base` (fewest ranks) against `run`, with the batch kind kept fixed."""

    kind: str  # strong: the global batch kept; weak: the batch per rank kept
    base: RunFacts
    run: RunFacts

    @property
    def ranks(self) -> float:
        return self.run.world / self.base.world

    @property
    def speedup(self) -> float:
        """Strong: how much faster one step of the same global batch is."""
        return self.base.step_s / self.run.step_s

    @property
    def efficiency(self) -> float:
        """Strong: speedup / ranks; weak: time per step at the base / at more ranks, i.e. the speedup
        (ideal: 1)."""
        return self.speedup / self.ranks if self.kind == "strong" else self.speedup

    def loss_gap(self) -> tuple[float, int] | None:
        """Strong pairs train the same global batches: (max |loss difference|, steps compared) over
        the steps both logged."""
        a = {r["step"]: r["loss"] for r in self.base.train}
        b = {r["step"]: r["loss"] for r in self.run.train}
        shared = sorted(set(a) & set(b))
        return (max(abs(a[s] - b[s]) for s in shared), len(shared)) if shared else None


def scaling(runs: list[RunFacts]) -> list[Scaling]:
    """Per strategy: strong scaling between runs with the same global batch (tokens per step), weak
    scaling between runs with the same batch per rank; each against the one with the fewest ranks."""
    out = []
    for kind, key in (("strong", lambda r: r.tokens_per_step), ("weak", lambda r: r.per_rank)):
        groups: dict[tuple[str, float], list[RunFacts]] = {}
        for r in runs:
            groups.setdefault((r.strategy, key(r)), []).append(r)
        for group in groups.values():
            base = min(group, key=lambda r: r.world)
            out += [Scaling(kind, base, r) for r in group if r.world > base.world]
    return out


def scaling_lines(runs: list[RunFacts], found: list[Scaling]) -> list[str]:
    width = max(len(r.run_dir.name) for r in runs)
    lines = [
        f"{'run'.ljust(width)}  ranks  strategy   tokens/step (per rank)  ms/step  tokens/s  tokens/s/rank  final loss",
    ]
    for r in runs:
        lines.append(
            f"{r.run_dir.name.ljust(width)}  {r.world:>5}  {r.strategy:<9}  {r.tokens_per_step:>11,} ({r.per_rank:>8,.0f})"
            f"  {r.step_s * 1000:>7.1f}  {r.tokens_per_s:>8,.0f}  {r.tokens_per_s / r.world:>13,.0f}  {r.train[-1]['loss']:>10.4f}"
        )
    lines.append("")
    for strategy in sorted({r.strategy for r in runs}):
        for kind in ("strong", "weak"):
            mine = [s for s in found if s.kind == kind and s.base.strategy == strategy]
            what = "global batch kept" if kind == "strong" else "batch per rank kept"
            if not mine:
                lines.append(
                    f"{strategy} {kind} scaling ({what}): no two runs at different world sizes to compare"
                )
            for s in mine:
                n = f"{s.base.world} -> {s.run.world} ranks ({s.base.run_dir.name} -> {s.run.run_dir.name})"
                if kind == "strong":
                    gap = s.loss_gap()
                    same = (
                        f"; losses differ by at most {gap[0]:.2g} over {gap[1]} logged steps" if gap else ""
                    )
                    lines.append(
                        f"{strategy} strong scaling efficiency {s.efficiency:.1%} ({what}, {s.base.tokens_per_step:,} tokens): "
                        f"{n}: {s.speedup:.2f}x faster per step of {s.ranks:g}x ideal{same}"
                    )
                else:
                    lines.append(
                        f"{strategy} weak scaling efficiency {s.efficiency:.1%} ({what}, {s.base.per_rank:,.0f} tokens): "
                        f"{n}: step {s.base.step_s * 1000:.1f} -> {s.run.step_s * 1000:.1f} ms"
                    )
    return lines


def plot_scaling(runs: list[RunFacts], found: list[Scaling], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, step_ax, tput_ax) = plt.subplots(1, 3, figsize=(17, 5.5), constrained_layout=True)
    names = ", ".join(r.run_dir.name for r in runs)
    fig.suptitle(f"scaling: {names if len(names) < 120 else f'{len(runs)} runs'}", fontsize=12)
    for i, r in enumerate(runs):
        style = dict(color=f"C{i % 10}", ls=["-", "--", ":", "-."][(r.world - 1) % 4], label=r.label)
        loss_ax.plot([x["tokens"] / 1e6 for x in r.train], [x["loss"] for x in r.train], **style)
        step_ax.plot([x["step"] for x in r.train], [x["loss"] for x in r.train], **style)
    loss_ax.set_title("loss against tokens trained")
    loss_ax.set_xlabel("tokens (M)")
    step_ax.set_title("loss against step (strong pairs: the same global batches)")
    step_ax.set_xlabel("step")
    for ax in (loss_ax, step_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    names = [f"{r.strategy}\n{r.world}r {r.tokens_per_step:,}" for r in runs]
    bars = tput_ax.bar(
        range(len(runs)), [r.tokens_per_s for r in runs], color=[f"C{i % 10}" for i in range(len(runs))]
    )
    tput_ax.set_xticks(range(len(runs)), names, fontsize=7)
    for s in found:
        j = runs.index(s.run)
        tput_ax.annotate(
            f"{s.kind} {s.efficiency:.0%}",
            (j, bars[j].get_height()),
            ha="center",
            va="bottom",
            fontsize=7,
            xytext=(0, 2 + 9 * (s.kind == "weak")),
            textcoords="offset points",
        )
    tput_ax.set_title("tokens/s (all ranks), with scaling efficiency")
    tput_ax.grid(alpha=0.3, axis="y")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def compare_main(run_dirs: list[Path], out: Path | None) -> int:
    try:
        runs = [facts(d) for d in run_dirs]
    except UserError as e:
        print(e.render(), file=sys.stderr)
        return EXIT_USER_ERROR
    found = scaling(runs)
    if out is None:
        common = Path(os.path.commonpath([d.resolve() for d in run_dirs]))
        out = (common if common not in {d.resolve() for d in run_dirs} else common.parent) / "scaling.png"
    for line in scaling_lines(runs, found):
        print(line)
    print(f"plot: {plot_scaling(runs, found, out)}")
    return 0
