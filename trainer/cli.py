"""`bin/train`: parse arguments, build everything, run the loop.

Construction happens here, in order, before the loop: config -> plan -> DeepSpeed JSON -> process
group -> data -> model -> engine -> checkpoints -> loop. User errors (bad config, bad paths, an
unjustified pinned stage...) print one message and exit 2, with no traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer import config as config_mod
from trainer.checks import CheckFailed
from trainer.errors import EXIT_CHECK_FAILED, EXIT_NONFINITE, EXIT_OOM, EXIT_USER_ERROR, UserError
from trainer.faults import Faults
from trainer.modes import MODES, SUBDIR
from trainer.supervisor import record_failure

log = logging.getLogger("trainer")

PROFILE_WARMUP, PROFILE_ACTIVE = 3, 5  # --profile: steps before the trace, steps traced

EPILOG = """\
examples:
  bin/train configs/experiments/tiny.yaml
  bin/train configs/experiments/tiny.yaml --set train.max_steps=50 --set strategy.zero_stage=2
  bin/train configs/experiments/tiny.yaml --print-config
  bin/train configs/experiments/tiny.yaml --overfit-batch --set train.max_steps=150
  bin/train configs/experiments/llama7b.yaml --plan --world-size 8 --set strategy.device_memory=80GB
  deepspeed --num_gpus 2 bin/train configs/experiments/tiny.yaml
  torchrun --nproc_per_node 2 bin/train configs/experiments/tiny.yaml
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bin/train",
        description="Train a model described by one YAML experiment on DeepSpeed.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("experiment", nargs="?", help="experiment YAML file (e.g. configs/experiments/tiny.yaml)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set train.max_steps=100 (repeatable; typed by the field)",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved experiment and DeepSpeed JSON, then exit",
    )
    p.add_argument(
        "--describe-config", action="store_true", help="print every config key with type, default and meaning"
    )
    p.add_argument(
        "--plan",
        action="store_true",
        help="print the memory plan per ZeRO candidate and the decision, then exit",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="ranks to plan for with --plan/--print-config (default: from the launcher, else 1)",
    )
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="ranks per node to plan for (default: min(world size, 8))",
    )
    p.add_argument(
        "--force", action="store_true", help="run a pinned stage/offload even if predicted not to fit"
    )
    modes = p.add_argument_group("modes (one at a time; see README: Modes)").add_mutually_exclusive_group()
    modes.add_argument(
        "--check",
        action="store_true",
        help="run the consistency checks, one training step and a checkpoint round trip, then exit",
    )
    modes.add_argument(
        "--overfit-batch",
        action="store_true",
        help="train train.max_steps steps on one fixed batch (the loss must approach zero), in RUN_DIR/overfit-batch",
    )
    modes.add_argument(
        "--profile",
        action="store_true",
        help=f"profile {PROFILE_ACTIVE} steps after {PROFILE_WARMUP} warm-up steps with torch.profiler, "
        "in RUN_DIR/profile",
    )
    modes.add_argument(
        "--dry-run",
        action="store_true",
        help="build everything (and load a checkpoint to resume), take no step",
    )
    p.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        metavar="PATH",
        help="resume from the latest complete checkpoint in the run directory, or from PATH "
        "(a step_XXXXXXXX directory, a checkpoints directory or a run directory)",
    )
    g = p.add_argument_group("supervised runs (bin/train starts the launcher and restarts it)")
    g.add_argument(
        "--launcher",
        choices=["deepspeed", "torchrun", "none"],
        default=None,
        help="start the job with this launcher and supervise it (restarts, OOM escalation)",
    )
    g.add_argument(
        "--hostfile", default=None, help="deepspeed hostfile for a multi-node --launcher deepspeed run"
    )
    g.add_argument(
        "--max-restarts",
        type=int,
        default=None,
        metavar="N",
        help="re-run a failed job up to N times, resuming from the latest checkpoint (exit 2 is not retried)",
    )
    # The deepspeed launcher injects --local_rank=N; torch.distributed.launch used --local-rank.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    from trainer.dist import under_torchrun

    if under_torchrun():  # torchrun's failure summary then shows this rank's exception, not just an exit code
        from torch.distributed.elastic.multiprocessing.errors import record

        return record(_main)(argv)
    return _main(argv)


def _main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.resume and args.resume.endswith((".yaml", ".yml")) and args.experiment is None:
        args.experiment, args.resume = args.resume, "latest"  # `bin/train --resume exp.yaml`
    try:
        if args.describe_config:
            print(describe_config())
            return 0
        if not args.experiment:
            raise UserError(
                "no experiment file given: bin/train EXPERIMENT.yaml (try configs/experiments/tiny.yaml)"
            )
        exp = config_mod.load(args.experiment, args.overrides)
        mode = next((m for m in MODES if getattr(args, m)), None)
        if mode in SUBDIR:
            if args.resume:
                raise UserError(f"--{mode.replace('_', '-')} starts from fresh weights; drop --resume")
            # Its own run dir, no checkpoints, no resume: a mode never disturbs the run it is aimed at.
            sub = Path(exp.run_dir) / SUBDIR[mode]
            exp = config_mod.load(
                args.experiment,
                [
                    *args.overrides,
                    f"run_dir={sub}",
                    "checkpoint.resume=never",
                    "checkpoint.every_steps=0",
                    "checkpoint.every_minutes=0",
                    "checkpoint.save_final=false",
                    "logging.wandb.enabled=false",
                ],
            )
            if _launcher_rank() == 0:  # replaced at every run (before any rank writes to it)
                shutil.rmtree(sub, ignore_errors=True)
        if args.plan or args.print_config:
            return plan_command(exp, args)
        if args.launcher is not None or args.max_restarts is not None:
            return supervise_command(exp, args)
        return train_command(exp, args)
    except CheckFailed as e:
        if _launcher_rank() == 0:
            print(f"check failed: {e}", file=sys.stderr)
        return EXIT_CHECK_FAILED
    except UserError as e:
        # Errors found before the process group exists are the same on every rank: say them once.
        rank = _launcher_rank()
        if e.everywhere is False or rank == 0:
            print(e.render(), file=sys.stderr)
        record_failure(EXIT_USER_ERROR, str(e), rank)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return 130


def _launcher_rank() -> int:
    from trainer.dist import detect

    return detect().rank


def describe_config() -> str:
    rows = config_mod.describe()
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{'key'.ljust(w[0])}  {'type'.ljust(w[1])}  {'default'.ljust(w[2])}  meaning"]
    for key, typ, default, desc in rows:
        if typ == "section":
            lines.append(f"\n{key}:  {desc}")
        else:
            lines.append(f"{key.ljust(w[0])}  {typ.ljust(w[1])}  {default.ljust(w[2])}  {desc}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- planning


@dataclass
class Planned:
    plan: Any
    ds_config: dict[str, Any]
    info: Any
    template_path: str
    schedule: Any = None  # strategy.Schedule: its notes say how a resume changed the LR schedule


def make_plan(
    exp: config_mod.Experiment,
    *,
    world_size: int,
    gpus_per_node: int,
    device_type: str,
    device_memory: int | None,
    vocab_size: int | None,
    eos_id: int | None,
    force: bool,
    this_machine: bool = True,
    source: str | None = None,
    saved_ds_config: dict[str, Any] | None = None,
) -> Planned:
    """Model facts (meta device) -> plan -> DeepSpeed JSON. No process group, no GPU needed.
    `saved_ds_config`: the JSON of the checkpoint a resume starts from (its LR schedule continues)."""
    from trainer import dist, model, strategy

    info = model.info(exp.model, vocab_size, eos_id, cache_dir=exp.data.cache_dir)
    precision = strategy.resolve_precision(exp.train.precision, device_type, source=source)
    mem = exp.strategy.device_memory or device_memory
    host = exp.strategy.host_memory or (dist.host_memory() if this_machine else None)
    if mem is None:  # CPU training: the ranks of a node share its memory
        mem = dist.host_memory() // max(1, gpus_per_node)
    template_path, template = strategy.template_for(exp)
    plan = strategy.plan(
        exp,
        info,
        world_size=world_size,
        gpus_per_node=gpus_per_node,
        device_type=device_type,
        device_memory=mem,
        host_memory=host,
        precision=precision,
        template=template or None,
        force=force,
    )
    if not template:
        template_path, template = strategy.template_for(exp, plan.candidate)
    sched = strategy.schedule(exp, world_size, saved_ds_config)
    ds = strategy.ds_config(exp, plan, info, template, template_path, sched)
    return Planned(plan=plan, ds_config=ds, info=info, template_path=template_path, schedule=sched)


def vocab_for_planning(exp: config_mod.Experiment) -> tuple[int | None, int | None]:
    """The vocabulary size the model will get: given in model.config, else the tokenizer's."""
    if exp.model.config is not None and isinstance(exp.model.config.get("vocab_size"), int):
        return exp.model.config["vocab_size"], None
    if exp.model.config is None:
        return None, None
    from trainer.data import tokenizer_shape

    return tokenizer_shape(exp.data.tokenizer, exp.data.cache_dir)


def plan_command(exp: config_mod.Experiment, args: argparse.Namespace) -> int:
    """--plan / --print-config: planning only; imports neither deepspeed nor CUDA."""
    from trainer import dist, strategy

    env = dist.detect()
    world = args.world_size or env.world_size
    per_node = args.nproc_per_node or (env.local_world_size if env.world_size > 1 else min(world, 8))
    gpu_mem = dist.device_memory()
    device_type = "cuda" if (gpu_mem is not None or exp.strategy.device_memory is not None) else "cpu"
    vocab, eos = vocab_for_planning(exp)
    planned = make_plan(
        exp,
        world_size=world,
        gpus_per_node=per_node,
        device_type=device_type,
        device_memory=gpu_mem,
        vocab_size=vocab,
        eos_id=eos,
        force=args.force,
        # device memory given for a machine without a GPU here: planning for another machine
        this_machine=not (exp.strategy.device_memory is not None and gpu_mem is None),
        source=args.experiment,
    )
    if args.print_config:
        print("# experiment (resolved)")
        print(exp.to_yaml())
        print(f"# DeepSpeed config (from {planned.template_path}, world size {world})")
        print(json.dumps(planned.ds_config, indent=2))
    if args.plan:
        info = planned.info
        print(
            f"model: {info.params:,} parameters (largest layer {info.largest_layer:,}), "
            f"micro batch {exp.train.micro_batch_size} x seq {exp.data.seq_len}, activation checkpointing "
            f"{'on' if exp.model.activation_checkpointing else 'off'}"
            + (", chunked loss" if exp.model.chunked_loss else "")
        )
        print(strategy.describe_plan(planned.plan))
    return 0


# ----------------------------------------------------------------------------- supervision


def supervise_command(exp: config_mod.Experiment, args: argparse.Namespace) -> int:
    from trainer.dist import detect
    from trainer.supervisor import Supervisor

    if detect().launcher != "none":
        raise UserError(
            "--launcher/--max-restarts start and supervise a launcher; they cannot run under one. Run "
            f"`bin/train {args.experiment} --launcher deepspeed --max-restarts N` instead of wrapping it in a launcher"
        )
    if args.max_restarts is not None and args.max_restarts < 0:
        raise UserError("--max-restarts must be 0 or more")
    launcher = args.launcher or "none"
    sup = Supervisor(
        experiment=args.experiment,
        overrides=list(args.overrides),
        run_dir=Path(exp.run_dir),
        launcher=launcher,
        nproc_per_node=args.nproc_per_node or 1,
        hostfile=args.hostfile,
        max_restarts=args.max_restarts or 0,
        resume=args.resume,
        extra_args=(["--force"] if args.force else [])
        + [f"--{m.replace('_', '-')}" for m in MODES if getattr(args, m)],
    )
    return sup.run()


# ----------------------------------------------------------------------------- training


def train_command(exp: config_mod.Experiment, args: argparse.Namespace) -> int:
    from trainer import dist
    from trainer.data import resolve_files

    # Cheap checks before any process group: data files exist.
    for key, src in (("data.train", exp.data.train), ("data.eval", exp.data.eval)):
        if src is not None and src.files is not None:
            resolve_files(src, key)

    from trainer import checkpoint

    found, warnings = checkpoint.resolve_resume(args.resume, exp.checkpoint.resume, exp.run_dir)
    if found is not None and Faults(dist.detect().rank, dist.attempt()).stale_resume():
        found = checkpoint.before(found)  # tests: this rank sees an older run_dir
    resume = None
    if found is not None:
        diffs = checkpoint.check_compatible(found, exp)
        resume = checkpoint.Resume(found, warnings, diffs)
        if (
            resume.done(exp, dist.detect().rank) and dist.detect().world_size == 1
        ):  # several ranks: once they agree on it
            return 0

    env = dist.detect()
    device_type = "cuda" if dist.gpu_present() else "cpu"
    vocab, eos = vocab_for_planning(exp)
    planned = make_plan(
        exp,
        world_size=env.world_size,
        gpus_per_node=env.local_world_size,
        device_type=device_type,
        device_memory=dist.device_memory(),
        vocab_size=vocab,
        eos_id=eos,
        force=args.force,
        source=args.experiment,
        saved_ds_config=resume.ds_config if resume is not None else None,
    )
    runtime = dist.setup(exp.dist.timeout_s)
    try:
        return _train(exp, args, runtime, planned, resume)
    except UserError as e:
        if e.everywhere is None:
            e.everywhere = False  # found by this rank while running: it must say it itself
        raise
    finally:
        import torch.distributed as tdist

        if tdist.is_initialized():
            tdist.destroy_process_group()


def _train(
    exp: config_mod.Experiment,
    args: argparse.Namespace,
    runtime: Any,
    planned: Planned,
    resume: Any,  # checkpoint.Resume | None
) -> int:
    import torch

    from trainer import checks, dist, metrics, model, modes, rundir
    from trainer import data as data_mod
    from trainer.checkpoint import Checkpointer, Store, checkpoints_dir
    from trainer.checkpoint.reshard import names_and_aliases
    from trainer.control import Control, NonFiniteLoss
    from trainer.engine import Engine
    from trainer.loop import Evaluator, TrainState, train

    env = runtime.env
    metrics.setup_logging(runtime.is_main, env.rank, exp.logging.level)
    for warning in config_mod.warnings(exp) if runtime.is_main else ():
        log.warning(f"warning: {warning}")
    run_dir = Path(exp.run_dir)
    lock = rundir.acquire(run_dir) if runtime.is_main else None  # before anything touches run_dir

    data = data_mod.build(exp.data, exp.seed, is_main=env.local_rank == 0)
    if data.built:
        log.info(f"data: tokenized and cached in {data.cache_path}")
    # One gather before anything is built: the run dir is ours, and every rank resumes from the
    # same checkpoint and reads the same data.
    hosts = checks.agree_at_start(
        env.world_size,
        run_dir=exp.run_dir,
        host=env.hostname,
        lock=lock,
        resume=resume.identity if resume is not None else None,
        data_digest=data.fingerprint["train_digest"],
    )
    if lock is not None and runtime.is_main:
        log.warning(lock)  # the filesystem has no locks
    if resume is not None and resume.done(exp, env.rank):
        return 0
    data_notes = resume.check_data(data.fingerprint, exp.checkpoint.on_data_change) if resume else []

    dist.seed_all(exp.seed)  # identical initial weights on every rank
    module = model.build(
        exp.model,
        vocab_size=data.vocab_size,
        eos_id=data.eos_id,
        seq_len=exp.data.seq_len,
        ds_config=planned.ds_config,
    )
    groups = model.param_groups(module, exp.optim.weight_decay)
    layout = names_and_aliases(module, groups)  # before DeepSpeed wraps the parameters
    engine = Engine(module, planned.ds_config, groups, compile=exp.train.compile)
    dist.seed_all(exp.seed + 1 + env.rank)  # dropout differs per rank

    t = exp.train
    stream = data_mod.TrainStream(
        data,
        exp.data,
        rank=env.rank,
        world=env.world_size,
        micro=t.micro_batch_size,
        seed=exp.seed,
        device_type=runtime.device_type,
    )
    eval_loader = data_mod.eval_batches(
        data,
        exp.data,
        rank=env.rank,
        world=env.world_size,
        micro=t.micro_batch_size,
        limit=t.eval_batches,
        device_type=runtime.device_type,
    )
    one_off = args.overfit_batch or args.profile  # no eval, no checkpoints (see trainer/modes.py)
    evaluator = Evaluator(None if one_off else eval_loader, t.eval_every, env.world_size)
    state = TrainState()
    samples_per_step = t.micro_batch_size * env.world_size * t.grad_accum
    info = planned.info
    mets = metrics.Metrics(
        run_dir,
        is_main=runtime.is_main,
        world_size=env.world_size,
        log_every=t.log_every,
        max_steps=state.step + PROFILE_WARMUP + PROFILE_ACTIVE if args.profile else t.max_steps,
        samples_per_step=samples_per_step,
        tokens_per_step=samples_per_step * exp.data.seq_len,
        device=engine.device,
        hosts=hosts,
        straggler_margin=exp.dist.straggler_margin,
        progress=progress_enabled(exp.logging.progress),
        flops_per_token=metrics.flops_per_token(info.params, info.layers, info.hidden, exp.data.seq_len),
        peak_flops=metrics.peak_flops(engine.device, exp.logging.peak_tflops),
    )
    faults = Faults(env.rank, dist.attempt())
    control = Control(
        rank=env.rank,
        world_size=env.world_size,
        attempt=dist.attempt(),
        faults=faults,
        handle_signals=exp.checkpoint.save_on_signal,
        watchdog_s=exp.dist.watchdog_s,
        nan_check=exp.dist.nan_check and planned.plan.precision != "fp16",  # fp16: DeepSpeed skips the step
    )
    store = Store(
        checkpoints_dir(run_dir),
        engine=engine,
        stream=stream,
        exp=exp,
        rank=env.rank,
        world_size=env.world_size,
        plan=planned.plan.summary(),
        layout=layout,
        faults=faults,
        data_fingerprint=data.fingerprint,
        recent=lambda: {"metrics": mets.recent(), "wandb_run_id": mets.wandb_id},
    )
    checkpointer = Checkpointer(exp.checkpoint, store)
    debug = dist.debug_dir()
    if resume is not None:
        checkpointer.load(resume.found, state)
        if debug:  # what the resumed engine holds, against what the saving one held (tests)
            checks.save_optimizer_state(
                debug, f"optimizer_resumed_step{state.step}", engine, layout[0], env.rank
            )
    if args.overfit_batch:
        stream = modes.FixedBatch(stream)
    memory = None
    if debug:
        from trainer.checks import MemoryCensus

        stream.record = []
        memory = engine.on_backward = MemoryCensus()
        store.on_save = lambda step: checks.save_optimizer_state(
            debug, f"optimizer_saved_step{step}", engine, layout[0], env.rank
        )
    banner(exp, runtime, planned, data, stream, samples_per_step, resume)
    if resume is not None and runtime.is_main:
        for w in resume.warnings:
            log.warning(f"warning: {w}")
        log.info(
            f"resumed from {resume.found.path} at step {state.step} (epoch {stream.position.epoch}, "
            f"sample {stream.position.sample} of the epoch)"
        )
        if resume.differences:
            log.info(f"resumed with changed settings: {', '.join(resume.differences)}")
        for note in (*planned.schedule.notes, *data_notes):
            (log.warning if note.startswith("warning:") else log.info)(note)
    faults.perturb(engine.module)  # tests
    if exp.dist.preflight or args.check:
        for line in checks.preflight(engine, env.world_size, hosts):
            log.info(line)
        control.on_first_step = lambda: [
            log.info(x) for x in checks.after_first_step(engine, env.world_size, hosts)
        ]
    if args.check:
        return modes.check(exp, engine, stream, data, state, env, hosts, layout)
    if args.dry_run:
        log.info(
            f"dry run: everything is built{' and the checkpoint loaded' if resume else ''}; no step taken"
        )
        return 0
    if runtime.is_main and wandb_enabled(exp.logging.wandb):
        from trainer.metrics.wandb_run import WandbRun

        mets.add_sink(
            WandbRun(
                exp.logging.wandb,
                name=exp.name,
                run_dir=run_dir,
                config={
                    "experiment": exp.to_dict(),
                    "deepspeed": planned.ds_config,
                    "plan": planned.plan.summary(),
                    "world_size": env.world_size,
                    "nodes": env.nodes,
                    "parameters": info.params,
                },
                run_id=resume.found.state.get("wandb_run_id") if resume is not None else None,
            )
        )

    def run(until: int) -> TrainState:
        return train(
            max_steps=until,
            grad_accum=t.grad_accum,
            tokens_per_sample=exp.data.seq_len,
            engine=engine,
            stream=stream,
            evaluator=evaluator,
            checkpointer=checkpointer,
            metrics=mets,
            state=state,
            control=control,
        )

    exit_code = 1
    try:
        if args.profile:
            modes.profile(
                run,
                state,
                run_dir=run_dir,
                rank=env.rank,
                device=engine.device,
                warmup=PROFILE_WARMUP,
                active=PROFILE_ACTIVE,
            )
        else:
            state = run(t.max_steps)
        exit_code = exp.checkpoint.signal_exit_code if state.stopped else 0
    except torch.OutOfMemoryError as e:
        c = planned.plan.candidate
        where = f"{c.name} at step {state.step + 1} on rank {env.rank}"
        if exp.strategy.on_oom != "escalate":
            log.error(
                f"out of memory on {where}. Lower train.micro_batch_size or data.seq_len, set "
                "model.activation_checkpointing: true, or let the supervisor climb the ladder: "
                "strategy.on_oom: escalate with --max-restarts N"
            )
            raise
        from trainer.supervisor import record_oom

        record_oom(
            run_dir,
            stage=c.stage,
            offload=c.offload,
            step=state.step + 1,
            rank=env.rank,
            attempt=dist.attempt(),
            error=str(e),
        )
        print(
            f"[rank {env.rank}] out of memory on {where}; recorded for escalation, ending this attempt",
            file=sys.stderr,
            flush=True,
        )
        exit_code = EXIT_OOM
        return exit_code
    except NonFiniteLoss as e:
        if runtime.is_main:
            log.error(f"stopped: {e}")
        state.failed = str(e)
        exit_code = EXIT_NONFINITE  # every rank stopped at the same step
        record_failure(exit_code, str(e), env.rank)
    finally:
        mets.close(exit_code)
    if debug:
        from trainer.checks import write_debug_report

        extra = {
            "step": state.step,
            "ds_config": engine.ds._config._param_dict,
            "memory": memory.result if memory else {},
            "plan": planned.plan.summary(),
        }
        write_debug_report(debug, env.rank, env.world_size, engine.module, stream.record or [], extra)
        modes.probe_logits(debug, engine, data, env.rank)
    if runtime.is_main and mets.first_loss is not None and not state.failed:
        first, last = mets.first_loss, mets.last_loss
        log.info(
            f"done: {state.step} steps, {state.tokens:,} tokens in {state.wall_time:.1f} s; loss {first:.4f} -> {last:.4f}"
        )
        if args.overfit_batch:
            log.info(modes.overfit_verdict(first, last, samples_per_step))
    return exit_code


def progress_enabled(setting: Any) -> bool:
    """logging.progress: true, false, or auto = a bar only when stdout is a terminal (plain log lines
    in CI and log files)."""
    return sys.stdout.isatty() if setting == "auto" else bool(setting)


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


def banner(
    exp: config_mod.Experiment,
    runtime: Any,
    planned: Planned,
    data: Any,
    stream: Any,
    samples_per_step: int,
    resume: Any = None,  # checkpoint.Resume | None
) -> None:
    """What this run is, on rank 0: where it runs, what it trains, how, and from where."""
    if not runtime.is_main:
        return
    from trainer.checkpoint import checkpoints_dir
    from trainer.config import format_size

    env, t, plan = runtime.env, exp.train, planned.plan
    est = plan.estimate
    c = exp.checkpoint
    cadence = ", ".join(
        x
        for x in (
            f"every {c.every_steps} steps" if c.every_steps else "",
            f"every {c.every_minutes:g} min" if c.every_minutes else "",
            "at the end" if c.save_final else "",
        )
        if x
    )
    start = f"resuming from {resume.found.tag}" if resume is not None else "fresh start"
    lines = [
        f"experiment {exp.name}: run dir {exp.run_dir}",
        f"world: {env.world_size} rank(s) on {env.nodes} node(s) via {env.launcher}; device {runtime.device_type}, "
        f"backend {runtime.backend}, {runtime.threads} CPU thread(s) per rank",
        f"model: {planned.info.params:,} parameters; precision {plan.precision}"
        + ("; chunked loss" if exp.model.chunked_loss else "")
        + ("; torch.compile" if t.compile else ""),
        f"strategy: ZeRO stage {plan.candidate.stage}, offload {plan.candidate.offload} -- {plan.reason}",
        f"memory per rank (estimate): {format_size(est.total)} (params {format_size(est.params)}, grads "
        f"{format_size(est.grads)}, optimizer {format_size(est.optimizer)}, activations {format_size(est.activations)})",
        f"batch: micro {t.micro_batch_size} x world {env.world_size} x grad_accum {t.grad_accum} = {samples_per_step} "
        f"sequences = {samples_per_step * exp.data.seq_len:,} tokens per step",
        f"data: {len(data.train):,} train / {len(data.eval) if data.eval is not None else 0:,} eval sequences of "
        f"{data.seq_len} tokens; {stream.steps_per_epoch:,} micro steps per epoch",
        f"checkpoints: {checkpoints_dir(exp.run_dir)} ({cadence or 'none'}; keep {c.keep_last or 'all'}); {start}",
    ]
    for line in lines:
        log.info(line)
