"""Before the process group exists: the model's facts on the meta device, the memory and time plan, the
exact DeepSpeed JSON (`make_plan` -> `Planned`), and the experiment with the plan's choices written in
(`resolved_experiment`); also what `--plan` prints (trainer/run/commands.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer.config import Experiment


@dataclass
class Planned:
    """The decision made before the process group exists: plan, DeepSpeed JSON, model facts."""

    plan: Any  # strategy.Plan
    ds_config: dict[str, Any]
    info: Any  # strategy.ModelInfo
    template_path: str
    schedule: Any = None  # strategy.Schedule: its notes say how a resume changed the LR schedule
    model: Any = None  # config.ModelSection with model.attn_implementation's auto decided for this run
    exp: Any = None  # the experiment with train.micro_batch_size and grad_accum decided (strategy/batch.py)
    batch: Any = None  # strategy.batch.Batch: how the global batch is split and why (None: as written)


def make_plan(
    exp: Experiment,
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
    from trainer import model, strategy
    from trainer.cluster import devices

    precision = strategy.resolve_precision(exp.train.precision, device_type, source=source)
    section = model.resolved(
        exp.model, seq_len=exp.data.seq_len, precision=precision, device_type=device_type
    )
    info = model.info(section, vocab_size, eos_id, cache_dir=exp.data.cache_dir)
    mem = exp.strategy.device_memory or device_memory
    host = exp.strategy.host_memory or (devices.host_memory() if this_machine else None)
    if mem is None:  # CPU training: the ranks of a node share its memory
        mem = devices.host_memory() // max(1, gpus_per_node)
    template_path, template = strategy.template_for(exp)
    gpu = devices.device_name() if this_machine and device_type == "cuda" else None  # hardware.gpu: auto

    def plan_for(e: Experiment) -> Any:
        return strategy.plan(
            e, info, world_size=world_size, gpus_per_node=gpus_per_node, device_type=device_type,
            device_memory=mem, host_memory=host, precision=precision, template=template or None, force=force,
            device_name=gpu,
        )  # fmt: skip

    from trainer.strategy.batch import resolve

    exp, batch = resolve(exp, world_size, plan_for)  # train.global_batch_size, micro_batch_size: auto
    plan = plan_for(exp)
    if not template:
        template_path, template = strategy.template_for(exp, plan.candidate)
    sched = strategy.schedule(exp, plan.dp_world, saved_ds_config)
    ds = strategy.ds_config(exp, plan, info, template, template_path, sched)
    return Planned(
        plan=plan, ds_config=ds, info=info, template_path=template_path, schedule=sched,
        model=with_levers(section, plan.levers), exp=exp, batch=batch,
    )  # fmt: skip


def with_levers(section: Any, levers: Any) -> Any:
    """The model section as this run builds it: the activation levers the plan chose (auto decided),
    and sdpa where sequence parallelism needs it and auto would have picked eager or varlen (Ulysses
    calls its own attention over the gathered heads)."""
    update = {"activation_checkpointing": levers.checkpointing, "tiled_mlp": levers.tiled_mlp,
              "offload_activations": levers.offload, "chunked_loss": levers.chunked_loss}  # fmt: skip
    if levers.sp > 1 and section.attn_implementation in ("eager", "varlen"):
        update["attn_implementation"] = "sdpa"
    return section.model_copy(update=update)


def resolved_experiment(exp: Experiment, planned: Planned) -> Experiment:
    """The experiment with `auto` decided where the plan decides it: the activation levers as this run
    builds them and the sequence-parallel degree (the ZeRO stage and offload: in the DeepSpeed JSON)."""
    levers = ("activation_checkpointing", "tiled_mlp", "offload_activations", "chunked_loss")
    return exp.model_copy(update={
        "model": exp.model.model_copy(update={k: getattr(planned.model, k) for k in levers}),
        "strategy": exp.strategy.model_copy(update={"sequence_parallel": planned.plan.sp}),
    })  # fmt: skip


def vocab_for_planning(exp: Experiment) -> tuple[int | None, int | None]:
    """The vocabulary size the model will get: given in model.config, else the tokenizer's."""
    if exp.model.config is not None and isinstance(exp.model.config.get("vocab_size"), int):
        return exp.model.config["vocab_size"], None
    if exp.model.config is None:
        return None, None
    from trainer.data import tokenizer_shape

    return tokenizer_shape(exp.data.tokenizer, exp.data.cache_dir)
