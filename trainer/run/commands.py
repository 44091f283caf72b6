"""What `bin/train` does once its arguments are parsed (trainer/run/cli.py): `--plan`/`--print-config` (planning
only, no process group, no torch), `--prepare-data`, `--preview-data`, the supervisor (`--launcher`,
`--max-restarts`), and training itself under any launcher or none (resolve the checkpoint to resume, plan,
set up the process group, build the Run, run the mode)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from trainer import config as config_mod
from trainer.common.errors import UserError
from trainer.common.faults import Faults
from trainer.run import rundir
from trainer.run.build import build
from trainer.run.modes import MODES, RUN, SUBDIR
from trainer.run.plan import make_plan, resolved_experiment, vocab_for_planning
from trainer.run.profile import PROFILE_ACTIVE, PROFILE_WARMUP

# ----------------------------------------------------------------------------- planning


def plan_command(exp: config_mod.Experiment, args: argparse.Namespace) -> int:
    """--plan / --print-config: planning only; imports neither deepspeed nor CUDA."""
    from trainer import strategy
    from trainer.cluster import devices, dist
    from trainer.strategy.planning import images
    from trainer.strategy.planning.activations import rows_per_micro
    from trainer.strategy.planning.generation import generation_line, row_length
    from trainer.strategy.planning.layers import describe_shape

    env = dist.detect()
    world = args.world_size or env.world_size
    per_node = args.nproc_per_node or (env.local_world_size if env.world_size > 1 else min(world, 8))
    gpu_mem = devices.device_memory()
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
        shape = describe_shape(info)
        if shape:
            print(shape)
        if info.vision is not None:
            print(images.describe(images.experiment_budget(
                exp, info.vision, strategy.low_precision_bytes(planned.plan.precision), rows_per_micro(exp),
                row_length(exp), info.attn_implementation == "eager", planned.plan.levers.checkpointing), info.vision))  # fmt: skip
        print(strategy.describe_plan(planned.plan))
        print(
            *([generation_line(exp, planned.plan)] if exp.train.objective == "grpo" else []), sep="\n", end=""
        )
        if exp.train.objective == "distill":
            from trainer.strategy.planning.teacher import teacher_line

            c = planned.plan.candidate
            print(teacher_line(exp, strategy.low_precision_bytes(planned.plan.precision), c.stage, world,
                               c.offload_params))  # fmt: skip
        if planned.batch is not None and planned.batch.why:
            print(f"batch: {planned.batch.why}")
        if exp.checkpoint.every_minutes == "auto":  # the interval before any save is measured
            from trainer.checkpoint.interval import for_plan

            print(for_plan(exp.checkpoint, planned.plan, -(-world // per_node)).describe())
    return 0


def decided(arg: str | None, exp: config_mod.Experiment, env: Any, job: str | None = None) -> Any:
    """What this run resumes (checkpoint.policy.decide), every rank deciding with the run directory held: a
    rank that cannot is an error on every rank, naming it (one rank alone stopping would leave the others
    waiting in the next collective). A restart of the job's command line (torchrun's, a Slurm requeue: the
    same `job`) resumes the `--resume PATH` it names only until the job committed a checkpoint of its own,
    then the line's newest, as the supervisor's restarts do (checkpoint/restart.py)."""
    from trainer.checkpoint.policy import decide
    from trainer.checkpoint.restart import restart_resume
    from trainer.cluster import dist
    from trainer.cluster.dist import all_gather

    try:
        if arg not in (None, "latest") and job and dist.restarted():
            arg = restart_resume(Path(exp.run_dir), arg, job)
        resume, why = decide(arg, exp, Faults(env.rank, dist.attempt())), None
    except UserError as e:
        resume, why = None, e
    said = all_gather(None if why is None else why.render(), env.world_size) if env.world_size > 1 else [None]
    if why is not None and env.world_size == 1:
        raise why
    failed = [r for r, w in enumerate(said) if w is not None]
    if failed:
        first = said[failed[0]]
        if all(said[r] == first for r in failed) and len(failed) == env.world_size:
            raise UserError(first, everywhere=True)
        raise UserError(f"rank(s) {', '.join(map(str, failed))} could not decide what to resume: {first}",
                        everywhere=True)  # fmt: skip
    return resume


def prepare_data_command(exp: config_mod.Experiment) -> int:
    """--prepare-data: build the data cache here, on every core, and say where it is."""
    import time

    from trainer import data as data_mod
    from trainer import objectives
    from trainer.cluster.dist import cpu_cores, detect

    if detect().world_size > 1:
        raise UserError(
            "--prepare-data builds the data cache once per machine, without a launcher: run "
            "`bin/train EXPERIMENT.yaml --prepare-data` on its own"
        )
    t0 = time.perf_counter()
    d = data_mod.build(exp.data, exp.seed, is_main=True, num_proc=cpu_cores(), progress=True)
    objectives.check_data(exp, d)
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


def prepare_teacher_command(exp: config_mod.Experiment) -> int:
    """--prepare-teacher: the data cache, then the teacher's top-k over it (trainer/objectives/teacher_store.py),
    in the run's precision: in one process on this machine's first GPU (else its CPU), or under a launcher on one
    node, its ranks sharing the micro batches (a GPU each)."""
    import torch

    from trainer import data as data_mod
    from trainer.cluster import dist
    from trainer.objectives.distill import compute_dtype
    from trainer.objectives.teacher_store import prepare

    d, env = exp.train.distill, dist.detect()
    if exp.train.objective != "distill" or not d.offline:
        raise UserError("--prepare-teacher stores the teacher of train.objective: distill for train.distill.offline: "
                        "set both (and train.distill.top_k)")  # fmt: skip
    if env.nodes > 1:
        raise UserError(f"--prepare-teacher runs on one node ({env.nodes} launched): its ranks write the store beside "
                        "the node's data cache; launch it with one node's GPUs")  # fmt: skip
    runtime = dist.setup() if env.world_size > 1 else None
    if runtime is not None:
        device = runtime.device
    else:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    precision = exp.train.precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    dtype = compute_dtype(precision)
    cores = dist.cpu_cores() // max(1, env.local_world_size)
    data = data_mod.build(
        exp.data, exp.seed, is_main=env.local_rank == 0, num_proc=max(1, cores), progress=True
    )
    barrier = torch.distributed.barrier if runtime else None
    prepare(exp, data, device, dtype, env.rank, env.world_size, barrier)
    return 0


def preview_data_command(exp: config_mod.Experiment, args: argparse.Namespace) -> int:
    """--preview-data [N]: the data as it will train (trainer/data/preview.py)."""
    from trainer import data as data_mod
    from trainer.cluster.dist import cpu_cores, detect
    from trainer.data.preview import preview
    from trainer.run.build_model import packing_verdict

    if detect().world_size > 1:
        raise UserError(
            "--preview-data reads the data on this machine, without a launcher: run it on its own"
        )
    if args.preview_data < 0:
        raise UserError(f"--preview-data: {args.preview_data} examples; give a count of 0 or more")
    d = data_mod.build(exp.data, exp.seed, is_main=True, num_proc=cpu_cores(), progress=False)
    packing = None
    if d.supervised and exp.data.packing and not d.pairs:
        from trainer.cluster.devices import gpu_present
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
    from trainer.cluster.dist import detect
    from trainer.run.supervisor import Supervisor

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
    from trainer.cluster import devices, dist
    from trainer.data import resolve_files

    # Cheap checks before any process group: data files exist.
    for key, src in [*exp.data.sources, ("data.eval", exp.data.eval)]:
        if src is not None and src.files is not None:
            resolve_files(src, key)

    from trainer.common import startup

    # torch and transformers' modeling code without the garbage collector's full passes over them
    # (trainer/common/startup.py)
    devices.hide_gpus_if_asked()  # TRAINER_CPU=1: before torch looks for GPUs
    with startup.importing():
        startup.import_libraries(exp.model)

    env = dist.detect()
    device_type = "cuda" if devices.gpu_present() else "cpu"
    vocab, eos = vocab_for_planning(exp)

    def planned_for(saved_ds_config: dict | None) -> Any:
        return make_plan(
            exp, world_size=env.world_size, gpus_per_node=env.local_world_size, device_type=device_type,
            device_memory=devices.device_memory(), vocab_size=vocab, eos_id=eos, force=args.force,
            source=args.experiment, saved_ds_config=saved_ds_config,
        )  # fmt: skip

    planned = planned_for(None)  # a job that cannot fit stops here, before any process group work
    runtime = dist.setup((planned.exp or exp).dist.timeout_s)
    try:
        # Nothing reads the run directory to decide before rank 0 holds it (a dying job may still save and prune)
        wait = rundir.lock_wait(exp.checkpoint.lock_wait_s, exp.dist.timeout_s)
        lock, job = rundir.hold(
            exp.run_dir, env.rank, env.world_size, wait, say=lambda m: print(m, flush=True)
        )
        resume = decided(args.resume, exp, env, job)
        if resume is not None:
            planned = planned_for(resume.ds_config)  # its LR schedule continues
        exp = planned.exp or exp  # train.micro_batch_size and grad_accum as the plan decided them
        mode = next((m for m in MODES if getattr(args, m)), "train")
        run = build(
            exp,
            runtime,
            planned,
            resume,
            lock=lock,
            job=job,
            one_off=mode in SUBDIR,  # no eval (see trainer/run/modes.py)
            max_steps=PROFILE_WARMUP + PROFILE_ACTIVE if mode == "profile" else None,
            training=mode == "train",  # the one-off modes move nothing in the checkpoints directory
        )
        code = 0 if run is None else RUN[mode](run)
        # every rank reaches the end before any tears the process group down: a rank that did so while another
        # was still leaving its last step aborted at exit ("terminate called without an active exception";
        # CI, after a synchronous save, as f8a13c7 had seen after an asynchronous final one). Only at a run's
        # end: a rank that ends its attempt alone (out of memory on it) must not wait for ranks still in a step
        import torch.distributed as tdist

        if code == 0 and tdist.is_initialized() and env.world_size > 1:
            tdist.barrier()
        return code
    except UserError as e:
        if e.everywhere is None:
            e.everywhere = False  # found by this rank while running: it must say it itself
        raise
    finally:
        import torch.distributed as tdist

        if tdist.is_initialized():
            tdist.destroy_process_group()
