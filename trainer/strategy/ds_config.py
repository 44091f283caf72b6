"""The DeepSpeed JSON: a template plus the experiment plus the plan -> the one dict handed to
`deepspeed.initialize`.

Every value the experiment owns (batch sizes, precision, clipping, optimizer, LR schedule, stage,
offload) comes from the experiment; a template's `"auto"` is filled (model-dependent bucket sizes
as the Hugging Face integration does); a template value that disagrees is an error listing every
mismatch; unknown top-level keys are errors (DeepSpeed would silently ignore them).

Nothing here imports torch or deepspeed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.common.errors import Problem, UserError, did_you_mean
from trainer.common.optimizers import OPTIMIZERS
from trainer.config import TEMPLATES_DIR, Experiment
from trainer.strategy.planning import (
    DEEPSPEED_DEFAULTS,
    Candidate,
    ModelInfo,
    Plan,
    device_of,
    is_number,
    optimizer_implementation,
    overlap_comm,
    zero_sizes,
)

# Top-level keys DeepSpeed 0.19 reads (its own parser silently ignores anything else).
DEEPSPEED_KEYS = frozenset(
    """
    train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps optimizer scheduler
    fp16 bf16 bfloat16 amp torch_autocast gradient_clipping prescale_gradients gradient_predivide_factor
    sparse_gradients zero_optimization zero_allow_untested_optimizer zero_force_ds_cpu_optimizer
    steps_per_print wall_clock_breakdown memory_breakdown dump_state flops_profiler activation_checkpointing
    sparse_attention data_efficiency curriculum_learning tensorboard wandb csv_monitor comet elasticity aio
    checkpoint data_types communication_data_type seq_parallel_communication_data_type pipeline
    progressive_layer_drop eigenvalue quantize_training compression_training autotuning dataloader_drop_last
    disable_allgather hybrid_engine compile timers weight_quantization tensor_parallel expert_parallel
    use_data_before_expert_parallelism sequence_parallel_size graph_harvesting comms_logger nebula
    gradient_allreduce_op managed_gradient_accumulation disable_python_gc log_level zenflow
    vocabulary_size random_ltd datastates_ckpt
    """.split()
)
# Keys the trainer owns: the experiment is their one source of truth.
OWNED_TOP = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
)

SCHEDULERS = {"cosine": "WarmupCosineLR", "linear": "WarmupDecayLR", "constant": "WarmupLR"}


def load_template(path: str | Path, allow: tuple[str, ...] | list[str] = ()) -> dict[str, Any]:
    """Read a DeepSpeed JSON template; reject syntax errors (with the line) and unknown top-level keys."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise UserError(f"strategy.deepspeed: cannot read template {source}: {e.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(
            f"strategy.deepspeed: {source}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno}); fix the syntax"
        ) from None
    if not isinstance(data, dict):
        raise UserError(f"strategy.deepspeed: {source}: a DeepSpeed config must be a JSON object")
    known = DEEPSPEED_KEYS | set(allow)
    problems = [
        Problem(
            str(k),
            f"unknown top-level DeepSpeed key (DeepSpeed would silently ignore it).{did_you_mean(str(k), known)} "
            "If it is a real key this list does not know yet, add it to strategy.allow_deepspeed_keys",
        )
        for k in data
        if k not in known
    ]
    if problems:
        raise UserError(f"DeepSpeed template {source} has unknown keys", problems, source)
    problems = _zero_value_problems(data.get("zero_optimization"))
    if problems:
        raise UserError(f"DeepSpeed template {source} has values the planner cannot read", problems, source)
    problems = checkpoint_engine_problems(data)
    if problems:
        raise UserError(f"DeepSpeed template {source} asks for a checkpoint engine this project does not use",
                        problems, source)  # fmt: skip
    return data


# DeepSpeed's checkpoint engines other than its torch.save one, and why the project does not use them: every
# save goes through trainer/checkpoint (written to a staging directory, digested as the bytes reach the
# disk, committed atomically; checkpoint.async for background writes), which would silently replace them.
CHECKPOINT_ENGINES = {
    "checkpoint.writer": "DeepSpeed's fast-persist and decoupled writers (libaio, GPU builds) write past the "
    "project's digests and atomic commit; checkpoint.async writes in the background instead",
    "checkpoint.use_node_local_storage": "checkpoints on node-local disks cannot be resumed by another node (the "
    "project refuses a run_dir that is not shared)",
    "datastates_ckpt": "DataStates' engine writes past the project's digests and atomic commit; checkpoint.async "
    "writes in the background instead",
    "nebula": "Azure Nebula's engine writes past the project's digests and atomic commit",
}


def checkpoint_engine_problems(data: Mapping[str, Any]) -> list[Problem]:
    """A template's request for a DeepSpeed checkpoint engine the project would replace, each with the reason.
    torch.save's zip and legacy formats (checkpoint.checkpoint_serialization) are both written and digested."""
    ckpt = data.get("checkpoint") if isinstance(data.get("checkpoint"), Mapping) else {}
    asked = {
        "checkpoint.writer": ckpt.get("writer") not in (None, {}),
        "checkpoint.use_node_local_storage": ckpt.get("use_node_local_storage") is True,
        "datastates_ckpt": isinstance(data.get("datastates_ckpt"), Mapping)
        and data["datastates_ckpt"].get("enabled") is not False,
        "nebula": isinstance(data.get("nebula"), Mapping) and data["nebula"].get("enabled") is True,
    }
    return [Problem(k, f"not used: {CHECKPOINT_ENGINES[k]}; remove it") for k, on in asked.items() if on]


def _zero_value_problems(zero: Any) -> list[Problem]:
    """The zero_optimization values the planner reads to size buffers and choose overlap: a number
    (or "auto"/"measured") for the bucket sizes, a boolean (or "measured") for overlap_comm. Anything
    else would be planned as DeepSpeed's default, or as on, and then refused by DeepSpeed."""
    if not isinstance(zero, dict):
        return []
    problems = []
    for key in DEEPSPEED_DEFAULTS:
        value = zero.get(key)
        if value is not None and value not in ("auto", "measured") and not is_number(value):
            problems.append(Problem(f"zero_optimization.{key}", f"expected a number of elements, \"auto\" or "
                                    f"\"measured\", found {value!r}"))  # fmt: skip
    value = zero.get("overlap_comm")
    if value is not None and value != "measured" and not isinstance(value, bool):
        problems.append(Problem("zero_optimization.overlap_comm",
                                f"expected true, false or \"measured\", found {value!r}"))  # fmt: skip
    return problems


def template_for(exp: Experiment, candidate: Candidate | None = None) -> tuple[str, dict[str, Any]]:
    """(path, template dict) for the experiment: its own template, or the shipped one for the candidate."""
    s = exp.strategy
    if s.deepspeed:
        return s.deepspeed, load_template(s.deepspeed, s.allow_deepspeed_keys)
    if candidate is None:
        return "", {}
    path = TEMPLATES_DIR / candidate.template
    return str(path), load_template(path)


@dataclass
class _Filler:
    """Fills one template: owned values are set, "auto" is replaced, disagreements are collected."""

    source: str
    mismatches: list[Problem] = field(default_factory=list)

    def own(self, d: dict[str, Any], dotted: str, value: Any, *, why: str) -> None:
        keys = dotted.split(".")
        for k in keys[:-1]:
            nxt = d.get(k)
            if nxt == "auto" or nxt is None:
                nxt = {}
                d[k] = nxt
            if not isinstance(nxt, dict):
                self.mismatches.append(Problem(dotted, f"expected a JSON object at '{k}', found {nxt!r}"))
                return
            d = nxt
        k = keys[-1]
        if k not in d or d[k] == "auto":
            d[k] = value
        elif not _same(d[k], value):
            self.mismatches.append(
                Problem(
                    dotted,
                    f"template says {json.dumps(d[k])}, the experiment says {json.dumps(value)} ({why})",
                )
            )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@dataclass(frozen=True)
class Schedule:
    """The peak learning rate and the steps the LR schedule spans, and why, when a resume changes them."""

    lr: float
    horizon: int
    notes: tuple[str, ...] = ()


def schedule(exp: Experiment, world_size: int, saved: Mapping[str, Any] | None = None) -> Schedule:
    """The LR schedule of this run. Fresh: optim.lr scaled by optim.lr_scaling, over
    optim.schedule_steps or train.max_steps. Resumed (`saved`: the checkpoint's DeepSpeed JSON):
    the schedule continues as saved (DeepSpeed's scheduler state is only its step count; the peak
    and the horizon come from the JSON, so without this a resume with another train.max_steps, or
    another split of the same global batch under lr_scaling, would move the lr mid-schedule):
    - the horizon stays the saved one unless optim.schedule_steps asks for another (a re-plan);
    - under lr_scaling the saved peak lr stays while the global batch is the same (world size,
      micro batch and accumulation may change); a new global batch is scaled anew, and said."""
    t, o = exp.train, exp.optim
    lr = scaled_lr(exp, world_size)
    horizon = o.schedule_steps or t.max_steps
    if not saved:
        return Schedule(lr, horizon)
    notes = []
    saved_lr = (saved.get("optimizer") or {}).get("params", {}).get("lr")
    saved_batch = saved.get("train_batch_size")
    batch = t.sequences_per_step(world_size)
    if isinstance(saved_lr, int | float) and not math.isclose(saved_lr, lr, rel_tol=1e-9):
        if saved_batch == batch:
            notes.append(
                f"peak lr stays {saved_lr:.4g} as saved: the global batch is the same ({batch} sequences); "
                f"optim.lr_scaling {o.lr_scaling} depends on the batch, not on how it is split over ranks"
            )
            lr = float(saved_lr)
        else:
            notes.append(
                f"warning: the global batch changed ({saved_batch} -> {batch} sequences): optim.lr_scaling "
                f"{o.lr_scaling} gives peak lr {lr:.4g} instead of {saved_lr:.4g}; the lr jumps at the resume"
            )
    saved_horizon = ((saved.get("scheduler") or {}).get("params") or {}).get("total_num_steps")
    if isinstance(saved_horizon, int) and o.schedule in ("cosine", "linear"):
        if o.schedule_steps is None:
            if saved_horizon != horizon:
                notes.append(
                    f"train.max_steps is {t.max_steps}; the LR schedule keeps its horizon of {saved_horizon} steps "
                    "(set optim.schedule_steps to re-plan it)"
                    + (
                        f"; warning: the linear schedule reaches lr 0 at step {saved_horizon}"
                        if o.schedule == "linear" and t.max_steps > saved_horizon
                        else ""
                    )
                )
            horizon = saved_horizon
        elif saved_horizon != horizon:
            notes.append(
                f"LR schedule re-planned (optim.schedule_steps): horizon {saved_horizon} -> {horizon} steps"
            )
    return Schedule(lr, horizon, tuple(notes))


def scaled_lr(exp: Experiment, world_size: int) -> float:
    """optim.lr scaled by optim.lr_scaling for world_size x grad_accum (lr is given for one rank)."""
    k = world_size * exp.train.grad_accum
    factor = {"none": 1.0, "linear": float(k), "sqrt": math.sqrt(k)}[exp.optim.lr_scaling]
    return exp.optim.lr * factor


def ds_config(
    exp: Experiment,
    plan_: Plan,
    info: ModelInfo,
    template: Mapping[str, Any],
    template_path: str = "",
    sched: Schedule | None = None,
) -> dict[str, Any]:
    """The exact dict for `deepspeed.initialize`. Raises UserError listing every template mismatch.
    `sched`: the LR schedule (default: a fresh start's, see `schedule`)."""
    d = json.loads(json.dumps(template))  # deep copy
    f = _Filler(template_path)
    sched = sched or schedule(exp, plan_.dp_world)
    _batch_and_precision(f, d, exp, plan_)
    _optimizer(f, d, exp, plan_, sched)
    _scheduler(f, d, exp, sched)
    _zero(f, d, exp, plan_, info)
    for path in sorted(autos(d)):
        f.mismatches.append(
            Problem(path, '"auto" here is not a value the trainer fills; write the value you want')
        )
    if f.mismatches:
        raise UserError(
            f"DeepSpeed template {template_path or '(built in)'} disagrees with the experiment; the experiment is "
            'the one source of truth for these values: change the template to "auto" (or the same value), or '
            "change the experiment",
            f.mismatches,
            template_path or None,
        )
    return d


def _batch_and_precision(f: _Filler, d: dict[str, Any], exp: Experiment, plan_: Plan) -> None:
    t, world = exp.train, plan_.dp_world
    why_batch = f"micro {t.micro_batch_size} x world {world} x grad_accum {t.grad_accum}"
    if plan_.levers.mp > 1:  # DeepSpeed counts the batch over the data-parallel ranks: world / sp or tp
        why_batch = f"micro {t.micro_batch_size} x data-parallel world {world} x grad_accum {t.grad_accum}"
    if plan_.sp > 1 or "sequence_parallel_size" in d:
        f.own(d, "sequence_parallel_size", plan_.sp, why="strategy.sequence_parallel / the plan")
    _axes(f, d, plan_)
    f.own(d, "train_micro_batch_size_per_gpu", t.micro_batch_size, why="train.micro_batch_size")
    f.own(d, "gradient_accumulation_steps", t.grad_accum, why="train.grad_accum")
    f.own(d, "train_batch_size", t.sequences_per_step(world), why=why_batch)
    f.own(d, "gradient_clipping", t.grad_clip, why="train.grad_clip")
    if "managed_gradient_accumulation" in d:
        # The loop calls the engine's backward and step at every micro batch and relies on DeepSpeed to
        # apply the update only at the accumulation boundary; false would update at every micro batch.
        f.own(d, "managed_gradient_accumulation", True, why=f"train.grad_accum {t.grad_accum}: DeepSpeed "
              "counts the micro batches of bin/train's loop")  # fmt: skip
    precision = plan_.precision
    why = f"train.precision resolves to {precision}"
    f.own(d, "bf16.enabled", precision == "bf16", why=why)
    if precision == "fp16" or "fp16" in d:
        f.own(d, "fp16.enabled", precision == "fp16", why=why)
    if "bfloat16" in d:  # old alias of bf16
        f.own(d, "bfloat16.enabled", precision == "bf16", why=why)


def _axes(f: _Filler, d: dict[str, Any], plan_: Plan) -> None:
    """AutoTP's and AutoEP's sections: the plan's degrees (a template's must agree; DeepSpeed's defaults, autotp_size
    0 and enabled false, say off). In stages (3D) each tensor-parallel rank sends whole activations: DeepSpeed's
    partitioned sends fail on micro batches of different widths (gloo: "invalid tensor size", measured)."""
    tp, why = d.get("tensor_parallel"), "strategy.tensor_parallel / the plan"
    off = plan_.tp == 1 and isinstance(tp, dict) and tp.get("autotp_size") == 0
    if (plan_.tp > 1 or "tensor_parallel" in d) and not off:
        f.own(d, "tensor_parallel.autotp_size", plan_.tp, why=why)
    for key in ("pipe_partitioned", "grad_partitioned") if plan_.tp > 1 and plan_.pp > 1 else ():
        f.own(d, f"pipeline.{key}", False, why=why)
    ep = d.get("expert_parallel")
    on = isinstance(ep, dict) and ep.get("enabled") is True  # DeepSpeed's default: off
    if plan_.ep > 1 or on:
        f.own(d, "expert_parallel.enabled", plan_.ep > 1, why="strategy.expert_parallel / the plan")
        if plan_.ep > 1 or "autoep_size" in ep:
            f.own(d, "expert_parallel.autoep_size", plan_.ep, why="strategy.expert_parallel / the plan")


def _optimizer(f: _Filler, d: dict[str, Any], exp: Experiment, plan_: Plan, sched: Schedule) -> None:
    o = exp.optim
    opt = OPTIMIZERS[o.name]
    f.own(d, "optimizer.type", opt.deepspeed_type, why="optim.name")
    for key, value in opt.params(o, sched.lr).items():
        f.own(
            d,
            f"optimizer.params.{key}",
            value,
            why="optim.lr x lr_scaling" if key == "lr" else f"optim.{key}",
        )
    if not opt.zero_tested and plan_.candidate.stage > 0:
        f.own(
            d,
            "zero_allow_untested_optimizer",
            True,
            why=f"optim.name {o.name} is not one DeepSpeed tested with ZeRO",
        )
    if opt.adam:
        impl = optimizer_implementation(o.implementation, plan_.device_type, plan_.candidate.offload)
        f.own(
            d, "optimizer.params.torch_adam", impl == "torch", why=f"optim.implementation resolves to {impl}"
        )
        fused = d["optimizer"]["params"].get("fused", "auto")  # a template may say false
        if impl == "torch" and fused == "auto":
            # torch's fused kernel (torch >= 2.4 on CPU): one pass per tensor instead of the default
            # per-tensor loop of ~10 ops, e.g. 0.4 instead of 5.5 ms a step on tiny's flat ZeRO
            # partition; the Hugging Face Trainer's default optimizer (adamw_torch_fused) is the same
            f.own(d, "optimizer.params.fused", True, why="torch's fused AdamW kernel")


def _scheduler(f: _Filler, d: dict[str, Any], exp: Experiment, sched: Schedule) -> None:
    o = exp.optim
    kind = SCHEDULERS[o.schedule]
    # DeepSpeed warms up over at least 2 iterations whatever the JSON says. With a warmup of 0 or 1
    # step its log-shaped warmup gives 0 then the peak at those two (1 step: 0, then the peak, as the
    # Hugging Face Trainer); without a warmup they start at the peak (step 1 at the full LR), except
    # for WarmupDecayLR, whose warmup_min_lr is also the floor of its decay: 0, then the peak.
    warm = max(2, o.warmup_steps)
    start = 1.0 if o.warmup_steps == 0 and kind != "WarmupDecayLR" else 0.0
    why_start = "optim.warmup_steps 0: the peak from step 1" if start else "warmup starts at 0"
    horizon = "train.max_steps / optim.schedule_steps"
    f.own(d, "scheduler.type", kind, why="optim.schedule")
    f.own(d, "scheduler.params.warmup_num_steps", warm, why="optim.warmup_steps (DeepSpeed's least: 2)")
    shape = "linear" if o.warmup_steps >= 2 else "log"
    f.own(
        d,
        "scheduler.params.warmup_type",
        shape,
        why="linear warmup (log over DeepSpeed's 2: 0, then the peak)",
    )
    if kind == "WarmupCosineLR":
        f.own(d, "scheduler.params.total_num_steps", sched.horizon, why=horizon)
        f.own(d, "scheduler.params.warmup_min_ratio", start, why=why_start)
        f.own(d, "scheduler.params.cos_min_ratio", o.min_lr_ratio, why="optim.min_lr_ratio")
        return
    if kind == "WarmupDecayLR":
        f.own(d, "scheduler.params.total_num_steps", sched.horizon, why=horizon)
    f.own(d, "scheduler.params.warmup_min_lr", start * sched.lr, why=why_start)
    f.own(d, "scheduler.params.warmup_max_lr", sched.lr, why="optim.lr x lr_scaling")


def _zero(f: _Filler, d: dict[str, Any], exp: Experiment, plan_: Plan, info: ModelInfo) -> None:
    c = plan_.candidate
    f.own(d, "zero_optimization.stage", c.stage, why="strategy.zero_stage / the plan")
    zero = d["zero_optimization"]
    if c.offload == "none":
        for k in ("offload_optimizer", "offload_param"):
            dev = device_of(zero.get(k))
            if dev not in (None, "none"):
                f.mismatches.append(
                    Problem(
                        f"zero_optimization.{k}.device",
                        f"template offloads to {dev}, the experiment says offload none",
                    )
                )
    else:
        dev = device_of(zero.get("offload_param"))
        if c.stage == 3 and not c.offload_params and dev not in (None, "none"):
            f.mismatches.append(Problem("zero_optimization.offload_param.device", f"template offloads the "
                                        f"parameters to {dev}, the plan the optimizer only (strategy.offload_params)"))  # fmt: skip
        parts = ["offload_optimizer"] + (["offload_param"] if c.stage == 3 and c.offload_params else [])
        for part in parts:
            f.own(d, f"zero_optimization.{part}.device", c.offload, why="strategy.offload")
            if c.offload == "nvme":
                f.own(
                    d, f"zero_optimization.{part}.nvme_path", exp.strategy.nvme_path, why="strategy.nvme_path"
                )
    # Model-dependent sizes: "measured" (this project's templates: the rule measured in BENCHMARKS.md)
    # and "auto" (a Hugging Face-style template: that integration's rule).
    for key, value in zero_sizes(info, zero).items():
        if zero.get(key) in ("auto", "measured"):
            zero[key] = value
    if plan_.sp > 1 and c.stage == 3:  # the engine's gradient scale assumes the reduce-scatter path
        f.own(
            d,
            "zero_optimization.reduce_scatter",
            True,
            why="sequence parallelism at stage 3 (trainer/engine.py)",
        )
    if zero.get("overlap_comm") == "measured":
        zero["overlap_comm"] = overlap_comm(zero, plan_.device_type == "cuda")


def autos(d: Any, prefix: str = "") -> list[str]:
    """Dotted paths in `d` still set to "auto" (or "measured")."""
    if isinstance(d, dict):
        return [p for k, v in d.items() for p in autos(v, f"{prefix}{k}.")]
    return [prefix[:-1]] if d in ("auto", "measured") else []
