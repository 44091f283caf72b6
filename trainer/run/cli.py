"""`bin/train`: parse the arguments, load the experiment, and dispatch to a command (trainer/run/commands.py):

- `--prepare-data`, `--preview-data`: the data only; `--prepare-teacher`: distillation's stored teacher;
- `--plan` / `--print-config`: plan only (no process group, no torch);
- `--launcher` / `--max-restarts`: start the launcher and supervise it (trainer/run/supervisor.py);
- otherwise (under any launcher, or none): train.
A one-off mode that gets its own run directory (`--overfit-batch`, `--profile`) is pointed at it here.
User errors (bad config, bad paths, an unjustified pinned stage...): one message, exit 2, no traceback.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

from trainer import config as config_mod
from trainer.common.errors import EXIT_CHECK_FAILED, EXIT_USER_ERROR, UserError
from trainer.run.commands import (
    plan_command,
    prepare_data_command,
    prepare_teacher_command,
    preview_data_command,
    supervise_command,
    train_command,
)
from trainer.run.consistency import CheckFailed
from trainer.run.modes import MODES, SUBDIR
from trainer.run.profile import PROFILE_ACTIVE, PROFILE_WARMUP
from trainer.run.supervisor import record_failure

EPILOG = """\
examples:
  bin/train configs/experiments/tiny.yaml
  bin/train configs/experiments/tiny.yaml --set train.max_steps=50 --set strategy.zero_stage=2
  bin/train configs/experiments/tiny.yaml --print-config
  bin/train configs/experiments/tiny.yaml --prepare-data
  bin/train configs/experiments/tiny-sft.yaml --preview-data 2
  bin/train configs/experiments/tiny-distill.yaml --prepare-teacher --set train.distill.offline=true
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
        ("--prepare-teacher",),
        {
            **FLAG,
            "help": "train.distill.offline: run the teacher once over the data and store its top-k "
            "log-probabilities (on this machine's first GPU, or its CPU), then exit: training reads them "
            "with no teacher in memory",
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
    from trainer.cluster.dist import under_torchrun

    if under_torchrun():  # torchrun's failure summary then shows this rank's exception, not just an exit code
        from trainer.common import startup

        with startup.importing():  # torch, without the collector's full passes (trainer/common/startup.py)
            from torch.distributed.elastic.multiprocessing.errors import record

        return record(_main)(argv)
    return _main(argv)


def _main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from trainer.common.dotted import search
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
        if args.prepare_teacher:
            return prepare_teacher_command(exp)
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
    from trainer.cluster.dist import detect

    return detect().rank
