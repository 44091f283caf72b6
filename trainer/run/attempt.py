"""One attempt's life cycle, shared by every mode (trainer/run/modes.py): what is said and checked before
the first step (`start`), the loop to a step (`steps`), and the training around it (`training`): an
out-of-memory or a non-finite loss through a small handler each, the attempt's cost recorded, the metrics
closed, wandb started where configured, the debug report written."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from pathlib import Path
from typing import Any

from trainer.common.errors import EXIT_NONFINITE, EXIT_OOM
from trainer.run.banner import announce
from trainer.run.build import Run

log = logging.getLogger("trainer")
PROCESS_START = time.time()  # this attempt's clock: its devices are held from here (device-hours)


def start(run: Run, checks: bool) -> None:
    """Before the first step of any mode: say what runs; the preflight (every rank can all-reduce
    and holds the same weights) and, after the first step, the same again with the gradient norm."""
    from trainer.run import consistency

    announce(run)
    run.faults.perturb(run.engine.module)  # tests: a rank that starts out of step
    if run.exp.dist.preflight or checks:
        for line in consistency.preflight(run.engine, run.env.world_size, run.hosts):
            log.info(line)
        run.control.on_first_step = lambda: [
            log.info(x) for x in consistency.after_first_step(run.engine, run.env.world_size, run.hosts)
        ]


def steps(run: Run, until: int) -> Any:
    """The loop (trainer/run/loop.py) from the run's state to step `until`."""
    from trainer.run.loop import train as loop

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


def training(run: Run, body: Any, verdict: Any = None) -> int:
    """Run `body` (the loop); an OOM or a non-finite loss through its handler; close the metrics; say how it went."""
    import torch

    from trainer.checkpoint import CheckpointWriteError
    from trainer.cluster.control import NonFiniteLoss, ignore_sigterm_after_save

    exit_code = 1
    tokens0 = run.state.tokens
    try:
        body()
        exit_code = run.exp.checkpoint.signal_exit_code if run.state.stopped else 0
        if run.state.stopped:  # saved: a SIGTERM from the launcher as the ranks exit must not fail it
            ignore_sigterm_after_save()
    except CheckpointWriteError as e:  # every rank, at the same step: loud, and no traceback
        print(f"[rank {run.env.rank}] error: {e}", file=sys.stderr, flush=True)
        if (
            e.user
        ):  # its own write failed on a full disk, a quota, permissions: a restart would fail the same way
            from trainer.common.errors import EXIT_USER_ERROR
            from trainer.run.supervisor import record_failure

            exit_code = EXIT_USER_ERROR
            record_failure(exit_code, str(e), run.env.rank)
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
    from trainer.cluster import dist

    seconds = time.time() - PROCESS_START
    hours = run.env.world_size * seconds / 3600
    return {"event": "attempt", "attempt": dist.attempt(), "exit": exit_code, "ranks": run.env.world_size,
            "seconds": round(seconds, 1), "device_hours": hours, "tokens": tokens,
            "tokens_per_device_hour": tokens / hours if hours > 0 else None, "step": run.state.step}  # fmt: skip


def on_out_of_memory(run: Run, e: BaseException) -> int:
    """With strategy.on_oom: escalate, record the failed rung for the supervisor and end this
    attempt (exit 3); otherwise advise and re-raise."""
    from trainer.cluster import dist
    from trainer.run.supervisor import record_oom

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
    from trainer.run.supervisor import record_failure

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
    from trainer.run.consistency import write_debug_report

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


def probe_logits(directory: str, engine: Any, data: Any, rank: int) -> None:
    """Tests: the engine's logits on the first two training sequences (compared with an export); not under SP or stages."""
    import torch

    if (
        getattr(engine, "sp", 1) > 1 or getattr(engine, "pipe", None) is not None
    ):  # no rank holds the model whole
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
