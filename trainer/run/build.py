"""Everything built before the loop, once the plan is made (trainer/run/plan.py): (experiment, plan,
environment, resume) -> one `Run` the modes share (trainer/run/modes.py), in this order: the run
directory claimed (rank 0), the data, one agreement across ranks (the run directory is ours, every rank
resumes from the same checkpoint and reads the same data), the model and the engine
(trainer/run/build_model.py), the data stream and the evaluator, metrics, run control, the checkpointer
(and the resume loaded). Each component receives only its own section of the experiment. Nothing here
trains.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from trainer.config import Experiment
from trainer.run.plan import Planned

log = logging.getLogger("trainer")


@dataclass
class Debug:
    """What tests ask for through TRAINER_DEBUG_DIR: consumed samples, the memory census, the
    optimizer state at each save and after a resume, a report per rank at the end."""

    directory: str
    memory: Any = None  # consistency.MemoryCensus


@dataclass
class Run:
    exp: Experiment
    runtime: Any  # dist.Runtime
    planned: Planned
    resume: Any  # checkpoint.Resume | None
    data: Any  # data.Data
    engine: Any  # engine.Engine
    layout: tuple[list[list[str]], dict[str, str]]  # parameter names per optimizer group, tied aliases
    stream: Any  # data.TrainStream
    evaluator: Any  # loop.Evaluator
    state: Any  # loop.TrainState
    metrics: Any  # metrics.Metrics
    control: Any  # control.Control
    faults: Any  # faults.Faults
    checkpointer: Any  # checkpoint.Checkpointer
    hosts: list[str]
    notes: list[str] = field(default_factory=list)  # what the resume changed (logged at start)
    objective_notes: list[str] = field(default_factory=list)  # a preference objective's (the banner)
    debug: Debug | None = None

    @property
    def env(self) -> Any:
        return self.runtime.env

    @property
    def samples_per_step(self) -> int:
        """Sequences a step trains on: over the data-parallel ranks (world / sequence parallel)."""
        return self.exp.train.sequences_per_step(self.planned.plan.dp_world)


def build(
    exp: Experiment,
    runtime: Any,
    planned: Planned,
    resume: Any,
    *,
    lock: str | None = None,
    job: str | None = None,
    one_off: bool = False,
    max_steps: int | None = None,
    training: bool = True,
) -> Run | None:
    """The Run, or None when a resume finds the checkpoint already at train.max_steps. `lock`: what taking the
    run directory said (rundir.hold, before the resume was decided: None, or a warning); `one_off`:
    --overfit-batch and --profile (no eval); `max_steps`: the steps the metrics count to; `training`: the
    default mode (the others leave the checkpoints directory as it is: no rollback, nothing moved)."""
    from trainer import metrics
    from trainer.checkpoint import Checkpointer, Store, checkpoints_dir
    from trainer.cluster import dist
    from trainer.cluster.control import Control
    from trainer.common.faults import Faults
    from trainer.run.loop import TrainState

    env = runtime.env
    metrics.setup_logging(runtime.is_main, env.rank, exp.logging.level)
    for warning in _config_warnings(exp) if runtime.is_main else ():
        log.warning(f"warning: {warning}")
    agreed = claim_and_agree(exp, runtime, resume, planned.plan, training, lock, job)
    if agreed is None:
        return None
    data, hosts, notes, resume, disk = agreed
    from trainer.run.build_model import model_and_engine

    engine, layout = model_and_engine(exp, env, planned, data)
    stream, evaluator = data_for_rank(exp, runtime, data, one_off, planned)
    state = TrainState()
    mets = make_metrics(exp, runtime, planned, engine, hosts, max_steps or exp.train.max_steps)
    objective_notes = prepare_objective(exp, env, engine, data, mets, stream, state)
    if engine.experts is not None:  # the router's expert load, per layer, over every rank
        objective_reduced = mets.reduced
        mets.reduced = lambda: {**(objective_reduced() if objective_reduced else {}),
                                **engine.experts[1].flush(env.world_size)}  # fmt: skip
    if data.mixture:
        mets.extra = lambda: {"tokens_by_source": stream.tokens_by_source()}
    faults = Faults(env.rank, dist.attempt())
    control = Control(
        rank=env.rank,
        world_size=env.world_size,
        faults=faults,
        handle_signals=exp.checkpoint.save_on_signal,
        watchdog_s=exp.dist.watchdog_s,
        nan_check=exp.dist.nan_check and planned.plan.precision != "fp16",  # fp16: DeepSpeed skips the step
    )
    store = Store(
        checkpoints_dir(exp.run_dir), engine=engine, stream=stream, exp=exp, rank=env.rank,
        world_size=env.world_size, plan={**planned.plan.summary(), **stages_record(engine)}, layout=layout, faults=faults,
        data_fingerprint=data.fingerprint, recent=lambda: {"metrics": mets.recent(), "wandb_run_id": mets.wandb_id},
        resumed_from=str(resume.found.path.resolve()) if resume is not None else None, disk=disk,
    )  # fmt: skip
    background, _ = planned.plan.checkpoint_async(exp.checkpoint.async_)
    checkpointer = Checkpointer(
        exp.checkpoint, store, background=background, record=mets.record, heartbeat=control.heartbeat
    )
    if exp.checkpoint.every_minutes == "auto":  # the Young/Daly interval (checkpoint/interval.py)
        from trainer.checkpoint.interval import for_plan

        checkpointer.cadence.auto = for_plan(exp.checkpoint, planned.plan, env.nodes)
    run = Run(
        exp=exp, runtime=runtime, planned=planned, resume=resume, data=data, engine=engine, layout=layout,
        stream=stream, evaluator=evaluator, state=state, metrics=mets, control=control, faults=faults,
        checkpointer=checkpointer, hosts=hosts, notes=[*(planned.schedule.notes if planned.schedule else ()), *notes],
        objective_notes=objective_notes,
    )  # fmt: skip
    if resume is not None:
        checkpointer.load(resume.found, state)
        if resume.lease is not None:  # another run directory's checkpoint, loaded: its writer may prune it
            resume.lease.release()
    store.guard_frozen()  # model.lora: the frozen weights' digest, before the first step
    attach_debug(run, dist.debug_dir())
    return run


def prepare_objective(
    exp: Experiment, env: Any, engine: Any, data: Any, mets: Any, stream: Any = None, state: Any = None
) -> list[str]:
    """A preference objective: the reference's log-probs (before a checkpoint is loaded: computed by
    the model as training starts, or read from the cache) and its metrics; the banner's lines."""
    objective = engine.objective
    if hasattr(stream, "samplers"):  # distill's on-policy steps and the teacher's completions
        from trainer.objectives.on_policy import prepare

        mets.reduced = stream.flush
        return prepare(exp, env, engine, data, stream)
    if objective is None:
        return []
    mets.reduced = lambda: objective.flush(env.world_size)
    if exp.train.objective == "grpo":
        from trainer.rl import prepare

        return prepare(exp, env, engine, data, stream, mets, state)
    if exp.train.objective == "reward":
        objective.attach(data, engine.ds.module)  # (the margins, the pad token its score is read by)
        return [f"objective: {objective.describe()}; each pair's two responses in one forward, pad token "
                f"{objective.pad_id}"]  # fmt: skip
    if exp.train.objective == "kto":
        from trainer.objectives.kto import prepare as kto_prepare

        lines = kto_prepare(objective, engine, data, stream, env.rank == 0)
    else:
        lines = [
            f"objective: {objective.describe()}: each pair's chosen and rejected responses in one forward"
        ]
    lines[0] += ("; dropout off (train.preference.disable_dropout, as TRL: the reference is computed without it)"
                 if exp.train.preference.disable_dropout else "; the model's dropout kept (train.preference."
                 "disable_dropout: false): the policy differs from its reference from the first step")  # fmt: skip
    if objective.needs_reference:
        from trainer.objectives.reference import prepare

        t = exp.train
        lines.append(
            prepare(objective, engine, data, t.micro_batch_size, env.rank, env.world_size, env.local_rank)
        )
    return lines


def claim_and_agree(
    exp: Experiment, runtime: Any, resume: Any, plan: Any, training: bool = True, lock: str | None = None,
    job: str | None = None,
) -> tuple[Any, list[str], list[str], Any, Any] | None:  # fmt: skip
    """The data, then one gather before anything else is built (rank 0 holds the run directory since before
    the resume was decided: rundir.hold): every rank resumes from the same checkpoint and reads the same data.
    Returns (data, every rank's host, notes on changed data and the lineage, the resume as checked, the
    checkpoints directory as rank 0 left it: None elsewhere), or None: nothing left to train."""
    from trainer import data as data_mod
    from trainer import objectives
    from trainer.checkpoint.policy import undamaged
    from trainer.cluster import dist
    from trainer.common.errors import UserError
    from trainer.common.faults import Faults
    from trainer.run import consistency, rundir

    env = runtime.env
    data = data_mod.build(exp.data, exp.seed, is_main=env.local_rank == 0)
    objectives.check_data(exp, data)  # (the objective's own checks of what the data holds: reward's pairs)
    if data.built:
        why = f" (rebuilt: {data.rebuilt}; the earlier cache is not reused)" if data.rebuilt else ""
        log.info(f"data: tokenized and cached in {data.cache_path}{why}")
    if exp.train.objective in ("dpo", "ipo", "kto"):  # what the reference's log-probs depend on: reference.py
        from trainer.objectives.reference import reference_key

        data.fingerprint["reference"] = reference_key(
            exp, data, plan.precision, plan.candidate.stage, plan.world_size
        )
    if exp.train.objective == "distill":  # what the student is trained towards: its teacher
        from trainer.objectives.distill import teacher_key

        data.fingerprint["teacher"] = teacher_key(exp.train.distill)
    blind = rundir.shared_everywhere(exp.run_dir, env.rank, env.world_size, env.nodes)
    if blind:  # node-local disks: every node would hold its own, partial checkpoints
        raise UserError(
            f"run_dir {exp.run_dir} is not shared between the nodes: rank(s) {', '.join(map(str, blind))} do not see "
            f"the file rank 0 wrote in it (a node-local disk). Each node would keep its own part of every checkpoint "
            "and rank 0 would commit checkpoints it cannot see whole, which no resume could load: set run_dir to a "
            "directory on a filesystem every node mounts (a network or parallel filesystem)",
            everywhere=True,
        )
    hosts = consistency.agree_at_start(
        env.world_size,
        run_dir=exp.run_dir,
        host=env.hostname,
        resume=resume.identity if resume is not None else None,
        data_digest=data.fingerprint["train_digest"],
    )
    if lock is not None and runtime.is_main:
        log.warning(lock)  # the filesystem has no locks
    resume = undamaged(exp, env, resume)
    if resume is not None and resume.done(exp, env.rank):
        return None
    notes = resume.check_data(data.fingerprint, exp.checkpoint.on_data_change) if resume else []
    disk = None
    if (
        runtime.is_main and training
    ):  # the lineage: a rollback's fork, damaged ones set aside (checkpoint/begin.py)
        from trainer.checkpoint.directory import CheckpointDir
        from trainer.checkpoint.disk import checkpoints_dir

        c = exp.checkpoint
        faults = Faults(env.rank, dist.attempt())
        disk = CheckpointDir(checkpoints_dir(exp.run_dir), keep_abandoned=c.keep_abandoned,
                             keep_damaged=c.keep_damaged, faults=faults)  # fmt: skip
        faults.at("killstart", 0)  # tests: a kill during start-up, before the fork
        try:
            notes += disk.start(
                resume.found if resume else None, explicit=bool(resume and resume.explicit),
                skipped=resume.skipped if resume else [], on_rollback=c.on_rollback, job=job,
            )  # fmt: skip
        except OSError as e:  # a read-only or full checkpoints directory: a restart would fail the same way
            from trainer.checkpoint.fs import describe

            raise UserError(
                "checkpoints: " + describe(e, e.filename or disk.root, "preparing the run's checkpoints")
            ) from None
    return data, hosts, notes, resume, disk


def eval_prompts(exp: Experiment, data: Any) -> list[str]:
    """train.eval_prompts as the model sees them: for chat data, each a user turn rendered with the
    chat template and its generation prompt."""
    if exp.data.kind != "chat":
        return list(exp.train.eval_prompts)
    from trainer.data.examples import chat_profile

    p = chat_profile(exp.data, data.tokenizer)
    return [
        p.render(data.tokenizer, [{"role": "user", "content": q}], prompt=True)
        for q in exp.train.eval_prompts
    ]


WIDTH_MULTIPLE_COMPILED = 64


def stages_record(engine: Any) -> dict[str, Any]:
    """Pipeline stages: where the model is cut and each layer file's names as the model has them (bin/export and a
    resume without stages read the layer files by them)."""
    if getattr(engine, "pipe", None) is None:
        return {}
    module = engine.module
    return {"pipeline": {"parts": list(module.parts), "names": module.names, "aliases": module.aliases}}


def data_for_rank(
    exp: Experiment, runtime: Any, data: Any, one_off: bool, planned: Planned
) -> tuple[Any, Any]:
    """This rank's training stream and the evaluator over its share of the eval set. Under sequence
    parallelism the ranks of a sequence group read the same rows (each takes its shard of them: the
    engine), so the data is split over the data-parallel ranks, world / sequence parallel."""
    from trainer import data as data_mod
    from trainer.run.loop import Evaluator

    env, t, sp, mp = runtime.env, exp.train, planned.plan.sp, planned.plan.levers.mp
    fixed = sp > 1 or (planned.model or exp.model).tiled_mlp is True  # every rank's rows as long: seq_len
    dp = env.world_size // mp
    where = {  # a sequence- or tensor-parallel group's ranks (consecutive) read the same rows; a pipeline's stages
        # are world / pp ranks apart (DeepSpeed's topology: stages outermost, a stage's tensor-parallel ranks
        # innermost), its first and last read the same rows
        "rank": env.rank // (mp // planned.plan.pp) % dp if planned.plan.pp > 1 else env.rank // mp,
        "world": dp,
        "micro": t.micro_batch_size,
        "device_type": runtime.device_type,
        # fine-tuning batches are as wide as their longest row; under torch.compile a multiple of 64, so
        # that few shapes are compiled (CUDA graphs record one per shape); 0: seq_len wide
        "width_multiple": 0 if fixed else WIDTH_MULTIPLE_COMPILED if t.compile else 1,
    }
    if (
        t.objective == "distill" and exp.data.kind == "prompt"
    ):  # completed each step (on_policy.py); no eval loss
        from trainer.objectives.on_policy import PolicyStream, PromptRows
        from trainer.rl.generate import pad_id

        inner = PromptRows(data, exp.data, rank=where["rank"], world=where["world"], micro=t.micro_batch_size,
                           accum=t.grad_accum, seed=exp.seed, pad=pad_id(data.tokenizer))  # fmt: skip
        return PolicyStream(inner, t.distill, seed=exp.seed, seq_len=exp.data.seq_len), Evaluator(
            None, 0, env.world_size, None
        )
    if t.objective == "grpo":  # prompts, generated and scored each step (trainer/rl/rollout.py); no eval loss
        from trainer.rl.rollout import RolloutStream

        stream = RolloutStream(data, exp.data, t.rl, rank=env.rank, world=env.world_size, micro=t.micro_batch_size,
                               accum=t.grad_accum, seed=exp.seed, seq_len=exp.data.seq_len, tokenizer=data.tokenizer)  # fmt: skip
        return stream, Evaluator(None, 0, env.world_size, None)
    stream = data_mod.TrainStream(data, exp.data, seed=exp.seed, accum=t.grad_accum, **where)
    if t.objective == "kto" and t.kto.loss_type == "kto":  # the step's KL reference point at its start
        from trainer.objectives.kto import KLStream

        stream = KLStream(stream)  # (its objective and engine: kto.prepare)
    if t.objective == "distill" and (t.distill.lmbda > 0 or t.distill.seq_kd):  # completions sampled a step
        from trainer.objectives.on_policy import PolicyStream

        stream = PolicyStream(
            stream, t.distill, seed=exp.seed, seq_len=exp.data.seq_len, pack=bool(data.packing)
        )
    eval_loader = data_mod.eval_batches(data, exp.data, limit=t.eval_batches, **where)
    asked = eval_prompts(exp, data)
    if asked and sp > 1 and runtime.is_main:
        log.warning("warning: train.eval_prompts: no greedy samples under sequence parallelism (the attention "
                    "layers expect seq_len / sequence_parallel tokens); the eval loss is still computed")  # fmt: skip
    # chat prompts are rendered by the template, whose output the training rows begin with as it is
    prompts = (data.tokenizer, [] if sp > 1 else asked, t.eval_max_new_tokens, exp.data.kind == "chat")
    return stream, Evaluator(None if one_off else eval_loader, t.eval_every, env.world_size, prompts)


def make_metrics(
    exp: Experiment, runtime: Any, planned: Planned, engine: Any, hosts: list[str], max_steps: int
) -> Any:
    from trainer import metrics
    from trainer.strategy import flops_per_token

    env, t, info = runtime.env, exp.train, planned.info
    samples = t.sequences_per_step(planned.plan.dp_world)
    return metrics.Metrics(
        exp.run_dir,
        is_main=runtime.is_main,
        world_size=env.world_size,
        # the ranks whose losses sum to the step's: the data-parallel ones (a sequence-parallel group's shards sum to
        # its rows'); a tensor-parallel group's ranks each hold its rows' whole loss
        # (every pipeline stage logs the step's loss)
        loss_ranks=planned.plan.dp_world * planned.plan.tp * planned.plan.pp,
        log_every=t.log_every,
        max_steps=max_steps,
        samples_per_step=samples,
        tokens_per_step=samples * exp.data.seq_len,
        device=engine.device,
        hosts=hosts,
        straggler_margin=exp.dist.straggler_margin,
        perplexity=exp.train.objective != "distill",
        progress=progress_enabled(exp.logging.progress),
        flops_per_token=flops_per_token(info, exp.data.seq_len),  # a mixture of experts': its active ones
        peak_flops=metrics.peak_flops(engine.device, exp.logging.peak_tflops),
        tags={
            "strategy": planned.plan.candidate.name,
            "zero_stage": planned.plan.candidate.stage,
            "micro_batch_size": t.micro_batch_size,
            "grad_accum": t.grad_accum,
            "seq_len": exp.data.seq_len,
            **({"sequence_parallel": planned.plan.sp} if planned.plan.sp > 1 else {}),
            **({"tensor_parallel": planned.plan.tp} if planned.plan.tp > 1 else {}),
            **({"expert_parallel": planned.plan.ep} if planned.plan.ep > 1 else {}),
            **({"pipeline_stages": planned.plan.pp} if planned.plan.pp > 1 else {}),
        },
    )


def attach_debug(run: Run, directory: str | None) -> None:
    """Tests (TRAINER_DEBUG_DIR): record consumed samples, take the memory census, dump the optimizer
    state after a resume and at every save (compared across runs)."""
    if not directory:
        return
    from trainer.run import consistency

    def dump(name: str) -> None:
        consistency.save_optimizer_state(directory, name, run.engine, run.layout[0], run.env.rank)

    run.debug = Debug(directory)
    if run.resume is not None:
        dump(f"optimizer_resumed_step{run.state.step}")
    run.stream.record = []
    run.debug.memory = consistency.MemoryCensus()
    hooks = [run.debug.memory]
    from trainer.cluster.dist import debug_grads_step

    if debug_grads_step():
        hooks.append(consistency.GradDump(directory, debug_grads_step(), run.env.rank))
    run.engine.on_backward = lambda engine: [hook(engine) for hook in hooks]
    if os.environ.get("TRAINER_DEBUG_ACTIVATIONS"):
        run.engine.saved_probe = consistency.SavedActivations(directory, run.env.rank, run.engine.ds.module)
    run.checkpointer.store.on_save = lambda step: dump(f"optimizer_saved_step{step}")


def _config_warnings(exp: Experiment) -> list[str]:
    from trainer.config import warnings

    return warnings(exp)


def progress_enabled(setting: Any) -> bool:
    """logging.progress: true, false, or auto = a bar only when stdout is a terminal (plain log lines
    in CI and log files)."""
    return sys.stdout.isatty() if setting == "auto" else bool(setting)
