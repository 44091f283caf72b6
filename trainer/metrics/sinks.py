"""Where metrics records go, on rank 0: the console (log lines, or a progress bar in a terminal),
`metrics.jsonl`, and wandb (`wandb_run.py`). A sink has `write(record)` and `close(exit_code)`; a
new one is a class here (or its own file) added to the list `Metrics` is given."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from trainer.common.units import format_size
from trainer.metrics.measure import duration

log = logging.getLogger("trainer")


def setup_logging(is_main: bool, rank: int, level: str = "info") -> None:
    """Rank 0 logs at `level`; other ranks only warnings and errors, prefixed with their rank."""
    lvl = getattr(logging, level.upper()) if is_main else logging.WARNING
    fmt = "%(asctime)s %(message)s" if is_main else f"%(asctime)s [rank {rank}] %(levelname)s %(message)s"
    handler = logging.StreamHandler(sys.stdout if is_main else sys.stderr)
    handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
    log.handlers[:] = [handler]
    log.setLevel(lvl)
    log.propagate = False
    quiet_libraries()


def quiet_libraries() -> None:
    """Libraries speak only when something is wrong (DeepSpeed's own warnings at init are noise)."""
    import warnings

    warnings.filterwarnings(
        "ignore", message=".*all_gather_into_tensor.*is deprecated", category=FutureWarning
    )
    warnings.filterwarnings(
        "ignore", message=".*reduce_scatter_tensor.*is deprecated", category=FutureWarning
    )
    for name in ("DeepSpeed", "deepspeed", "torch.distributed", "datasets", "transformers"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.ERROR)
    except ImportError:
        pass
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:
        pass


class JsonlSink:
    """`<run_dir>/metrics.jsonl`: one JSON record per line, appended (a resumed run continues the
    file); opened at the first record, so a dry run writes nothing."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file: Any = None
        self._closed = False

    def write(self, rec: dict[str, Any]) -> None:
        if self._file is None and not self._closed:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)  # noqa: SIM115  (closed in close())
        if self._file is not None:
            self._file.write(json.dumps(rec) + "\n")

    def close(self, exit_code: int = 0) -> None:
        self._closed = True
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None


class ConsoleSink:
    """A log line per record (and a warning per straggler); in a terminal also a progress bar that
    advances on the host clock with the last logged values, the log lines written above it."""

    def __init__(self, max_steps: int, progress: bool) -> None:
        self.max_steps = max_steps
        self._progress = progress
        self._bar: Any = None
        self._redirect: Any = None

    def advance(self, step: int) -> None:
        if not self._progress:
            return
        if self._bar is None:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._bar = tqdm(
                total=self.max_steps, initial=step - 1, unit="step", dynamic_ncols=True, file=sys.stdout
            )
            self._redirect = logging_redirect_tqdm(loggers=[log])
            self._redirect.__enter__()
        self._bar.update(step - self._bar.n)

    def write(self, rec: dict[str, Any]) -> None:
        if "eval_loss" in rec:
            what = (
                _unpaired(rec, "eval_")
                if "eval_desirable" in rec
                else f"margin {rec['eval_reward_margin']:.3f}  acc {rec['eval_reward_accuracy']:.2f}  rewards chosen "
                f"{rec['eval_rewards_chosen']:.3f} rejected {rec['eval_rewards_rejected']:.3f}"
                if "eval_reward_margin" in rec
                else f"ppl {rec['eval_ppl']:.2f}"
                if "eval_ppl" in rec
                else "(the divergence to the teacher)"
            )
            log.info(f"eval  step {rec['step']:>6}  loss {rec['eval_loss']:.4f}  {what}")
            for s in rec.get("samples", []):
                end = " [end]" if s["ended"] else " [...]"
                log.info(f"sample step {rec['step']}: {s['prompt']!r} -> {s['completion']!r}{end}")
            return
        if "step_time_s" not in rec:  # not a training step's record
            return
        gn = rec["grad_norm"]
        mfu = f"  mfu {rec['mfu']:.1%}" if rec["mfu"] is not None else ""
        if "desirable" in rec:  # kto's unpaired rows
            mfu = f"  {_unpaired(rec)}" + mfu
        elif "reward_margin" in rec:  # a preference objective's pairs
            mfu = f"  margin {rec['reward_margin']:.3f}  acc {rec['reward_accuracy']:.2f}" + mfu
        elif "zero_std_share" in rec:  # grpo: the rewards, the completions, generation's share of the time
            share = f"  gen {rec['generation_share']:.0%}" if "generation_share" in rec else ""
            # (no reward: every function gave None in the interval; no std: one completion scored)
            r, sd = rec.get("reward"), rec.get("reward_std")
            mfu = (f"  reward {'-' if r is None else f'{r:.3f}'} (std {'-' if sd is None else f'{sd:.2f}'})  "
                   f"len {rec['completion_length']:.1f}{share}" + mfu)  # fmt: skip
        if self._bar is not None:
            self._bar.set_postfix_str(
                f"loss {rec['loss']:.4f} lr {rec['lr']:.2e} tok/s {rec['tokens_per_s']:,.0f}{mfu}",
                refresh=False,
            )
        log.info(
            f"step {rec['step']:>6}/{self.max_steps}  loss {rec['loss']:.4f}  lr {rec['lr']:.3e}  "
            f"grad_norm {gn if gn is None else f'{gn:.3f}'}  tok/s {rec['tokens_per_s']:,.0f}  "
            f"step {rec['step_time_s'] * 1000:.0f} ms  data {rec['data_wait_share']:.1%}{mfu}  "
            f"mem {format_size(rec['peak_memory_bytes'])}  eta {duration(rec['eta_s'])}"
        )
        for s in rec.get("stragglers", []):
            log.warning(
                f"straggler: rank {s['rank']} on {s['host']} spends {s['busy_ms']:.0f} ms per step in data + "
                f"forward, {s['slower_by']:.0%} more than the median {s['median_ms']:.0f} ms"
            )

    def close(self, exit_code: int = 0) -> None:
        if self._bar is not None:
            self._bar.close()
            self._redirect.__exit__(None, None, None)
            self._bar = self._redirect = None


def _unpaired(rec: dict[str, Any], prefix: str = "") -> str:
    """kto's line: the margin (where both classes were seen), the KL reference point, and at an eval each class's
    mean reward (those seen)."""
    out = [f"margin {rec[prefix + 'reward_margin']:.3f}"] if f"{prefix}reward_margin" in rec else []
    out += [f"kl {rec[prefix + 'kl']:.4f}"] if f"{prefix}kl" in rec else []
    if prefix:
        out += [f"rewards {k} {rec[prefix + 'rewards_' + k]:.3f}" for k in ("chosen", "rejected")
                if f"{prefix}rewards_{k}" in rec]  # fmt: skip
    return "  ".join(out) or f"{rec[prefix + 'rows']} rows"
