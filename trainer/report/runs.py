"""`bin/report RUN_DIR`: a PNG of a run's curves and a short summary, from its metrics.jsonl.

Four panels against the step: loss (train, and eval where evaluated), learning rate, throughput
(tokens/s, and MFU on GPU; each checkpoint save shaded from its step to its commit, labelled with
the seconds training was blocked), and peak memory per rank. A resumed run logs some steps twice (those
after the checkpoint it resumed from); the later attempt's values are the ones that count, so the
last record of each step is kept.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from trainer.common.errors import UserError


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
    from trainer.common.errors import UserError
    from trainer.config import format_size

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
        acc = "reward_accuracy" in first  # (kto's rows are unpaired: a margin, no accuracy)
        show = (lambda r: f"{r['reward_margin']:.3f} / {r['reward_accuracy']:.2f}") if acc else (
            lambda r: f"{r['reward_margin']:.3f}")  # fmt: skip
        rows.append(("reward margin / accuracy" if acc else "reward margin",
                     f"{show(first)} at step {first['step']} -> {show(final)}"))  # fmt: skip
    rl = [r for r in train if r.get("reward") is not None]  # grpo: the combined reward, first and final
    if rl:
        rows.append(
            ("reward (combined)", f"{rl[0]['reward']:.3f} at step {rl[0]['step']} -> {rl[-1]['reward']:.3f}")
        )
    if evals and "eval_reward_margin" in evals[-1]:
        e = evals[-1]
        acc = f" / {e['eval_reward_accuracy']:.2f}" if "eval_reward_accuracy" in e else ""
        rows.append((f"final eval loss (margin{' / accuracy' if acc else ''})",
                     f"{e['eval_loss']:.4f} ({e['eval_reward_margin']:.3f}{acc})"))  # fmt: skip
    elif evals and "eval_ppl" not in evals[-1]:
        what = "kto, one class" if "eval_desirable" in evals[-1] else "the divergence to the teacher"
        rows.append((f"final eval loss ({what})", f"{evals[-1]['eval_loss']:.4f}"))
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
        if "reward_accuracy" in prefs[0]:
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
