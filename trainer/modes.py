"""What bin/train does with a built Run (trainer/build.py): train, or one of the one-off modes.

- train (the default): the loop to train.max_steps, with evaluation, checkpoints, wandb; an
  out-of-memory or a non-finite loss ends it through a small handler each;
- `--check`: the consistency checks, one step and a checkpoint round trip (multi-node bring-up);
- `--overfit-batch`: train on one fixed batch, a quick proof that the pipeline learns (loss -> 0);
- `--profile`: a torch.profiler trace of a few steps after warm-up, and the top operators;
- `--dry-run`: build everything (process group, data, model, engine, a checkpoint to resume), no step.

`--overfit-batch` and `--profile` write into `<run_dir>/overfit-batch` and `<run_dir>/profile`,
start from fresh weights, evaluate nothing and save no checkpoint, so they never disturb a run.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from trainer.banner import announce
from trainer.build import Run
from trainer.errors import EXIT_NONFINITE, EXIT_OOM

log = logging.getLogger("trainer")
PROCESS_START = time.time()  # this attempt's clock: its devices are held from here (device-hours)

MODES = ("check", "overfit_batch", "profile", "dry_run")  # the one-off modes, as argparse names them
PROFILE_WARMUP, PROFILE_ACTIVE = 3, 5  # --profile: steps before the trace, steps traced
SUBDIR = {"overfit_batch": "overfit-batch", "profile": "profile"}  # modes that get their own run dir


class FixedBatch:
    """--overfit-batch: this rank's first micro batch, at every micro step."""

    def __init__(self, stream: Any) -> None:
        self.sampler = stream.sampler
        self.steps_per_epoch = stream.steps_per_epoch
        self.record = stream.record
        # the fixed batches' target tokens over every rank (as training's loss_denominator counts them)
        targets = getattr(stream, "targets", None)
        self.targets = None if targets is None else int(targets[next(stream._ahead(1))].sum())
        self.batch = stream.next()
        self.position = stream.position
        self._stream = stream

    def __getattr__(self, name: str) -> Any:  # the rest as the stream has it (the banner's padding())
        if "_stream" not in self.__dict__ or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.__dict__["_stream"], name)

    def loss_denominator(self, micro_steps: int) -> float | None:
        """As training's (stream.loss_denominator): the step's target tokens over every rank, divided by
        ranks x micro steps; every micro step is the same batch. So the loss is the mean over the
        targets (under sequence parallelism too: not over positions), a rank whose batch has no target
        adds 0 (not NaN). None for token blocks (every micro batch as many targets)."""
        if self.targets is None:
            return None
        return max(self.targets * micro_steps, 1) / (self.sampler.world * micro_steps)

    def step_tokens(self, micro_steps: int) -> int | None:
        """Fine-tuning rows: this rank's batch as fed, counted for every rank (the ranks' batches differ
        in width; --overfit-batch does not gather them)."""
        if self.batch.dim() != 3:
            return None
        return int(self.batch.shape[0] * self.batch.shape[-1]) * self.sampler.world * micro_steps

    def next(self) -> Any:
        if self.record is not None:
            from trainer.data.stream import row_digest

            self.record += [row_digest(row) for row in self.batch]
        return self.batch


def overfit_verdict(first: float | None, last: float | None, sequences: int) -> str:
    if first is None or last is None:
        return "overfit-batch: no loss was logged"
    ok = last < 0.1 * first
    return f"overfit-batch: loss {first:.4f} -> {last:.4f} on one fixed batch of {sequences} sequences" + (
        ": the pipeline learns"
        if ok
        else "; it should approach zero: check optim.lr, the labels and the data before a long run"
    )


# What a kernel or operator does, from its name: the first pattern that matches (lower case).
KINDS = (
    ("communication", ("nccl", "gloo", "all_reduce", "allreduce", "all_gather", "reduce_scatter", "c10d")),
    ("optimizer", ("adam", "multi_tensor_apply", "optimizer", "_foreach")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "scaled_dot_product")),
    ("matmul", ("gemm", "xmma", "cutlass", "cublas", "nvjet", "triton_tem", "aten::mm", "aten::addmm", "aten::bmm")),
    ("copies", ("memcpy", "memset", "aten::copy_", "aten::cat", "aten::_to_copy", "aten::contiguous")),
)  # fmt: skip
OTHER = "elementwise and reductions"
# Device-side ranges over kernels, not kernels: torch.compile's "## Call CompiledFxGraph ..." (counted
# as well, they made a compiled step's kernels look 122% busy and 65% elementwise on an H100).
RANGES = ("## ", "ProfilerStep#")


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, pats in KINDS if any(p in low for p in pats)), OTHER)


def time_by_kind(averages: Any, cuda: bool, wall: float) -> str:
    """One line: the share of device kernel time (CPU: operator self time) per kind of work, and on
    a GPU how busy its kernels kept it during the traced steps (`wall` seconds)."""
    from torch.autograd import DeviceType

    spent: dict[str, float] = {}
    for e in averages:
        if cuda:
            if e.device_type != DeviceType.CUDA or e.key.startswith(RANGES):
                continue  # kernels only: an operator's or a range's device time is its kernels' again
            us = e.self_device_time_total or e.device_time_total
        else:
            us = e.self_cpu_time_total
        kind = kind_of(e.key)
        spent[kind] = spent.get(kind, 0.0) + us
    total = sum(spent.values())
    if total <= 0:
        return "profile: no timed work recorded"
    shares = ", ".join(
        f"{k} {v / total:.0%}" for k, v in sorted(spent.items(), key=lambda kv: -kv[1]) if v / total >= 0.005
    )
    if cuda:
        busy = total / 1e6 / max(wall, 1e-9)
        return (
            f"profile: GPU kernels {total / 1e6:.3f} s in {wall:.3f} s of traced steps (busy {busy:.0%}"
            + ("; the GPU waits for the host: launch overhead, syncs, data" if busy < 0.9 else "")
            + f"); by kind: {shares}"
        )
    return f"profile: CPU operator time by kind: {shares}"


def probe_logits(directory: str, engine: Any, data: Any, rank: int) -> None:
    """Tests: the engine's logits on the first two training sequences (compared with an export); not under SP."""
    import torch

    if getattr(engine, "sp", 1) > 1:
        return
    rows = data.train[:2]
    rows = rows.reshape(-1, *rows.shape[2:]) if rows.ndim == 4 else rows  # preference pairs: their rows
    ids = (rows[:, 0] if rows.ndim == 3 else rows).astype("int64").clip(min=0)  # (prompts: their pad is -100)
    ids = torch.from_numpy(ids)
    engine.train(False)
    with torch.no_grad():
        logits = engine.ds(input_ids=ids.to(engine.device)).logits.float().cpu()
    engine.train(True)
    if rank == 0:
        torch.save({"input_ids": ids, "logits": logits}, Path(directory) / "probe.pt")


# ----------------------------------------------------------------------------- every mode


def start(run: Run, checks: bool) -> None:
    """Before the first step of any mode: say what runs; the preflight (every rank can all-reduce
    and holds the same weights) and, after the first step, the same again with the gradient norm."""
    from trainer import consistency

    announce(run)
    run.faults.perturb(run.engine.module)  # tests: a rank that starts out of step
    if run.exp.dist.preflight or checks:
        for line in consistency.preflight(run.engine, run.env.world_size, run.hosts):
            log.info(line)
        run.control.on_first_step = lambda: [
            log.info(x) for x in consistency.after_first_step(run.engine, run.env.world_size, run.hosts)
        ]


def steps(run: Run, until: int) -> Any:
    """The loop (trainer/loop.py) from the run's state to step `until`."""
    from trainer.loop import train as loop

    t = run.exp.train
    return loop(
        max_steps=until,
        grad_accum=t.grad_accum,
        samples_per_step=run.samples_per_step,
        tokens_per_sample=run.exp.data.seq_len,
        engine=run.engine,
        stream=run.stream,
        evaluator=run.evaluator,
        checkpointer=run.checkpointer,
        metrics=run.metrics,
        state=run.state,
        control=run.control,
    )


# ----------------------------------------------------------------------------- train


def train(run: Run) -> int:
    """The default mode: train to train.max_steps (or a stop request), then report."""
    start(run, checks=False)
    start_wandb(run)
    return _training(run, lambda: steps(run, run.exp.train.max_steps))


def _training(run: Run, body: Any, verdict: Any = None) -> int:
    """Run `body` (the loop); an OOM or a non-finite loss through its handler; close the metrics; say how it went."""
    import torch

    from trainer.checkpoint import CheckpointWriteError
    from trainer.control import NonFiniteLoss, ignore_sigterm_after_save

    exit_code = 1
    tokens0 = run.state.tokens
    try:
        body()
        exit_code = run.exp.checkpoint.signal_exit_code if run.state.stopped else 0
        if run.state.stopped:  # saved: a SIGTERM from the launcher as the ranks exit must not fail it
            ignore_sigterm_after_save()
    except CheckpointWriteError as e:  # every rank, at the same step: loud, and no traceback
        print(f"[rank {run.env.rank}] error: {e}", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):  # every rank has said it before the launcher ends them
            run.checkpointer.store.barrier()
        return exit_code
    except Exception as e:  # the failure recorded first; a background save every rank wrote is then committed
        try:
            if isinstance(e, torch.OutOfMemoryError):
                return (exit_code := on_out_of_memory(run, e))
            if not isinstance(e, NonFiniteLoss):
                raise
            exit_code = on_nonfinite(run, e)
        finally:
            run.checkpointer.salvage()
    finally:
        run.metrics.record(attempt_cost(run, run.state.tokens - tokens0, exit_code))
        run.metrics.close(exit_code)
    debug_report(run)
    mets, state = run.metrics, run.state
    if run.runtime.is_main and mets.first_loss is not None and not state.failed:
        first, last = mets.first_loss, mets.last_loss
        log.info(
            f"done: {state.step} steps, {state.tokens:,} tokens in {state.wall_time:.1f} s; loss {first:.4f} -> {last:.4f}"
        )
        if verdict is not None:
            log.info(verdict(first, last))
    return exit_code


def attempt_cost(run: Run, tokens: int, exit_code: int) -> dict[str, Any]:
    """This attempt's record of what it cost: ranks x its wall time since the process started
    (start-up, data, planning and saves included: the devices were held), and tokens per device-hour."""
    from trainer import dist

    seconds = time.time() - PROCESS_START
    hours = run.env.world_size * seconds / 3600
    return {"event": "attempt", "attempt": dist.attempt(), "exit": exit_code, "ranks": run.env.world_size,
            "seconds": round(seconds, 1), "device_hours": hours, "tokens": tokens,
            "tokens_per_device_hour": tokens / hours if hours > 0 else None, "step": run.state.step}  # fmt: skip


def on_out_of_memory(run: Run, e: BaseException) -> int:
    """With strategy.on_oom: escalate, record the failed rung for the supervisor and end this
    attempt (exit 3); otherwise advise and re-raise."""
    from trainer import dist
    from trainer.supervisor import record_oom

    c = run.planned.plan.candidate
    env, step = run.env, run.state.step + 1
    where = f"{c.name} at step {step} on rank {env.rank}"
    if run.exp.strategy.on_oom != "escalate":
        log.error(
            f"out of memory on {where}. Lower train.micro_batch_size or data.seq_len, set "
            "model.activation_checkpointing: true, or let the supervisor climb the ladder: "
            "strategy.on_oom: escalate with --max-restarts N"
        )
        raise e
    plan = run.planned.plan
    after = plan.next_after()
    rung = None
    if after is not None:
        levers, nxt = after
        # an offload rung is pinned; a rung without keeps the experiment's offload (auto may climb later)
        rung = [*nxt.overrides(), *levers.overrides()]
    record_oom(run.exp.run_dir, stage=c.stage, offload=c.offload, step=step, rank=env.rank,
               attempt=dist.attempt(), error=str(e), levers=plan.levers.describe(), next_overrides=rung,
               next_name=None if after is None else f"{after[1].name} with activation levers: {after[0].describe()}")  # fmt: skip
    print(f"[rank {env.rank}] out of memory on {where}; recorded for escalation, ending this attempt",
          file=sys.stderr, flush=True)  # fmt: skip
    return EXIT_OOM


def on_nonfinite(run: Run, e: BaseException) -> int:
    """Every rank stopped at the same step, before the update: say so, and tell a supervisor that a
    restart would reach it again (exit 4)."""
    from trainer.supervisor import record_failure

    if run.runtime.is_main:
        log.error(f"stopped: {e}")
    run.state.failed = str(e)
    record_failure(EXIT_NONFINITE, str(e), run.env.rank)
    return EXIT_NONFINITE


def start_wandb(run: Run) -> None:
    """logging.wandb on rank 0: the run (continued from the checkpoint's id on a resume) becomes a
    metrics sink."""
    if not (run.runtime.is_main and wandb_enabled(run.exp.logging.wandb)):
        return
    from trainer.metrics.wandb_run import WandbRun

    exp, planned, env = run.exp, run.planned, run.env
    run.metrics.add_sink(
        WandbRun(
            exp.logging.wandb,
            name=exp.name,
            run_dir=exp.run_dir,
            config={
                "experiment": exp.to_dict(),
                "deepspeed": planned.ds_config,
                "plan": planned.plan.summary(),
                "world_size": env.world_size,
                "nodes": env.nodes,
                "parameters": planned.info.params,
            },
            run_id=run.resume.found.state.get("wandb_run_id") if run.resume is not None else None,
        )
    )


def wandb_enabled(section: Any) -> bool:
    """logging.wandb.enabled: true, false, or auto = on when wandb is installed and configured (an API
    key in WANDB_API_KEY or ~/.netrc, or WANDB_MODE set)."""
    if section.enabled != "auto":
        return bool(section.enabled)
    import importlib.util
    import os

    if importlib.util.find_spec("wandb") is None:
        return False
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "api.wandb.ai" in netrc.read_text()
    except OSError:
        return False


def debug_report(run: Run) -> None:
    """Tests (TRAINER_DEBUG_DIR): each rank's parameter digest, consumed samples and memory census,
    and rank 0's logits on two training sequences (compared with an export)."""
    if run.debug is None:
        return
    from trainer.consistency import write_debug_report

    extra = {
        "step": run.state.step,
        "ds_config": run.engine.ds._config._param_dict,
        "memory": run.debug.memory.result if run.debug.memory else {},
        "plan": run.planned.plan.summary(),
    }
    env = run.env
    write_debug_report(
        run.debug.directory, env.rank, env.world_size, run.engine.module, run.stream.record or [], extra
    )
    probe_logits(run.debug.directory, run.engine, run.data, env.rank)


# ----------------------------------------------------------------------------- the one-off modes


def overfit_batch(run: Run) -> int:
    """--overfit-batch: train.max_steps steps on this rank's first micro batch."""
    run.stream = FixedBatch(run.stream)
    start(run, checks=False)
    return _training(
        run,
        lambda: steps(run, run.exp.train.max_steps),
        verdict=lambda first, last: overfit_verdict(first, last, run.samples_per_step),
    )


def profile(run: Run) -> int:
    """--profile: PROFILE_WARMUP steps, then PROFILE_ACTIVE steps under torch.profiler; every rank
    writes its Chrome trace (`trace_rank00000.json`, open in chrome://tracing or Perfetto); rank 0
    prints the top operators by self time, and the time by kind of work (`time_by_kind`): on a
    GPU, kernel time against the wall time of the traced steps, so that a device waiting for the
    host shows."""
    start(run, checks=False)
    return _training(run, lambda: _profiled(run))


def _profiled(run: Run) -> Path:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    state, device, rank = run.state, run.engine.device, run.env.rank
    steps(run, state.step + PROFILE_WARMUP)
    cuda = getattr(device, "type", None) == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=activities, record_shapes=True) as prof:
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        steps(run, state.step + PROFILE_ACTIVE)
        if cuda:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
    path = Path(run.exp.run_dir) / f"trace_rank{rank:05d}.json"
    prof.export_chrome_trace(str(path))
    if rank == 0:
        sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        averages = prof.key_averages()  # grouping every event of the trace: once
        log.info(
            f"profile: steps {state.step - PROFILE_ACTIVE + 1}-{state.step}; top operators by self time:"
        )
        log.info(averages.table(sort_by=sort, row_limit=15))
        try:  # a summary of the table above: never worth losing the trace over
            log.info(time_by_kind(averages, cuda, wall))
        except Exception as e:  # noqa: BLE001 (profiler event fields differ between torch versions)
            log.warning(f"profile: no time by kind ({type(e).__name__}: {e})")
        log.info(
            f"profile: trace written to {path} (one per rank; open in chrome://tracing or ui.perfetto.dev)"
        )
    return path


def dry_run(run: Run) -> int:
    start(run, checks=False)
    log.info(
        f"dry run: everything is built{' and the checkpoint loaded' if run.resume else ''}; no step taken"
    )
    return 0


def check_run(run: Run) -> int:
    """--check: the preflight; one training step and the post-step checks; a checkpoint round trip
    (save, take another step, load: the loss on a fixed batch must come back exactly)."""
    import torch

    from trainer import consistency
    from trainer.checkpoint import Found, Store, read_state, restore

    start(run, checks=True)
    engine, stream, state, env = run.engine, run.stream, run.state, run.env

    def one_step() -> None:  # every micro batch of an optimizer step (DeepSpeed updates at the last)
        per_micro = stream.loss_denominator(run.exp.train.grad_accum)  # as training normalises it
        for _ in range(run.exp.train.grad_accum):
            engine.backward_step(engine.forward(stream.next(), per_micro))

    lr = engine.lr  # the first step's (a warmup from 0: the adapter's B matrices stay zero)
    one_step()
    state.step, state.moved = 1, lr > 0 and engine.applied
    for line in consistency.after_first_step(engine, env.world_size, run.hosts):
        log.info(line)
    probe = torch.from_numpy(run.data.train[: stream.sampler.micro].astype("int64"))

    def probe_loss() -> float:  # the mean over the batch's targets (eval_loss sums them)
        engine.train(False)
        loss = float(engine.eval_loss(probe)) / max(1.0, float(engine.eval_weight(probe)))
        engine.train(True)
        return loss

    scratch = Path(run.exp.run_dir) / ".check"
    store = Store(
        scratch / "checkpoints", engine=engine, stream=stream, exp=run.exp, rank=env.rank,
        world_size=env.world_size, layout=run.layout, faults=run.faults,
    )  # fmt: skip
    saved = store.save(state)
    before = probe_loss()
    one_step()  # move the weights away
    moved = probe_loss()
    restore.load(store, Found(saved, read_state(saved)), state)
    after = probe_loss()
    store.barrier()
    if env.rank == 0:
        shutil.rmtree(scratch, ignore_errors=True)
    if after != before:
        raise consistency.CheckFailed(
            f"checkpoint round trip changed the loss on a fixed batch: {before!r} before saving, {after!r} after "
            f"loading (and {moved!r} in between)"
        )
    moved_note = "" if moved != before else " (unchanged: the learning rate is 0 at this step)"
    log.info(
        f"check: checkpoint round trip ok: loss on a fixed batch {before!r} at save, {moved!r} after another "
        f"step{moved_note}, {after!r} after loading"
    )
    log.info("check passed")
    return 0


RUN = {
    "train": train,
    "check": check_run,
    "overfit_batch": overfit_batch,
    "profile": profile,
    "dry_run": dry_run,
}
