"""`bin/train`: parse the arguments and dispatch.

- `--plan` / `--print-config`: plan only (no process group, no torch);
- `--launcher` / `--max-restarts`: start the launcher and supervise it (trainer/supervisor.py);
- otherwise (under any launcher, or none): resolve the checkpoint to resume, plan, set up the
  process group, build the Run (trainer/build.py) and run the mode (trainer/modes.py).
User errors (bad config, bad paths, an unjustified pinned stage...): one message, exit 2, no traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

from trainer import config as config_mod
from trainer.build import build, make_plan, resolved_experiment, vocab_for_planning
from trainer.consistency import CheckFailed
from trainer.errors import EXIT_CHECK_FAILED, EXIT_USER_ERROR, UserError
from trainer.faults import Faults
from trainer.modes import MODES, PROFILE_ACTIVE, PROFILE_WARMUP, RUN, SUBDIR
from trainer.supervisor import record_failure

log = logging.getLogger("trainer")


EPILOG = """\
examples:
  bin/train configs/experiments/tiny.yaml
  bin/train configs/experiments/tiny.yaml --set train.max_steps=50 --set strategy.zero_stage=2
  bin/train configs/experiments/tiny.yaml --print-config
  bin/train configs/experiments/tiny.yaml --prepare-data
  bin/train configs/experiments/tiny-sft.yaml --preview-data 2
  bin/train configs/experiments/tiny.yaml --overfit-batch --set train.max_steps=150
  bin/train configs/experiments/llama7b.yaml --plan --world-size 8 --set strategy.device_memory=80GB
  deepspeed --num_gpus 2 bin/train configs/experiments/tiny.yaml
  torchrun --nproc_per_node 2 bin/train configs/experiments/tiny.yaml
"""


# bin/train's options, declared per group: (flags, argparse keyword arguments).
FLAG = {"action": "store_true"}
OPTIONS = [
    (
        ("--set",),
        {
            "dest": "overrides",
            "action": "append",
            "default": [],
            "metavar": "KEY=VALUE",
            "help": "override a config value, e.g. --set train.max_steps=100 (repeatable; typed by the field)",
        },
    ),
    (("--print-config",), {**FLAG, "help": "print the resolved experiment and DeepSpeed JSON, then exit"}),
    (("--describe-config",), {**FLAG, "help": "print every config key with type, default and meaning"}),
    (("--plan",), {**FLAG, "help": "print the memory plan per ZeRO candidate and the decision, then exit"}),
    (
        ("--world-size",),
        {
            "type": int,
            "default": None,
            "help": "ranks to plan for with --plan/--print-config (default: from the launcher, else 1)",
        },
    ),
    (
        ("--nproc-per-node",),
        {"type": int, "default": None, "help": "ranks per node to plan for (default: min(world size, 8))"},
    ),
    (("--force",), {**FLAG, "help": "run a pinned stage/offload even if predicted not to fit"}),
    (
        ("--max-seq-len",),
        {
            **FLAG,
            "help": "with --plan: the longest sequence this job can train here, every "
            "activation lever and ZeRO rung allowed (docs/strategies.md)",
        },
    ),
    (
        ("--resume",),
        {
            "nargs": "?",
            "const": "latest",
            "default": None,
            "metavar": "PATH",
            "help": "resume from the latest complete checkpoint in the run directory, or from PATH "
            "(a step_XXXXXXXX directory, a checkpoints directory or a run directory)",
        },
    ),
]
MODE_OPTIONS = [  # one at a time
    (
        ("--check",),
        {
            **FLAG,
            "help": "run the consistency checks, one training step and a checkpoint round trip, then exit",
        },
    ),
    (
        ("--overfit-batch",),
        {
            **FLAG,
            "help": "train train.max_steps steps on one fixed batch (the loss must approach "
            "zero), in RUN_DIR/overfit-batch",
        },
    ),
    (
        ("--profile",),
        {
            **FLAG,
            "help": f"profile {PROFILE_ACTIVE} steps after {PROFILE_WARMUP} warm-up steps with "
            "torch.profiler, in RUN_DIR/profile",
        },
    ),
    (
        ("--prepare-data",),
        {
            **FLAG,
            "help": "tokenize and pack the data into data.cache_dir on every core of this "
            "machine, then exit (no launcher, no process group, no DeepSpeed): the "
            "training job finds the cache",
        },
    ),
    (
        ("--preview-data",),
        {
            "nargs": "?",
            "const": 3,
            "type": int,
            "metavar": "N",
            "help": "build (or read) the data cache and show the data as it will train: counts, the "
            "chat template's strategy, packing, padding and the first N examples (default 3) "
            "with their targets in [[ ]], then exit (no launcher, no process group)",
        },
    ),
    (("--dry-run",), {**FLAG, "help": "build everything (and load a checkpoint to resume), take no step"}),
]
SUPERVISED_OPTIONS = [
    (
        ("--launcher",),
        {
            "choices": ["deepspeed", "torchrun", "none"],
            "default": None,
            "help": "start the job with this launcher and supervise it (restarts, OOM escalation)",
        },
    ),
    (
        ("--hostfile",),
        {"default": None, "help": "deepspeed hostfile for a multi-node --launcher deepspeed run"},
    ),
    (
        ("--min-nodes",),
        {
            "type": int,
            "default": None,
            "metavar": "N",
            "help": "with --hostfile: after a failure, go on with the nodes that answer if at least N do, "
            "the global batch kept (default: every node; docs/launching.md)",
        },
    ),
    (
        ("--max-restarts",),
        {
            "type": int,
            "default": None,
            "metavar": "N",
            "help": "re-run a failed job up to N times, resuming from the latest checkpoint (exit 2 "
            "is not retried)",
        },
    ),
]
GROUPS = [  # (title, mutually exclusive, options); None: the parser's own options
    (None, False, OPTIONS),
    ("modes (one at a time; see docs/experiments.md)", True, MODE_OPTIONS),
    ("supervised runs (bin/train starts the launcher and restarts it)", False, SUPERVISED_OPTIONS),
]  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bin/train",
        description="Train a model described by one YAML experiment on DeepSpeed.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("experiment", nargs="?", help="experiment YAML file (e.g. configs/experiments/tiny.yaml)")
    for title, exclusive, options in GROUPS:
        group: Any = p if title is None else p.add_argument_group(title)
        if exclusive:
            group = group.add_mutually_exclusive_group()
        for flags, kwargs in options:
            group.add_argument(*flags, **kwargs)
    # The deepspeed launcher injects --local_rank=N; torch.distributed.launch used --local-rank.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    from trainer.dist import under_torchrun

    if under_torchrun():  # torchrun's failure summary then shows this rank's exception, not just an exit code
        from trainer import startup

        with startup.importing():  # torch, without the collector's full passes (trainer/startup.py)
            from torch.distributed.elastic.multiprocessing.errors import record

        return record(_main)(argv)
    return _main(argv)


def _main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from trainer.dotted import search
    from trainer.model.quantized import quiet_bitsandbytes

    quiet_bitsandbytes()  # (peft imports bitsandbytes when counting a model for --plan too)
    if args.resume and args.resume.endswith((".yaml", ".yml")) and args.experiment is None:
        args.experiment, args.resume = args.resume, "latest"  # `bin/train --resume exp.yaml`
    try:
        if args.describe_config:
            print(config_mod.describe_table())
            return 0
        if not args.experiment:
            raise UserError("no experiment file given: bin/train EXPERIMENT.yaml (try configs/experiments/tiny.yaml)")  # fmt: skip
        exp = config_mod.load(args.experiment, args.overrides)
        search(Path(args.experiment).resolve().parent, Path.cwd())  # the user's modules (rewards, factories)
        if args.prepare_data:
            return prepare_data_command(exp)
        if args.preview_data is not None:
            return preview_data_command(exp, args)
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
        if args.max_seq_len and not args.plan:
            raise UserError("--max-seq-len goes with --plan: bin/train EXP.yaml --plan --max-seq-len")
        if args.plan or args.print_config:
            return plan_command(exp, args)
        if args.launcher is not None or args.max_restarts is not None or args.min_nodes is not None:
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


# ----------------------------------------------------------------------------- planning


def plan_command(exp: config_mod.Experiment, args: argparse.Namespace) -> int:
    """--plan / --print-config: planning only; imports neither deepspeed nor CUDA."""
    from trainer import dist, strategy
    from trainer.strategy.planning.generation import generation_line, row_length

    env = dist.detect()
    world = args.world_size or env.world_size
    per_node = args.nproc_per_node or (env.local_world_size if env.world_size > 1 else min(world, 8))
    gpu_mem = dist.device_memory()
    device_type = "cuda" if (gpu_mem is not None or exp.strategy.device_memory is not None) else "cpu"
    vocab, eos = vocab_for_planning(exp)

    def planned_for(e: config_mod.Experiment) -> Any:
        return make_plan(
            e, world_size=world, gpus_per_node=per_node, device_type=device_type, device_memory=gpu_mem,
            vocab_size=vocab, eos_id=eos, force=args.force, source=args.experiment,
            # device memory given for a machine without a GPU here: planning for another machine
            this_machine=not (exp.strategy.device_memory is not None and gpu_mem is None),
        )  # fmt: skip

    if args.max_seq_len:
        from trainer.strategy.planning.longest import longest_command

        return longest_command(exp, planned_for, world, per_node)
    planned = planned_for(exp)
    exp = planned.exp or exp  # train.micro_batch_size and grad_accum as the plan decided them
    if args.print_config:
        print("# experiment (resolved)")
        print(resolved_experiment(exp, planned).to_yaml())
        print(f"# DeepSpeed config (from {planned.template_path}, world size {world})")
        print(json.dumps(planned.ds_config, indent=2))
    if args.plan:
        info = planned.info
        print(
            f"model: {strategy.describe_params(info, exp.model.lora)} (largest layer {info.largest_layer:,}), "
            f"micro batch {exp.train.micro_batch_size} x seq {row_length(exp)}, activation checkpointing "
            f"{'on' if planned.plan.levers.checkpointing else 'off'}"
            + (f", {info.attn_implementation} attention" if info.attn_implementation else "")
            + (", chunked loss" if planned.plan.levers.chunked_loss else "")
            + (f", {exp.model.kernels} kernels" if exp.model.kernels != "none" else "")
        )
        print(strategy.describe_plan(planned.plan))
        print(
            *([generation_line(exp, planned.plan)] if exp.train.objective == "grpo" else []), sep="\n", end=""
        )
        if planned.batch is not None and planned.batch.why:
            print(f"batch: {planned.batch.why}")
        if exp.checkpoint.every_minutes == "auto":  # the interval before any save is measured
            from trainer.checkpoint.interval import for_plan

            print(for_plan(exp.checkpoint, planned.plan, -(-world // per_node)).describe())
    return 0


def prepare_data_command(exp: config_mod.Experiment) -> int:
    """--prepare-data: build the data cache here, on every core, and say where it is."""
    import time

    from trainer import data as data_mod
    from trainer.dist import cpu_cores, detect

    if detect().world_size > 1:
        raise UserError(
            "--prepare-data builds the data cache once per machine, without a launcher: run "
            "`bin/train EXPERIMENT.yaml --prepare-data` on its own"
        )
    t0 = time.perf_counter()
    d = data_mod.build(exp.data, exp.seed, is_main=True, num_proc=cpu_cores(), progress=True)
    n_eval = len(d.eval) if d.eval is not None else 0
    done = f"built in {time.perf_counter() - t0:.1f} s" if d.built else "already there"
    if d.rebuilt:
        done += f" (rebuilt: {d.rebuilt})"
    tokens = d.tokens if d.tokens is not None else (len(d.train) + n_eval) * d.seq_len
    print(
        f"data: {len(d.train):,} train / {n_eval:,} eval sequences of {d.seq_len} tokens "
        f"({tokens:,} tokens) in {d.cache_path}, {done}; a job with the same "
        "data.* settings and data.cache_dir reads it"
    )
    return 0


def preview_data_command(exp: config_mod.Experiment, args: argparse.Namespace) -> int:
    """--preview-data [N]: the data as it will train (trainer/data/preview.py)."""
    from trainer import data as data_mod
    from trainer.build_model import packing_verdict
    from trainer.data.preview import preview
    from trainer.dist import cpu_cores, detect

    if detect().world_size > 1:
        raise UserError(
            "--preview-data reads the data on this machine, without a launcher: run it on its own"
        )
    if args.preview_data < 0:
        raise UserError(f"--preview-data: {args.preview_data} examples; give a count of 0 or more")
    d = data_mod.build(exp.data, exp.seed, is_main=True, num_proc=cpu_cores(), progress=False)
    packing = None
    if d.supervised and exp.data.packing and not d.pairs:
        from trainer.dist import gpu_present
        from trainer.model import resolved

        device = "cuda" if gpu_present() else "cpu"
        precision = (
            exp.train.precision if exp.train.precision != "auto" else ("bf16" if device == "cuda" else "fp32")
        )
        section = resolved(exp.model, seq_len=exp.data.seq_len, precision=precision, device_type=device)
        try:
            packing = packing_verdict(exp, section, d)
        except UserError as e:  # shown with the data: training would stop here
            packing = f"not possible: {e}"
    print(preview(exp, d, args.preview_data, args.world_size or 1, packing))
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
    if args.min_nodes is not None and not (args.hostfile and launcher == "deepspeed" and args.min_nodes >= 1):
        raise UserError("--min-nodes N (N >= 1) continues a --launcher deepspeed --hostfile run on the nodes that answer; "
                        "give it with both, or leave it out")  # fmt: skip
    sup = Supervisor(
        experiment=args.experiment,
        overrides=list(args.overrides),
        run_dir=Path(exp.run_dir),
        launcher=launcher,
        nproc_per_node=args.nproc_per_node or 1,
        hostfile=args.hostfile,
        max_restarts=args.max_restarts or 0,
        min_nodes=args.min_nodes,
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
    for key, src in [*exp.data.sources, ("data.eval", exp.data.eval)]:
        if src is not None and src.files is not None:
            resolve_files(src, key)

    from trainer import startup
    from trainer.build import undamaged
    from trainer.checkpoint.policy import decide

    resume = decide(args.resume, exp, Faults(dist.detect().rank, dist.attempt()))
    if resume is not None and dist.detect().world_size == 1:  # several ranks: once they agree (build.py)
        resume = undamaged(exp, dist.detect(), resume)  # its bytes checked before "nothing to do" is said
        if resume.done(exp, 0):
            return 0

    # torch and transformers' modeling code without the garbage collector's full passes over them
    # (trainer/startup.py)
    dist.hide_gpus_if_asked()  # TRAINER_CPU=1: before torch looks for GPUs
    with startup.importing():
        startup.import_libraries(exp.model)

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
    exp = planned.exp or exp  # train.micro_batch_size and grad_accum as the plan decided them
    runtime = dist.setup(exp.dist.timeout_s)
    try:
        mode = next((m for m in MODES if getattr(args, m)), "train")
        run = build(
            exp,
            runtime,
            planned,
            resume,
            one_off=mode in SUBDIR,  # no eval (see trainer/modes.py)
            max_steps=PROFILE_WARMUP + PROFILE_ACTIVE if mode == "profile" else None,
            training=mode == "train",  # the one-off modes move nothing in the checkpoints directory
        )
        return 0 if run is None else RUN[mode](run)
    except UserError as e:
        if e.everywhere is None:
            e.everywhere = False  # found by this rank while running: it must say it itself
        raise
    finally:
        import torch.distributed as tdist

        if tdist.is_initialized():
            tdist.destroy_process_group()
