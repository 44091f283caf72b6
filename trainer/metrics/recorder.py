"""`Metrics`: collects per-step values cheaply, and every `log_every` steps reduces them across ranks
and hands one record to the sinks (rank 0: console, metrics.jsonl, wandb).

Per step the loop hands over the loss as a device tensor; it is summed on the device and only
gathered across ranks (one all-gather, one host sync) at each log interval. Throughput is counted
over the interval's wall time, so no per-step synchronisation is added.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainer.metrics.measure import Interval, UtilisationWatch, peak_memory, stragglers
from trainer.metrics.sinks import ConsoleSink, JsonlSink

HISTORY = 8  # records kept in memory (Metrics.history)
# the fields of a training record the run writes itself (training_record's, the stragglers, a mixture's tokens
# by source; and Metrics.tags): names a reward function's log_metric may not take (grpo_metrics.py)
FIELDS = ("step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "samples_per_s", "tokens_per_s_per_rank",
          "samples_per_s_per_rank", "step_time_s", "data_wait_share", "mfu", "peak_memory_bytes", "memory_kind",
          "peak_load_bytes", "skipped_steps", "elapsed_s", "eta_s", "rank_busy_s", "rank_tokens_per_s",
          "world_size", "tokens_per_step", "stragglers", "tokens_by_source", "samples")  # fmt: skip
log = logging.getLogger("trainer")


class ForwardTimer:
    """`with metrics.forward:` around forward and the loss check, per micro step."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._t = 0.0

    def __enter__(self) -> None:
        self._t = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self.metrics.interval.forward += time.perf_counter() - self._t


def eval_record(
    step: int, loss: float, extra: dict[str, Any] | None, perplexity: bool = True
) -> dict[str, Any]:
    """An eval's record: the loss and its perplexity; a preference objective's loss has none (the
    exponential of a DPO loss means nothing), its eval rewards, margin and accuracy (`extra`) instead; nor has
    distillation's (a divergence: `perplexity` false)."""
    rec: dict[str, Any] = {"step": step, "eval_loss": loss}
    if extra:
        return rec | {f"eval_{k}": v for k, v in extra.items()}
    return rec | {"eval_ppl": math.exp(min(loss, 50.0))} if perplexity else rec


class Metrics:
    """Collects per-step values cheaply; reduces them and records a line every `log_every` steps."""

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
        tags: dict[str, Any] | None = None,
        loss_ranks: int | None = None,
        perplexity: bool = True,
    ) -> None:
        self.is_main, self.perplexity = is_main, perplexity  # (distillation: its eval loss has no perplexity)
        # the ranks a step's loss is spread over: under sequence parallelism each rank holds its shard's
        # share, summed over its group, so the mean is over the data-parallel ranks
        self.loss_ranks = loss_ranks or world_size
        # fields every training record carries (world size, strategy, batch: bin/report compares runs)
        self.tags = dict(tags or {})
        self.hosts = hosts or ["?"] * world_size
        self.straggler_margin = straggler_margin
        self.forward = ForwardTimer(self)
        self.world_size = world_size
        self.log_every = log_every
        self.max_steps = max_steps
        self.samples_per_step = samples_per_step
        self.tokens_per_step = tokens_per_step
        self.device = device
        self.load_peak: int | None = None  # CUDA: the peak before training (the model's load, set-up)
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.console = ConsoleSink(max_steps, progress) if is_main else None
        self.sinks: list[Any] = [self.console, JsonlSink(run_dir)] if is_main else []  # rank 0 writes
        self.interval = Interval()
        # The last records, on rank 0 (a checkpoint's trainer_state.json shows them): bounded, as
        # metrics.jsonl and wandb hold the whole history.
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=HISTORY)
        self.tokens = 0  # tokens trained so far (all ranks, resumed attempts included)
        self.lr = 0.0  # the LR the last step applied
        self.extra: Any = None  # a callable adding fields to each training record (tokens per source)
        # a callable every rank calls at a log step (it reduces across ranks), adding fields to the
        # record: a preference objective's rewards, margin, accuracy and log-probs
        self.reduced: Any = None
        self.watch = gpu_watch(device)  # GPU utilisation under 80% for a window: a warning (measure.py)
        self.last_loss: float | None = None
        self.first_loss: float | None = None
        self._t_start = time.perf_counter()

    def add_sink(self, sink: Any) -> None:
        """Another destination for the records (rank 0), e.g. a started wandb run."""
        self.sinks += [sink] if self.is_main else []

    def start(self) -> None:
        """The training loop starts: the first interval's clock (training only, not the reference's
        log-probs of DPO, a resume's load or the set-up), and on CUDA the load's peak (`load_peak`). An
        interval with steps in it (the loop run again, as --profile does) is kept."""
        self.interval = self.interval if self.interval.steps else Interval()
        self.load_peak = load_peak(self.device) if self.load_peak is None else self.load_peak

    @property
    def wandb_id(self) -> str | None:
        """Stored in checkpoints, so that a resumed run continues the same wandb run."""
        return next((s.id for s in self.sinks if hasattr(s, "id")), None)

    def step(
        self, step: int, loss: Any, data_wait: float, engine: Any, *, lr: float, tokens: int = 0,
        fed: int | None = None,
    ) -> dict[str, Any] | None:  # fmt: skip
        """Account one optimizer step; at a log step, reduce across ranks and record a line. `lr`: the
        LR this step applied (read before DeepSpeed's step; the engine's is the next step's by now);
        `tokens`: trained so far; `fed`: this step's tokens, all ranks (default: tokens_per_step)."""
        self.tokens = tokens
        self.lr = lr
        iv = self.interval
        iv.steps += 1
        iv.tokens += self.tokens_per_step if fed is None else fed
        iv.loss = iv.loss + loss
        iv.data_wait += data_wait
        if self.console is not None:
            self.console.advance(step)
        if step % self.log_every != 0 and step != self.max_steps:
            return None
        return self._flush(step, engine)

    def _flush(self, step: int, engine: Any) -> dict[str, Any]:
        iv = self.interval
        elapsed = max(time.perf_counter() - iv.started - iv.paused, 1e-9)
        rows = gather_interval(iv, self.device, self.world_size)
        rec = training_record(self, step, engine, elapsed, rows)
        if self.reduced is not None:
            rec.update(self.reduced())
        busy = rec["rank_busy_s"]
        loss = rec["loss"]
        if self.extra is not None and self.is_main:  # only rank 0 records
            rec.update(self.extra())
        if self.watch is not None and self.is_main:
            low = self.watch.check(rec)
            if low:
                log.warning(low)
        slow = stragglers(busy, self.hosts, self.straggler_margin)
        if slow:
            rec["stragglers"] = slow
        self.last_loss = loss
        if self.first_loss is None:
            self.first_loss = loss
        self.interval = Interval()
        self.record(rec)
        return rec

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """`with metrics.paused():` around eval and checkpointing: step time and throughput measure
        training steps only."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.interval.paused += time.perf_counter() - t

    def eval(self, step: int, loss: float, samples: list | None = None, extra: dict | None = None) -> None:
        rec = eval_record(step, loss, extra, self.perplexity)
        if samples:
            rec["samples"] = samples
        self.record(rec)

    def recent(self) -> dict[str, Any]:
        """The latest value of each metric among the last few records (rank 0)."""
        return {k: v for rec in list(self.history)[-3:] for k, v in rec.items()}

    def record(self, rec: dict[str, Any]) -> None:
        if not self.is_main:
            return
        self.history.append(rec)
        for sink in self.sinks:
            sink.write(rec)

    def close(self, exit_code: int = 0) -> None:
        for sink in self.sinks:
            sink.close(exit_code)
        self.sinks = []


def gather_interval(iv: Interval, device: Any, world_size: int) -> list[list[float]]:
    """Every rank's interval sums (loss, data wait, forward time, peak memory), on every rank: one
    all-gather per log line, none per step."""
    import torch
    import torch.distributed as dist

    mine = torch.stack(
        [
            torch.as_tensor(iv.loss, dtype=torch.float64, device=device).reshape(()),
            torch.tensor(iv.data_wait, dtype=torch.float64, device=device),
            torch.tensor(iv.forward, dtype=torch.float64, device=device),
            torch.tensor(float(peak_memory(device)), dtype=torch.float64, device=device),
        ]
    )
    cols = mine.numel()
    if dist.is_initialized() and world_size > 1:  # one collective per log line, none per step
        everyone = torch.zeros(world_size, cols, dtype=torch.float64, device=device)
        dist.all_gather_into_tensor(everyone, mine.reshape(1, cols))
    else:
        everyone = mine.reshape(1, cols)
    return everyone.tolist()


def training_record(
    m: Metrics, step: int, engine: Any, elapsed: float, rows: list[list[float]]
) -> dict[str, Any]:
    """The record of a log line from the interval's sums of every rank (`rows`)."""
    iv = m.interval
    loss = sum(r[0] for r in rows) / m.loss_ranks / iv.steps
    wait_share = sum(r[1] for r in rows) / m.world_size / elapsed
    busy = [(r[1] + r[2]) / iv.steps for r in rows]  # per rank: data wait + forward, per step
    tokens_per_s = iv.tokens / elapsed
    step_time = elapsed / iv.steps
    per_step = round(iv.tokens / iv.steps)  # exact for token blocks; the mean for fine-tuning batches
    rec = {
        "step": step,
        "tokens": m.tokens,
        "loss": loss,
        "lr": m.lr,
        "grad_norm": engine.grad_norm,
        "tokens_per_s": tokens_per_s,
        "samples_per_s": m.samples_per_step * iv.steps / elapsed,
        "tokens_per_s_per_rank": tokens_per_s / m.world_size,
        "samples_per_s_per_rank": m.samples_per_step * iv.steps / elapsed / m.world_size,
        "step_time_s": step_time,
        "data_wait_share": min(1.0, max(0.0, wait_share)),
        "mfu": (
            tokens_per_s / m.world_size * m.flops_per_token / m.peak_flops
            if m.flops_per_token and m.peak_flops
            else None
        ),
        "peak_memory_bytes": int(max(r[3] for r in rows)),
        "memory_kind": "device" if getattr(m.device, "type", None) == "cuda" else "host_rss",
        "peak_load_bytes": m.load_peak,
        "skipped_steps": engine.skipped_steps,
        "elapsed_s": time.perf_counter() - m._t_start,
        "eta_s": (m.max_steps - step) * step_time,
        "rank_busy_s": busy,
        "rank_tokens_per_s": [per_step / m.world_size / max(b, 1e-9) for b in busy],
        "world_size": m.world_size,
        "tokens_per_step": per_step,
        **m.tags,
    }
    return rec


def load_peak(device: Any) -> int | None:
    """CUDA: the peak so far (loading -- a quantized base is made from 16-bit tensors on the device -- and
    set-up), its own figure (peak_load_bytes); the statistics are then reset, so that peak_memory_bytes is
    training's, which the plan counts. None on CPU (the peak RSS cannot be reset)."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    peak = int(torch.cuda.max_memory_allocated(device))
    torch.cuda.reset_peak_memory_stats(device)
    return peak


def gpu_watch(device: Any) -> UtilisationWatch | None:
    """A UtilisationWatch on a CUDA device whose utilisation can be read (NVML); else None."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    try:
        torch.cuda.utilization(device)
    except Exception:  # pynvml missing or no NVML: no reading
        return None
    return UtilisationWatch(lambda: torch.cuda.utilization(device))
