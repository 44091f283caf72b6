"""`bin/report RUN_DIR`: a PNG of a run's curves and a short summary, from its metrics.jsonl.
`bin/report RUN_A RUN_B ...`: runs of one experiment at different world sizes compared: scaling
efficiency per strategy, and their loss curves overlaid (see `scaling`).

Four panels against the step: loss (train, and eval where evaluated), learning rate, throughput
(tokens/s, and MFU on GPU; each checkpoint save shaded from its step to its commit, labelled with
the seconds training was blocked), and peak memory per rank. A resumed run logs some steps twice (those
after the checkpoint it resumed from); the later attempt's values are the ones that count, so the
last record of each step is kept.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.errors import EXIT_USER_ERROR, UserError


def saves(run_dir: Path) -> list[dict[str, Any]]:
    """The checkpoint records of metrics.jsonl (one per committed save), in order."""
    return [r for r in _records(run_dir / "metrics.jsonl", '"checkpoint"') if "checkpoint" in r]


def load(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]], float]:
    """(train records, eval records, wall seconds over every attempt) from metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{run_dir}: no metrics.jsonl here; pass a run directory (run_dir of an experiment)")
    train: dict[int, dict[str, Any]] = {}
    evals: dict[int, dict[str, Any]] = {}
    wall, attempt_max, last_elapsed = 0.0, 0.0, -1.0
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"{path}:{n}: not a JSON line; the file is damaged") from None
        if "eval_loss" in rec:
            evals[rec["step"]] = rec
        elif "loss" in rec:
            train[rec["step"]] = rec
            elapsed = float(rec.get("elapsed_s", 0.0))
            if elapsed < last_elapsed:  # a new attempt (a resume) starts its clock again
                wall += attempt_max
                attempt_max = 0.0
            attempt_max, last_elapsed = max(attempt_max, elapsed), elapsed
    if not train:
        raise UserError(f"{path}: no training steps logged yet")
    return [train[s] for s in sorted(train)], [evals[s] for s in sorted(evals)], wall + attempt_max


def summary(
    run_dir: Path, train: list[dict[str, Any]], evals: list[dict[str, Any]], wall: float
) -> list[tuple[str, str]]:
    from trainer.checkpoint import checkpoints_dir, complete, latest
    from trainer.config import format_size
    from trainer.errors import UserError

    last = train[-1]
    steady = train[1:] or train  # the first interval includes warm-up
    rows = [
        ("steps", f"{last['step']:,}"),
        ("tokens", f"{last['tokens']:,}" if "tokens" in last else "?"),
        ("wall time", f"{wall:,.1f} s"),
        ("mean tokens/s", f"{sum(r['tokens_per_s'] for r in steady) / len(steady):,.0f}"),
        ("mean step time", f"{sum(r['step_time_s'] for r in steady) / len(steady) * 1000:,.0f} ms"),
        ("first / final loss", f"{train[0]['loss']:.4f} / {last['loss']:.4f}"),
    ]
    rows += cost_rows(run_dir, train)
    prefs = [r for r in train if "reward_margin" in r]
    if prefs:
        first, final = prefs[0], prefs[-1]
        rows.append(("reward margin / accuracy", f"{first['reward_margin']:.3f} / {first['reward_accuracy']:.2f} at "
                     f"step {first['step']} -> {final['reward_margin']:.3f} / {final['reward_accuracy']:.2f}"))  # fmt: skip
    rl = [r for r in train if r.get("reward") is not None]  # grpo: the combined reward, first and final
    if rl:
        rows.append(
            ("reward (combined)", f"{rl[0]['reward']:.3f} at step {rl[0]['step']} -> {rl[-1]['reward']:.3f}")
        )
    if evals and "eval_reward_margin" in evals[-1]:
        e = evals[-1]
        rows.append(("final eval loss (margin / accuracy)",
                     f"{e['eval_loss']:.4f} ({e['eval_reward_margin']:.3f} / {e['eval_reward_accuracy']:.2f})"))  # fmt: skip
    elif evals:
        rows.append(("final eval loss (ppl)", f"{evals[-1]['eval_loss']:.4f} ({evals[-1]['eval_ppl']:.2f})"))
    mfu = [r["mfu"] for r in steady if r.get("mfu") is not None]
    if mfu:
        rows.append(("mean MFU", f"{sum(mfu) / len(mfu):.1%}"))
    mem = [r["peak_memory_bytes"] for r in train if r.get("peak_memory_bytes")]
    if mem:
        kind = "device" if last.get("memory_kind") == "device" else "host RSS"
        rows.append((f"peak memory per rank ({kind})", format_size(max(mem))))
    stragglers = sum(1 for r in train if r.get("stragglers"))
    if stragglers:
        rows.append(("log intervals with a straggler", f"{stragglers}"))
    saved = saves(run_dir)
    if saved:
        blocked = sorted(r["blocked_s"] for r in saved)
        write = sorted(r["write_s"] for r in saved)
        kind = "in the background" if any(r.get("async") for r in saved) else "synchronously"
        rows.append(
            (
                "checkpoint saves",
                f"{len(saved)} written {kind}: training blocked {blocked[len(blocked) // 2]:.2f} s per save "
                f"(median; max {blocked[-1]:.2f} s), write {write[len(write) // 2]:.1f} s",
            )
        )
    found = complete(checkpoints_dir(run_dir))
    try:
        newest, _ = latest(checkpoints_dir(run_dir))
    except UserError:  # a damaged journal: a resume would refuse too
        newest = None
    rows.append(
        (
            "checkpoints",
            f"{len(found)} ({', '.join(f.tag for f in found)}); latest {newest.tag if newest else 'none'}"
            if found
            else "none",
        )
    )
    return rows


def cost_rows(run_dir: Path, train: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Device-hours (ranks x wall time) per attempt and in total, and tokens per device-hour: from the
    supervisor's attempts.jsonl where a supervisor ran the job (every attempt, a killed one too), else
    from the attempts' own records in metrics.jsonl."""
    attempts = _records(run_dir / "attempts.jsonl")
    source = "attempts.jsonl"
    if not attempts:
        attempts = [
            r for r in _records(run_dir / "metrics.jsonl", '"attempt"') if r.get("event") == "attempt"
        ]
        source = "metrics.jsonl"
    attempts = [a for a in attempts if "device_hours" in a]
    if not attempts:
        return []
    total = sum(a["device_hours"] for a in attempts)
    each = ", ".join(f"{a['device_hours']:.4g} ({a['ranks']} x {a['seconds']:.0f} s)" for a in attempts)
    tokens = train[-1].get("tokens")
    rows = [("device-hours", f"{total:.4g} over {len(attempts)} attempt(s): {each} [{source}]")]
    if tokens and total > 0:
        rows.append(("tokens per device-hour", f"{tokens / total:,.0f}"))
    return rows


def _records(path: Path, marker: str = "") -> list[dict[str, Any]]:
    """The JSON lines of `path` that contain `marker` (a cheap filter before parsing), skipping any
    that do not parse (a line cut by a crash); none where the file is missing."""
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        if marker in line:
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return out


def plot(run_dir: Path, train: list[dict[str, Any]], evals: list[dict[str, Any]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in train]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    fig.suptitle(f"{run_dir.name}: {steps[-1]:,} steps", fontsize=13)

    ax = axes[0][0]
    ax.plot(steps, [r["loss"] for r in train], label="train", color="tab:blue")
    if evals:
        ax.plot(
            [r["step"] for r in evals],
            [r["eval_loss"] for r in evals],
            "o-",
            label="eval",
            color="tab:orange",
        )
    ax.set_title("loss")
    ax.legend()
    prefs = [r for r in train if "reward_margin" in r]  # a preference objective: margin and accuracy
    if prefs:
        twin = ax.twinx()
        at = [r["step"] for r in prefs]
        twin.plot(at, [r["reward_margin"] for r in prefs], color="tab:cyan", label="reward margin")
        twin.plot(at, [r["reward_accuracy"] for r in prefs], color="tab:olive", label="reward accuracy")
        twin.legend(loc="upper right")
        ax.set_title("loss; reward margin and accuracy")
    rl = [r for r in train if "zero_std_share" in r]  # grpo: the reward curve, combined and each function's
    if rl:
        twin = ax.twinx()
        at = [r["step"] for r in rl]
        for key in [
            "reward",
            *sorted(k for k in rl[-1] if k.startswith("reward_") and not k.endswith("_std")),
        ]:
            twin.plot(at, [r.get(key, float("nan")) for r in rl], label=key.replace("reward_", "reward: "))
        twin.legend(loc="upper right")
        ax.set_title("loss; rewards")

    ax = axes[0][1]
    ax.plot(steps, [r["lr"] for r in train], color="tab:green")
    ax.set_title("learning rate")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))

    ax = axes[1][0]
    ax.plot(steps, [r["tokens_per_s"] for r in train], color="tab:purple", label="tokens/s (all ranks)")
    ax.set_title("throughput")
    ax.set_ylim(bottom=0)
    mfu = [(r["step"], r["mfu"]) for r in train if r.get("mfu") is not None]
    if mfu:
        twin = ax.twinx()
        twin.plot([s for s, _ in mfu], [100 * m for _, m in mfu], color="tab:gray", label="MFU %")
        twin.set_ylabel("MFU %")
    for i, rec in enumerate(saves(run_dir)):  # each save: from its step to its commit, and the stall
        start, end = rec.get("saved_step", rec["step"]), rec["step"]
        label = "checkpoint saves (blocked s)" if i == 0 else None
        ax.axvspan(start, max(end, start + 0.5), color="tab:orange", alpha=0.25, label=label, lw=0)
        ax.annotate(f"{rec['blocked_s']:.2f}", (start, 0), fontsize=7, color="tab:orange", va="bottom")
    ax.legend(loc="lower right")

    ax = axes[1][1]
    mem = [(r["step"], r["peak_memory_bytes"] / 2**30) for r in train if r.get("peak_memory_bytes")]
    kind = "device" if train[-1].get("memory_kind") == "device" else "host RSS"
    ax.plot([s for s, _ in mem], [m for _, m in mem], color="tab:red")
    ax.set_title(f"peak memory per rank, GiB ({kind})")
    ax.set_ylim(bottom=0)

    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="bin/report",
        description="Plot a run's loss, learning rate, throughput and memory; print a summary. Given "
        "several runs of one experiment at different world sizes: their strong and weak scaling "
        "efficiency per ZeRO strategy, and their loss curves overlaid.",
    )
    p.add_argument("run_dir", nargs="+", help="a run directory (holds metrics.jsonl), or several to compare")
    p.add_argument(
        "--out",
        default=None,
        help="PNG path (default: RUN_DIR/report.png; several runs: scaling.png beside them)",
    )
    args = p.parse_args(argv)
    if len(args.run_dir) > 1:
        return compare_main([Path(r) for r in args.run_dir], Path(args.out) if args.out else None)
    run_dir = Path(args.run_dir[0])
    try:
        train, evals, wall = load(run_dir)
        out = plot(run_dir, train, evals, Path(args.out) if args.out else run_dir / "report.png")
        rows = summary(run_dir, train, evals, wall)
    except UserError as e:
        print(e.render(), file=sys.stderr)
        return EXIT_USER_ERROR
    width = max(len(k) for k, _ in rows)
    print(f"run {run_dir}")
    for k, v in rows:
        print(f"  {k.ljust(width)}  {v}")
    from trainer.rl.completions import shown

    for line in shown(run_dir):  # grpo's train.rl.log_completions: the last ones the model wrote
        print(line)
    print(f"plot: {out}")
    return 0


# ----------------------------------------------------------------------------- several runs: scaling


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
