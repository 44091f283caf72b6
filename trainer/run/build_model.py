"""The model and the engine around it (trainer/run/build.py's `build` calls `model_and_engine`): the
packing check for the model family, the model with the plan's activation levers put in (Ulysses
attention, tiled MLPs: trainer/model/sequence.py), then DeepSpeed's engine."""

from __future__ import annotations

import logging
from typing import Any

from trainer.common.errors import UserError
from trainer.config import Experiment

log = logging.getLogger("trainer")


def model_and_engine(exp: Experiment, env: Any, planned: Any, data: Any) -> tuple[Any, Any]:
    """The model (identical initial weights on every rank; at ZeRO-3 never whole on one) and the
    DeepSpeed engine around it; then the RNG per rank (dropout differs between ranks)."""
    from trainer import model, objectives
    from trainer.checkpoint.reshard import names_and_aliases
    from trainer.cluster import dist
    from trainer.engine import Engine

    if data.supervised and exp.data.packing and not data.pairs:
        data.packing = packing_verdict(exp, planned.model or exp.model, data)
    teacher = distill_check(exp, env, planned, data)  # (its vocabulary or its store, before any weight loads)
    dist.seed_all(exp.seed)
    built = dict(planned.ds_config)
    # zero.Init (stage 3) reads the batch over the world, before AutoTP's mesh exists: DeepSpeed derives it there
    if planned.plan.tp > 1:
        built.pop("train_batch_size", None)
    module = model.build(
        planned.model or exp.model,
        vocab_size=data.vocab_size,
        eos_id=data.eos_id,
        seq_len=exp.data.seq_len,
        ds_config=built,
    )
    if exp.train.objective != "sft" and getattr(
        module.config.get_text_config(), "output_router_logits", False
    ):
        raise UserError(
            f"train.objective: {exp.train.objective} computes each response's log-probability without labels, so the "
            "router's auxiliary loss that output_router_logits asks for would never be added; set "
            "model.config.output_router_logits: false (the router trains on the objective alone) or train sft"
        )
    teach = (
        distill_attach(exp, env, planned, built, module, *teacher)
        if exp.train.objective == "distill"
        else None
    )
    no_dropout = exp.train.distill if exp.train.objective == "distill" else exp.train.preference
    if exp.train.objective != "sft" and no_dropout.disable_dropout:
        model.disable_dropout(module)  # the reference's log-probs are computed without it (eval mode)
    lora = (planned.model or exp.model).lora
    if lora is not None and lora.quantization in ("4bit", "8bit"):
        from trainer.model.quantized import check_built

        for line in check_built(module, lora, planned.info.quantized):
            if env.rank == 0:
                (log.warning if line.startswith("warning") else log.info)(line)
    if planned.plan.pp > 1:  # the model as stages: this rank keeps its own (trainer/model/stages.py)
        module = pipeline_stages(exp, planned, module, env)
    groups = model.param_groups(module, exp.optim.weight_decay)
    if planned.plan.ep > 1:  # DeepSpeed splits each group into its experts' and the rest by the group's name
        for group, name in zip(groups, ("decay", "no_decay"), strict=False):
            group["name"] = name
    layout = names_and_aliases(module, groups)  # before DeepSpeed wraps the parameters
    section = planned.model or exp.model
    one_row = data.supervised and section.attn_implementation == "flash_attention_2"
    engine = Engine(
        module, planned.ds_config, groups, compile=exp.train.compile, compile_mode=exp.train.compile_mode,
        one_row=one_row, sequence=sequence_levers(exp, env, planned, module, one_row), objective=objectives.make(exp),
        vision=vision_inputs(exp, planned, module, data),
    )  # fmt: skip
    engine.teacher = teach  # (distill: its completions with seq_kd, trainer/objectives/on_policy.py)
    if engine.vision is not None:  # the idle image's hook, after DeepSpeed's own (trainer/model/vision.py)
        engine.vision.install()
    if planned.plan.tp > 1 or planned.plan.ep > 1:  # AutoTP and AutoEP replaced layers: their names now
        layout = names_and_aliases(module, model.param_groups(module, exp.optim.weight_decay))
    dist.seed_all(exp.seed + 1 + env.rank)
    return engine, layout


def distill_check(exp: Experiment, env: Any, planned: Any, data: Any) -> tuple[Any, Any]:
    """Distillation: (its store, None) offline, (None, the teacher's config) otherwise, checked against the student
    before any weight loads (trainer/objectives/teacher_store.py: check_teacher); (None, None) for another
    objective."""
    if exp.train.objective != "distill":
        return None, None
    from trainer import model
    from trainer.objectives.teacher_store import check_teacher

    student = model.hf_config(planned.model or exp.model, data.vocab_size, data.eos_id)
    store, config = check_teacher(exp, student, data)
    if store is not None and env.rank == 0:
        m = store.meta
        log.info(f"teacher: the top-{m['top_k']} of {m['teacher_spec']} at {m['entries']:,} target tokens, read from "
                 f"{store.path} as the batches need them (no teacher in memory)")  # fmt: skip
    return store, config


def distill_attach(exp: Experiment, env: Any, planned: Any, built: dict[str, Any], module: Any, store: Any,
                   config: Any) -> Any:  # fmt: skip
    """The student's divergence to its teacher (trainer/objectives/distill.py): the store's, or the teacher loaded
    here, sharded at ZeRO-3 as the student is (TRL's), else a whole copy a rank (in 4 bits where asked); returns the
    teacher (None offline)."""
    from trainer.objectives import distill

    zero3 = built.get("zero_optimization", {}).get("stage") == 3
    dtype = distill.compute_dtype(planned.plan.precision)
    teach, d = None, exp.train.distill
    if store is None:
        shard = zero3 and d.quantization == "none"  # (4 bits: a whole copy a rank)
        teach = distill.teacher(d.teacher, config, dtype, built if shard else None, d.quantization)
        if shard and env.rank == 0:
            log.info(distill.shard_line(teach))
        if d.quantization == "4bit" and env.rank == 0:
            from trainer.model.quantized import quantized_layers

            log.info(f"teacher: {quantized_layers(teach)} linear layers in 4 bits (NF4, double quantization), a whole "
                     "copy a rank")  # fmt: skip
    distill.attach(module, teach, d, zero3, store)
    return teach


def vision_inputs(exp: Experiment, planned: Any, module: Any, data: Any) -> Any:
    """A vision-language model's inputs for the engine (trainer/model/vision.py), None for a text model; refused
    where the data has images and the model or the plan cannot take them."""
    from trainer.model import vision

    model_type = getattr(getattr(module, "config", None), "model_type", None)
    fam = vision.check(model_type, data.images is not None)
    if fam is None:
        return None
    p = planned.plan
    levers = {"strategy.pipeline_stages": p.pp, "strategy.tensor_parallel": p.tp,
              "strategy.sequence_parallel": p.sp, "strategy.expert_parallel": p.ep}  # fmt: skip
    for key, value in levers.items():
        if value > 1:
            raise UserError(
                f"{key}: {value} (the plan's choice or the experiment's) is not verified for {fam.name} here; set "
                f"{key}: 1"
            )
    if exp.train.objective != "sft":
        raise UserError(
            f"train.objective: {exp.train.objective} is not verified for {fam.name} here; train sft"
        )
    if data.images is not None and (planned.model or exp.model).attn_implementation == "flash_attention_2":
        raise UserError(  # (the engine's one row of a micro batch's rows: the images' inputs are a row's each)
            f"model.attn_implementation: flash_attention_2 trains a micro batch's rows as one row, which {fam.name}'s "
            "image inputs (made a row at a time) are not verified with; use sdpa"
        )
    idle = (
        None if data.idle_image is None else {k: torch_of(v) for k, v in data.idle_image.batch([0]).items()}
    )
    seen = data.vision or {}
    return vision.Inputs(module, fam, seen.get("token_types", {}), idle, seen.get("image_token"))


def torch_of(value: Any) -> Any:
    import numpy as np
    import torch

    return torch.from_numpy(np.ascontiguousarray(value))


def pipeline_stages(exp: Experiment, planned: Any, module: Any, env: Any) -> Any:
    """The transformers model as the plan's pipeline stages, cut where the plan cuts them (planning/stages.py)."""
    from trainer.checkpoint.reshard import names_and_aliases
    from trainer.model.stages import pipeline
    from trainer.strategy.planning import stages

    parts = stages.bounds(planned.info, planned.plan.pp, exp.data.seq_len)
    if env.rank == 0:
        log.info(stages.stages_line(planned.info, planned.plan.pp, exp))
    stages_module = pipeline(module, planned.plan.pp, parts, planned.plan.tp)
    stages_module.aliases = names_and_aliases(module, [])[
        1
    ]  # the model's tied names (lm_head.weight: the embedding)
    return stages_module


def sequence_levers(exp: Experiment, env: Any, planned: Any, module: Any, one_row: bool) -> dict[str, Any]:
    """The activation levers the plan chose, put into the model (trainer/model/sequence.py) before
    DeepSpeed wraps it: Ulysses attention for sequence parallelism (its mpu for deepspeed.initialize),
    tiled MLPs; and what the engine needs: this rank's place in its sequence group, the host copies."""
    from trainer.cluster.devices import gpu_present
    from trainer.model import sequence

    sp, section, micro, seq = (
        planned.plan.sp,
        planned.model or exp.model,
        exp.train.micro_batch_size,
        exp.data.seq_len,
    )
    rows, tokens = (1, micro * seq) if one_row else (micro, seq)  # flash_attention_2: the rows as one
    mpu = None
    if sp > 1:
        cfg = getattr(module, "config", None)
        problem = (
            sequence.ulysses_verdict(cfg, cfg._attn_implementation, exp.data.cache_dir)
            if cfg
            else "no config"
        )
        if problem:
            raise UserError(
                f"strategy.sequence_parallel: {sp} (the plan's choice or the experiment's) cannot run model type "
                f"'{getattr(cfg, 'model_type', None)}': {problem}; set strategy.sequence_parallel: 1"
            )
        mpu = sequence.register_ulysses(module, sp, rows, tokens)
    if section.tiled_mlp is True:
        sequence.tile_mlps(module, tokens // sp)
    if planned.plan.ep > 1:
        from trainer.common.deepspeed_patches import string_keys_in_output_registry

        string_keys_in_output_registry()  # AutoEP's router recorders with transformers 5.24
    if planned.plan.tp > 1 and planned.plan.pp == 1:  # (in stages: the pipeline's grid, model/stages.py)
        # AutoTP's groups: consecutive ranks form a tensor-parallel group (DeepSpeed's (data, tensor) mesh), whose
        # ranks read the same rows (build.py's data_for_rank); DeepSpeed counts the batch over the data-parallel ones
        from deepspeed.utils import groups

        groups._init_tp_mesh_device(tensor_model_parallel_size=planned.plan.tp)
        mpu = groups
    return {"sp": (sp, env.rank % sp, mpu), "offload": (section.offload_activations is True, gpu_present())}


def packing_verdict(exp: Experiment, section: Any, data: Any) -> str:
    """data.packing: whether packed examples train as their examples one by one for this model family
    (`section`: the model section, attention resolved; trainer/model/packing.py: checked here once per
    family and kernel, cached); refused with the measured difference where they do not."""
    from trainer import model
    from trainer.model.packing import verdict

    why = (
        "packed examples (fine-tuning, or data.separate_documents) are kept apart by restarting position ids"
    )
    if section.factory is not None:
        raise UserError(
            f"data.packing: {why}, which cannot be checked for a factory's model; set data.packing: false "
            "(one example per sequence)"
        )
    from trainer.model.vision import family

    cfg = model.hf_config(section, data.vocab_size, data.eos_id)
    fam = family(cfg.model_type)
    if fam is not None and (
        fam.mrope or data.images is not None
    ):  # checked with images, through the engine's inputs
        from trainer.model.vision_packing import verdict as vision_verdict

        v = vision_verdict(cfg, section.attn_implementation, exp.data.cache_dir)
    else:
        v = verdict(cfg, section.attn_implementation, exp.data.cache_dir)
    if not v["packs"]:
        raise UserError(
            f"data.packing: {why}; checked here: {v['why']}; set data.packing: false (one example per sequence)"
        )
    return v["why"]
