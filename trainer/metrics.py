"""Metrics: rank-0 console lines (or a progress bar), metrics.jsonl, and wandb.

Per step the loop hands over the loss as a device tensor; it is summed on the device and only
gathered across ranks (one all-gather, one host sync) at each log interval. Throughput is counted
over the interval's wall time, so no per-step synchronisation is added; the progress bar advances
on the host clock and shows the last logged values.

Model FLOPs utilisation (GPU only): FLOPs per token = 6 N + 12 L H Q T (N parameters, L layers, H
heads of size Q, T tokens per sequence: the matmuls of forward and backward plus attention, as in
the PaLM paper and nanoGPT), times tokens per second per device, over the device's dense bf16 peak
(989 TFLOP/s on an H100 SXM; `logging.peak_tflops` overrides it).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("trainer")

HISTORY = 8  # records kept in memory (Metrics.history)


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


# Dense bf16 peak per device, by a substring of torch.cuda.get_device_name() (first match wins).
PEAK_BF16_TFLOPS = (
    ("H200", 989.4),
    ("H100 PCIe", 756.0),
    ("H100", 989.4),
    ("GH200", 989.4),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("A10G", 125.0),
    ("A10", 125.0),
    ("L4", 121.0),
    ("RTX 4090", 165.2),
    ("RTX 3090", 71.0),
    ("V100", 125.0),  # fp16: V100 has no bf16
)


def flops_per_token(params: int, layers: int | None, hidden: int | None, seq_len: int) -> float:
    """6 N + 12 L H Q T, with H Q = hidden size (forward and backward, attention included)."""
    return 6.0 * params + 12.0 * (layers or 0) * (hidden or 0) * seq_len


def peak_flops(device: Any, override_tflops: float | None = None) -> float | None:
    """The device's dense bf16 peak in FLOP/s; None on CPU or for an unknown GPU (no MFU then)."""
    if override_tflops:
        return override_tflops * 1e12
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    return next((tf * 1e12 for key, tf in PEAK_BF16_TFLOPS if key in name), None)


def peak_memory(device: Any) -> int:
    """Peak bytes this rank has held: allocated device memory on GPU, the process's peak RSS on CPU
    (a host counter either way: no synchronisation)."""
    if getattr(device, "type", None) == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


def duration(seconds: float) -> str:
    s = int(max(0, seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


@dataclass
class Interval:
    """Sums over the steps since the last log line."""

    steps: int = 0
    loss: Any = 0.0  # device tensor sum
    data_wait: float = 0.0
    forward: float = 0.0  # host seconds in forward (the rank's own compute, no collectives)
    paused: float = 0.0  # seconds in eval and checkpoint saves: not training, not counted in step time
    started: float = field(default_factory=time.perf_counter)


class ForwardTimer:
    """`with metrics.forward:` around forward and the loss check, per micro step."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._t = 0.0

    def __enter__(self) -> None:
        self._t = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self.metrics.interval.forward += time.perf_counter() - self._t


class Metrics:
    """Collects per-step values cheaply; reduces, prints and records them every `log_every` steps."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        is_main: bool,
        world_size: int,
        log_every: int,
        max_steps: int,
        samples_per_step: int,
        tokens_per_step: int,
        device: Any,
        hosts: list[str] | None = None,
        straggler_margin: float = 0.2,
        progress: bool = False,
        flops_per_token: float | None = None,
        peak_flops: float | None = None,
        wandb: Any = None,
    ) -> None:
        self.is_main = is_main
        self.hosts = hosts or ["?"] * world_size
        self.straggler_margin = straggler_margin
        self.forward = ForwardTimer(self)
        self.world_size = world_size
        self.log_every = log_every
        self.max_steps = max_steps
        self.samples_per_step = samples_per_step
        self.tokens_per_step = tokens_per_step
        self.device = device
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.wandb = wandb if is_main else None
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file: Any = None  # opened at the first record (a dry run writes nothing)
        self._closed = False
        self._progress = progress and is_main
        self._bar: Any = None
        self._redirect: Any = None
        self.interval = Interval()
        # The last records, on rank 0 (a checkpoint's trainer_state.json shows them): bounded, as
        # metrics.jsonl and wandb hold the whole history.
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=HISTORY)
        self.tokens = 0  # tokens trained so far (all ranks, resumed attempts included)
        self.last_loss: float | None = None
        self.first_loss: float | None = None
        self._t_start = time.perf_counter()

    @property
    def wandb_id(self) -> str | None:
        """Stored in checkpoints, so that a resumed run continues the same wandb run."""
        return getattr(self.wandb, "id", None)

    def step(
        self, step: int, loss: Any, data_wait: float, engine: Any, tokens: int = 0
    ) -> dict[str, Any] | None:
        """Account one optimizer step; at a log step, reduce across ranks and record a line."""
        self.tokens = tokens
        iv = self.interval
        iv.steps += 1
        iv.loss = iv.loss + loss
        iv.data_wait += data_wait
        if self._progress:
            self._advance(step)
        if step % self.log_every != 0 and step != self.max_steps:
            return None
        return self._flush(step, engine)

    def _advance(self, step: int) -> None:
        """The progress bar (rank 0, a terminal): host clock only, the last logged values as postfix.
        Log lines are written above it while it is open."""
        if self._bar is None:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._bar = tqdm(
                total=self.max_steps, initial=step - 1, unit="step", dynamic_ncols=True, file=sys.stdout
            )
            self._redirect = logging_redirect_tqdm(loggers=[log])
            self._redirect.__enter__()
        self._bar.update(step - self._bar.n)

    def _flush(self, step: int, engine: Any) -> dict[str, Any]:
        import torch
        import torch.distributed as dist

        iv = self.interval
        elapsed = max(time.perf_counter() - iv.started - iv.paused, 1e-9)
        mine = torch.stack(
            [
                torch.as_tensor(iv.loss, dtype=torch.float64, device=self.device).reshape(()),
                torch.tensor(iv.data_wait, dtype=torch.float64, device=self.device),
                torch.tensor(iv.forward, dtype=torch.float64, device=self.device),
                torch.tensor(float(peak_memory(self.device)), dtype=torch.float64, device=self.device),
            ]
        )
        cols = mine.numel()
        if dist.is_initialized() and self.world_size > 1:  # one collective per log line, none per step
            everyone = torch.zeros(self.world_size, cols, dtype=torch.float64, device=self.device)
            dist.all_gather_into_tensor(everyone, mine.reshape(1, cols))
        else:
            everyone = mine.reshape(1, cols)
        rows = everyone.tolist()
        loss = sum(r[0] for r in rows) / self.world_size / iv.steps
        wait_share = sum(r[1] for r in rows) / self.world_size / elapsed
        busy = [(r[1] + r[2]) / iv.steps for r in rows]  # per rank: data wait + forward, per step
        tokens_per_s = self.tokens_per_step * iv.steps / elapsed
        step_time = elapsed / iv.steps
        rec = {
            "step": step,
            "tokens": self.tokens,
            "loss": loss,
            "lr": engine.lr,
            "grad_norm": engine.grad_norm,
            "tokens_per_s": tokens_per_s,
            "samples_per_s": self.samples_per_step * iv.steps / elapsed,
            "tokens_per_s_per_rank": tokens_per_s / self.world_size,
            "samples_per_s_per_rank": self.samples_per_step * iv.steps / elapsed / self.world_size,
            "step_time_s": step_time,
            "data_wait_share": min(1.0, max(0.0, wait_share)),
            "mfu": (
                tokens_per_s / self.world_size * self.flops_per_token / self.peak_flops
                if self.flops_per_token and self.peak_flops
                else None
            ),
            "peak_memory_bytes": int(max(r[3] for r in rows)),
            "memory_kind": "device" if getattr(self.device, "type", None) == "cuda" else "host_rss",
            "skipped_steps": engine.skipped_steps,
            "elapsed_s": time.perf_counter() - self._t_start,
            "eta_s": (self.max_steps - step) * step_time,
            "rank_busy_s": busy,
            "rank_tokens_per_s": [self.tokens_per_step / self.world_size / max(b, 1e-9) for b in busy],
        }
        stragglers = self._stragglers(busy)
        if stragglers:
            rec["stragglers"] = stragglers
        self.last_loss = loss
        if self.first_loss is None:
            self.first_loss = loss
        self.interval = Interval()
        self.record(rec)
        if self.is_main:
            self._print(rec, stragglers)
        return rec

    def _print(self, rec: dict[str, Any], stragglers: list[dict[str, Any]]) -> None:
        from trainer.config import format_size

        gn = rec["grad_norm"]
        mfu = f"  mfu {rec['mfu']:.1%}" if rec["mfu"] is not None else ""
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
        for s in stragglers:
            log.warning(
                f"straggler: rank {s['rank']} on {s['host']} spends {s['busy_ms']:.0f} ms per step in data + "
                f"forward, {s['slower_by']:.0%} more than the median {s['median_ms']:.0f} ms"
            )

    def _stragglers(self, busy: list[float]) -> list[dict[str, Any]]:
        """Ranks whose own time per step (data wait + forward, no collectives) exceeds the median by
        more than the margin (and by at least 2 ms, so timer noise on tiny steps is not reported)."""
        if len(busy) < 2:
            return []
        median = (
            sorted(busy)[len(busy) // 2]
            if len(busy) % 2
            else sum(sorted(busy)[len(busy) // 2 - 1 : len(busy) // 2 + 1]) / 2
        )
        out = []
        for r, b in enumerate(busy):
            if b > median * (1 + self.straggler_margin) and b - median > 0.002:
                out.append(
                    {
                        "rank": r,
                        "host": self.hosts[r],
                        "busy_ms": b * 1000,
                        "median_ms": median * 1000,
                        "slower_by": b / max(median, 1e-9) - 1,
                    }
                )
        return out

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """`with metrics.paused():` around eval and checkpointing: step time and throughput measure
        training steps only."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.interval.paused += time.perf_counter() - t

    def eval(self, step: int, loss: float) -> None:
        rec = {"step": step, "eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}
        self.record(rec)
        if self.is_main:
            log.info(f"eval  step {step:>6}  loss {loss:.4f}  ppl {rec['eval_ppl']:.2f}")

    def recent(self) -> dict[str, Any]:
        """The latest value of each metric among the last few records (rank 0)."""
        return {k: v for rec in list(self.history)[-3:] for k, v in rec.items()}

    def record(self, rec: dict[str, Any]) -> None:
        if self.is_main:
            self.history.append(rec)
        if self.is_main and self._file is None and not self._closed:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)  # noqa: SIM115  (closed in close())
        if self._file is not None:
            self._file.write(json.dumps(rec) + "\n")
        if self.wandb is not None:
            self.wandb.log(rec)

    def close(self, exit_code: int = 0) -> None:
        self._closed = True
        if self._bar is not None:
            self._bar.close()
            self._redirect.__exit__(None, None, None)
            self._bar = self._redirect = None
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
        if self.wandb is not None:
            self.wandb.finish(exit_code)
            self.wandb = None
