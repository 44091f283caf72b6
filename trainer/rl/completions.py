"""train.rl.log_completions: N of a log step's completions as the model wrote them, on rank 0: their prompts,
completions, each reward function's value, the combined reward, the advantage and what the functions logged
with `log_extra` (TRL's completions table; a column named as one of the row's own fields under
log_extra/<column>), a JSON line each in <run_dir>/completions.jsonl, and a wandb table
where wandb is on. The N are the first of rank 0's last generation before the log step (its first groups:
the step's first prompts), written only where the interval generated. bin/report shows the last ones."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class CompletionLog:
    def __init__(self, run_dir: str | Path, n: int, is_main: bool, *, step: Any, prompt_of: Any, group: int,
                 wandb: Any = None) -> None:  # fmt: skip
        self.path = Path(run_dir) / "completions.jsonl"
        self.n, self.is_main, self.step, self.wandb = n, is_main, step, wandb
        self.prompt_of, self.group = prompt_of, group  # a prompt as the data gives it, by its index
        self.rows: list[dict[str, Any]] = []

    def keep(self, scored: Any, rewards: list[Any]) -> None:
        """The generation's first N completions (called on every rank; kept on rank 0)."""
        if not self.is_main:
            return
        import torch

        from trainer.rl.rewards import combined

        n = min(self.n, len(scored.completions))
        total = combined(scored.rewards[:n], torch.tensor([r.weight for r in rewards], dtype=torch.float64))
        self.rows = []
        for i in range(n):
            row = {"prompt": self.prompt_of(scored.prompts[i // self.group]), "completion": scored.texts[i],
                   "ended": bool(scored.completions[i][1]),
                   "rewards": {r.label: _plain(float(scored.rewards[i, j])) for j, r in enumerate(rewards)},
                   "reward": _plain(float(total[i])), "advantage": float(scored.advantages[i])}  # fmt: skip
            row.update({column_name(k): v[i] for k, v in scored.logged.items()})
            self.rows.append(row)

    def write(self) -> None:
        """At a log step: the kept completions, a line each, with the step."""
        if not (self.is_main and self.rows):
            return
        step = int(self.step())
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            for row in self.rows:
                f.write(json.dumps({"step": step, **row}, default=str) + "\n")
        if self.wandb is not None:
            self.wandb.table("completions", [{"step": step, **r} for r in self.rows], step)
        self.rows = []


ROW = ("step", "prompt", "completion", "ended", "rewards", "reward", "advantage")  # a row's own fields
PREFIX = "log_extra/"


def column_name(column: str) -> str:
    """A log_extra column's name in the row: log_extra/<column> where the row has a field of that name."""
    return PREFIX + column if column in ROW or column.startswith(PREFIX) else column


def _plain(v: Any) -> Any:
    return None if v is None or v != v else v  # NaN (None from the function): null in JSON


def shown(run_dir: str | Path, limit: int = 4) -> list[str]:
    """bin/report's lines for the last logged step's completions (none without completions.jsonl)."""
    path = Path(run_dir) / "completions.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a crash: the others still show
            continue
    rows = [r for r in rows if isinstance(r, dict)]
    if not rows:
        return []
    step = rows[-1].get("step")
    last = [r for r in rows if r.get("step") == step][:limit]
    out = [f"completions at step {step} ({path}):"]
    for r in last:
        prompt = r.get("prompt")
        if isinstance(prompt, list):  # chat messages: the last one's content
            message = prompt[-1] if prompt else {}
            prompt = message.get("content", "") if isinstance(message, dict) else message
        rewards = r.get("rewards") if isinstance(r.get("rewards"), dict) else {}
        values = ", ".join(f"{k} {_shown(v)}" for k, v in rewards.items())
        out.append(f"  {prompt!r} -> {r.get('completion')!r}{'' if r.get('ended') else ' [...]'}")
        out.append(f"    reward {_shown(r.get('reward'))} ({values}), advantage {_shown(r.get('advantage'))}")
    return out


def _shown(v: Any) -> str:
    """A number as bin/report shows it; '-' for anything else (null, or what an edited file holds)."""
    return f"{v:.3g}" if isinstance(v, int | float) and not isinstance(v, bool) else "-"
