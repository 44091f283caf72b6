"""Weights & Biases, a metrics sink on rank 0.

The run logs the resolved experiment, the exact DeepSpeed JSON and the plan as its config, and
every metrics line as history. Its id is stored in each checkpoint's trainer_state.json, so a
resumed run continues the same wandb run (`resume="allow"`) instead of starting a new one.
`mode: offline` (the default) writes to `<run_dir>/wandb/` with no network; `wandb sync` uploads it
later. wandb is imported only when it is enabled.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

from trainer.common.errors import UserError
from trainer.config import WandbSection

log = logging.getLogger("trainer")


def new_run_id() -> str:
    """Eight lowercase letters and digits, as wandb makes them; from the OS's randomness, so that the
    seeded RNGs (and with them exact resume) are untouched."""
    import random
    import string

    return "".join(random.SystemRandom().choices(string.ascii_lowercase + string.digits, k=8))


class WandbRun:
    """A started wandb run: `write` a metrics record, `close` at the end. Never raises from `write`."""

    def __init__(
        self,
        section: WandbSection,
        *,
        name: str,
        run_dir: str | Path,
        config: dict[str, Any],
        run_id: str | None,
    ) -> None:
        try:
            import wandb
        except ImportError:
            raise UserError(
                "logging.wandb.enabled is true but wandb is not installed; pip install wandb, or set "
                "logging.wandb.enabled: false"
            ) from None
        self._wandb = wandb
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=section.project or name,
            entity=section.entity,
            name=section.run_name or name,
            tags=list(section.tags) or None,
            mode=section.mode,
            dir=str(run_dir),
            id=run_id or new_run_id(),
            resume="allow",
            config=config,
            settings=wandb.Settings(console="off", quiet=True, silent=True, x_disable_stats=True),
        )
        self.id: str = self.run.id
        log.info(
            f"wandb: run {self.id} ({section.mode}{', resumed' if run_id else ''}) in {run_dir / 'wandb'}"
        )

    def write(self, record: dict[str, Any]) -> None:
        """A metrics.jsonl record: scalars under train/ (or eval/), lists and dicts left out."""
        step = record.get("step")
        prefix = "eval/" if any(k.startswith("eval_") for k in record) else "train/"
        if "checkpoint" in record:
            prefix = "checkpoint/"
        if record.get("event") == "attempt":  # an attempt's device-hours (run/attempt.attempt_cost)
            prefix = "cost/"
        data = {
            prefix + k.removeprefix("eval_"): v
            for k, v in record.items()
            if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
        }
        with contextlib.suppress(Exception):  # a tracking hiccup must never stop training
            self._wandb.log(data, step=step)

    def table(self, name: str, rows: list[dict[str, Any]], step: int) -> None:
        """A table of records (train.rl.log_completions' completions), nested values as JSON text."""
        import json

        columns = list(dict.fromkeys(k for r in rows for k in r))
        cell = lambda v: json.dumps(v, default=str) if isinstance(v, dict | list) else v  # noqa: E731
        with contextlib.suppress(Exception):  # a tracking hiccup must never stop training
            table = self._wandb.Table(columns=columns, data=[[cell(r.get(c)) for c in columns] for r in rows])
            self._wandb.log({name: table}, step=step)

    def close(self, exit_code: int = 0) -> None:
        with contextlib.suppress(Exception):
            self.run.finish(exit_code=exit_code)
