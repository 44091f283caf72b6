"""The banner: what a run is, on rank 0, before its first step (where it runs, what it trains, how,
from where), and what a resume brought and changed."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("trainer")

Run = Any  # build.Run (not imported: build does not need the banner)


def _save_mode(run: Run) -> str:
    on, why = run.planned.plan.checkpoint_async(run.exp.checkpoint.async_)
    return f"written in the background, {why}" if on else f"written synchronously ({why})"


def _minutes(run: Run) -> str:
    auto = run.checkpointer.cadence.auto
    return f"{run.exp.checkpoint.every_minutes:g} min" if auto is None else auto.describe()


def slow_bf16(device_type: str, precision: str) -> str:
    """A warning for bf16 on a CPU without native bf16 products (AVX2 only), else empty."""
    if device_type != "cpu" or precision != "bf16":
        return ""
    import torch

    from trainer.model.loss import native_bf16_matmul

    if native_bf16_matmul():
        return ""
    return (
        f"warning: bf16 on a CPU without AVX-512 (ATen's {torch.backends.cpu.get_cpu_capability()} kernels): oneDNN "
        "has no bf16 matrix kernels here, so the model's products run 4-100x slower than fp32's (the tiled loss "
        "runs its own in fp32); train.precision: fp32 (auto on CPU) trains faster on this machine"
    )


def data_lines(run: Run) -> list[str]:
    """The banner's lines on the data: a mixture's sources; fine-tuning's counts, chat template,
    packing, padding and one example with its targets."""
    exp, data, lines = run.exp, run.data, []
    if data.mixture:
        parts = [
            f"{m['source']} (weight {m['weight']:g}, {m['sequences']:,} sequences)" for m in data.mixture
        ]
        lines.append("mixture: " + "; ".join(parts) + "; each epoch takes every source's share by weight")
    from trainer.data.tokenizer import describe_edges

    edges = describe_edges(data.tokenizer)
    if edges and exp.data.kind in ("text", "prompt_completion", "preference"):
        lines.append(
            f"special tokens: {'each document' if exp.data.kind == 'text' else 'each prompt given as text'} "
            f"between the ones the tokenizer adds by default ({edges}), as serving tokenizes it; chat data has "
            "what its template renders"
        )
    if not data.finetune:
        return lines
    if data.finetune.get("kind") == "prompt":
        f = data.finetune
        lines.append(f"prompts: {f['kept']:,} of {f['examples']:,} rows ({f['dropped_too_long']:,} longer than data.seq_len "
                     f"dropped), the longest {f['longest_prompt']} tokens; "
                     + ("chat messages rendered with the template's generation prompt" if f["chat"] else "strings")
                     + ("; every other column goes to the reward functions" if exp.train.objective == "grpo" else
                        "; distill reads the prompt alone (the other columns are not used)"))  # fmt: skip
        return lines
    from trainer.data.examples import describe, describe_template

    lines.append(describe(data.finetune))
    if describe_template(data.finetune):
        lines.append(describe_template(data.finetune))
    if data.packing:
        lines.append(f"packing: {data.packing}")
    shares = run.stream.padding()
    if shares is not None and not exp.data.packing:
        lines.append(f"padding: {shares[0]:.1%} of an epoch's tokens padded to seq_len {exp.data.seq_len}, "
                     f"{shares[1]:.1%} as fed (each micro batch padded to its longest"
                     f"{'; grouped by length' if exp.data.group_by_length else ''})")  # fmt: skip
    if data.finetune.get("example"):
        lines.append(f"example (targets in [[ ]]): {data.finetune['example']}")
    return lines


def announce(run: Run) -> None:
    """What this run is, on rank 0: where it runs, what it trains, how, and from where; and what a
    resume brought and changed."""
    if not run.runtime.is_main:
        return
    from trainer import strategy
    from trainer.checkpoint import checkpoints_dir
    from trainer.common.units import format_size

    exp, runtime, planned, resume = run.exp, run.runtime, run.planned, run.resume
    env, t, plan = runtime.env, exp.train, planned.plan
    est = plan.estimate
    c = exp.checkpoint
    samples = run.samples_per_step
    cadence = ", ".join(
        x
        for x in (
            f"every {c.every_steps} steps" if c.every_steps else "",
            f"every {_minutes(run)}" if c.every_minutes else "",
            "at the end" if c.save_final else "",
        )
        if x
    )
    start = f"resuming from {resume.found.tag}" if resume is not None else "fresh start"
    data = run.data
    lines = [
        f"experiment {exp.name}: run dir {exp.run_dir}",
        f"world: {env.world_size} rank(s) on {env.nodes} node(s) via {env.launcher}; device {runtime.device_type}, "
        f"backend {runtime.backend}, {runtime.threads} CPU thread(s) per rank",
        f"model: {strategy.describe_params(planned.info, exp.model.lora)}; precision {plan.precision}"
        + (f"; {planned.info.attn_implementation} attention" if planned.info.attn_implementation else "")
        + ("; chunked loss" if (planned.model or exp.model).chunked_loss is True else "")
        + (
            f"; torch.compile{'' if t.compile_mode == 'default' else f' ({t.compile_mode})'}"
            if t.compile
            else ""
        ),
        f"strategy: ZeRO stage {plan.candidate.stage}, offload {plan.candidate.offload}"
        + (f", sequence parallel {plan.sp} (data-parallel world {plan.dp_world})" if plan.sp > 1 else "")
        + (f", tensor parallel {plan.tp} (data-parallel world {plan.dp_world})" if plan.tp > 1 else "")
        + (f", expert parallel {plan.ep}" if plan.ep > 1 else "")
        + (f", pipeline stages {plan.pp} (data-parallel world {plan.dp_world})" if plan.pp > 1 else "")
        + f" -- {plan.reason}",
        *(
            [f"layout: {strategy.layout(plan.world_size, plan.sp, plan.tp, plan.ep, plan.pp)}"]
            if plan.levers.mp * plan.ep > 1
            else []
        ),
        *([strategy.stages_line(planned.info, plan.pp, exp)] if plan.pp > 1 else []),
        f"activation levers: {plan.levers.describe()} ({plan.levers_reason})",
        f"memory per rank (estimate): {format_size(est.total)} (params {format_size(est.params)}, grads "
        f"{format_size(est.grads)}, optimizer {format_size(est.optimizer)}, activations {format_size(est.activations)}, "
        f"step {format_size(est.step)})",
        f"batch: micro {t.micro_batch_size} x {'data-parallel ' if plan.levers.mp > 1 else ''}world {plan.dp_world} x "
        f"grad_accum {t.grad_accum} = {samples} "
        f"sequences = {samples * exp.data.seq_len:,} tokens per step"
        + (f" ({planned.batch.why})" if planned.batch is not None and planned.batch.why else ""),
        f"data: {len(data.train):,} train / {len(data.eval) if data.eval is not None else 0:,} eval sequences of "
        f"{data.seq_len} tokens; {run.stream.steps_per_epoch:,} micro steps per epoch",
        f"checkpoints: {checkpoints_dir(exp.run_dir)} ({cadence or 'none'}; keep {c.keep_last or 'all'}; "
        f"{_save_mode(run)}); {start}",
    ]
    lines[-1:-1] = data_lines(run) + run.objective_notes
    for line in lines:
        log.info(line)
    if slow := slow_bf16(runtime.device_type, plan.precision):
        log.warning(slow)
    if resume is None:
        return
    for w in resume.warnings:
        log.warning(f"warning: {w}")
    pos = run.stream.position
    log.info(
        f"resumed from {resume.found.path} at step {run.state.step} (epoch {pos.epoch}, sample {pos.sample} of the epoch)"
    )
    if resume.differences:
        log.info(f"resumed with changed settings: {', '.join(resume.differences)}")
    for note in run.notes:
        (log.warning if note.startswith("warning:") else log.info)(note)
