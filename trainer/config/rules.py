"""Rules between fields of an experiment: contradictions (each names the key to change and how)
and legal but probably unintended settings (`warnings`, logged at start). A rule is a function
decorated with `@contradiction` that returns (key, message) pairs."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from trainer.common.errors import Problem
from trainer.config.data_schema import MAP_KEYS, ROLES
from trainer.config.rl_schema import static_generation
from trainer.config.schema import TEMPLATES_DIR, Experiment, chunked_loss_problem


def _positions(config: Mapping[str, Any]) -> tuple[str, int] | None:
    for key in ("n_positions", "max_position_embeddings", "n_ctx", "max_seq_len", "seq_length"):
        if isinstance(config.get(key), int):
            return key, config[key]
    return None


Rule = Callable[[Experiment], list[tuple[str, str]]]
CONTRADICTIONS: list[Rule] = []


def contradiction(fn: Rule) -> Rule:
    """Register a rule between fields (run by `contradictions`, after each section validated)."""
    CONTRADICTIONS.append(fn)
    return fn


def contradictions(exp: Experiment, lines: dict[tuple, int | str] | None = None) -> list[Problem]:
    """Problems that involve more than one field; each names the key to change."""
    lines = lines or {}
    out = []
    for fn in CONTRADICTIONS:
        try:
            found = fn(exp)
        except AttributeError:  # a section this check needs did not validate
            continue
        for key, msg in found:
            out.append(Problem(key, msg, line_for(tuple(key.split(".")), lines)))
    return out


@contradiction
def _compile_mode(exp: Experiment) -> list[tuple[str, str]]:
    t = exp.train
    if t.compile_mode != "default" and not t.compile:
        return [("train.compile_mode", f"{t.compile_mode} is a mode of torch.compile, which is off; set "
                 "train.compile: true, or remove train.compile_mode")]  # fmt: skip
    if t.compile and exp.model.kernels == "liger":
        # measured on an H100 (BENCHMARKS.md, 2026-11-25): torch 2.11's Triton-kernel wrapper cannot
        # analyse Liger 0.8.5's kernels ("assuming every input is mutated") and the loss of the Llama 1B
        # went non-finite at step 4; Liger's kernels alone were the faster setting anyway
        return [("train.compile", "torch.compile over Liger-Kernel's Triton kernels (model.kernels: liger) "
                 "trained to a non-finite loss at step 4 on an H100 (BENCHMARKS.md); set train.compile: "
                 "false (Liger's fused kernels are the faster of the two), or model.kernels: none")]  # fmt: skip
    return []


@contradiction
def _model_source(exp: Experiment) -> list[tuple[str, str]]:
    m = exp.model
    given = [k for k in ("config", "pretrained", "factory") if getattr(m, k) is not None]
    if len(given) != 1:
        what = "none of them" if not given else " and ".join(given)
        return [("model", f"give exactly one of model.config, model.pretrained, model.factory; found {what}")]
    out = []
    if m.config is not None and not isinstance(m.config.get("model_type"), str):
        out.append(("model.config.model_type", "required: the transformers model type, e.g. gpt2 or llama"))
    if m.factory is not None and not re.match(r"^[\w.]+:[\w.]+$", m.factory):
        out.append(("model.factory", f"'{m.factory}' must look like package.module:function"))
    if m.chunked_loss is True and m.factory is not None:
        out.append(("model.chunked_loss", "a factory's model computes its own loss; set it to false"))
    if m.kernels != "none" and m.factory is not None:
        out.append(
            ("model.kernels", "fused kernels go into transformers models, not a factory's; set it to none")
        )
    if m.lora is not None and m.lora.quantization in ("4bit", "8bit") and m.pretrained is None:
        out.append(("model.lora.quantization", f"{m.lora.quantization} quantizes a pretrained model's weights as "
                    "they load: give model.pretrained (a random initialisation quantized would train nothing real)"))  # fmt: skip
    if m.chunked_loss is True and m.config is not None and isinstance(m.config.get("model_type"), str):
        problem = chunked_loss_problem(m.config["model_type"], m.config)
        if problem:
            out.append(("model.chunked_loss", problem))
    if m.config is not None:
        pos = _positions(m.config)
        if pos and exp.data.seq_len > pos[1]:
            out.append(
                (
                    "data.seq_len",
                    f"{exp.data.seq_len} is longer than the model's {pos[0]}={pos[1]}; lower data.seq_len "
                    f"or raise model.config.{pos[0]}",
                )
            )
    return out


@contradiction
def _data_sources(exp: Experiment) -> list[tuple[str, str]]:
    out = []
    if exp.data.mixture and not exp.data.train:
        out.append(("data.train", "the list of sources is empty; give one source or several"))
        return out
    if exp.data.mixture and len({s.kind for _, s in exp.data.sources}) > 1:
        kinds = ", ".join(f"{k}: {s.kind}" for k, s in exp.data.sources)
        out.append(("data.train", f"a mixture's sources must hold the same kind of rows ({kinds})"))
    if exp.data.separate_documents and exp.data.kind != "text":
        out.append(("data.separate_documents", f"applies to kind text (fine-tuning examples are always kept "
                    f"apart); remove it for kind {exp.data.kind}"))  # fmt: skip
    for key, src in [*exp.data.sources, ("data.eval", exp.data.eval)]:
        if src is None:
            continue
        out += _formatting(key, src)
        n = (src.files is not None) + (src.hub is not None)
        if n != 1:
            out.append((key, "give exactly one of files (local globs) or hub (a dataset id)"))
        elif src.files is not None and not src.files:
            out.append((f"{key}.files", "the list of file globs is empty"))
    if (
        exp.data.eval is not None
        and "eval_fraction" in exp.data.model_fields_set
        and exp.data.eval_fraction > 0
    ):
        out.append(
            ("data.eval_fraction", "data.eval is given, so no training data is held out; remove one of them")
        )
    return out


def _formatting(key: str, src: Any) -> list[tuple[str, str]]:
    """A source's formatting and format_map: for kind chat, with the keys its preset takes."""
    out = []
    if src.formatting is not None and src.kind != "chat":
        out.append((f"{key}.formatting", f"{src.formatting} gives conversations: set {key}.kind: chat"))
    if src.format_map and src.kind != "chat":
        out.append((f"{key}.format_map", f"renames the keys of chat data; {key}.kind is {src.kind}"))
        return out
    allowed = MAP_KEYS[src.formatting or "openai"]
    for k, v in src.format_map.items():
        if k not in allowed:
            out.append((f"{key}.format_map.{k}", f"not a key of formatting {src.formatting or 'openai'} "
                        f"(it takes {', '.join(allowed)})"))  # fmt: skip
        elif k == "roles":
            if not isinstance(v, Mapping):
                out.append((f"{key}.format_map.roles", "give a mapping from the data's roles to "
                            f"{', '.join(ROLES)}"))  # fmt: skip
                continue
            for name, role in v.items():
                if role not in ROLES:
                    out.append(
                        (f"{key}.format_map.roles.{name}", f"'{role}' is not a role ({', '.join(ROLES)})")
                    )
        elif not isinstance(v, str) or not v:
            out.append((f"{key}.format_map.{k}", f"give the name of the key or column, found {v!r}"))
    return out


@contradiction
def _levers(exp: Experiment) -> list[tuple[str, str]]:
    m, s, out = exp.model, exp.strategy, []
    if m.offload_activations is True and m.activation_checkpointing is False:
        out.append(("model.offload_activations", "keeps checkpointed activations on the host: set "
                    "model.activation_checkpointing: true (or auto)"))  # fmt: skip
    if m.factory is not None:
        for key in ("tiled_mlp",):
            if getattr(m, key) is True:
                out.append(
                    (
                        f"model.{key}",
                        "patches a transformers model's MLPs; a factory's model is its own: set false",
                    )
                )
    sp = s.sequence_parallel
    if sp == 0:
        out.append(
            ("strategy.sequence_parallel", "0 ranks cannot hold a sequence: give 1 (off), a degree, or auto")
        )
    elif sp != "auto" and sp > 1:
        if exp.data.seq_len % sp:
            out.append(
                (
                    "strategy.sequence_parallel",
                    f"{sp} does not divide data.seq_len {exp.data.seq_len}: give a "
                    "degree that divides it, or 1 (off), or auto",
                )
            )
        if m.attn_implementation == "eager":
            out.append(("strategy.sequence_parallel", "needs sdpa or flash attention (DeepSpeed's Ulysses refuses "
                        "eager attention, whose score matrix it cannot split): set model.attn_implementation: sdpa"))  # fmt: skip
        if m.factory is not None:
            out.append(("strategy.sequence_parallel", "splits a transformers model's attention; a factory's model "
                        "is its own: set 1"))  # fmt: skip
    return out


@contradiction
def _chat_settings(exp: Experiment) -> list[tuple[str, str]]:
    d, out = exp.data, []
    if d.kind == "text":
        for name in ("chat_template", "multi_turn", "chat_template_kwargs"):
            if name in d.model_fields_set and getattr(d, name) not in (None, "auto", {}):
                out.append((f"data.{name}", "applies to chat data (kind chat, or prompt_completion of "
                            "messages); data.train.kind is text"))  # fmt: skip
    if d.group_by_length and (d.packing or d.kind == "text"):
        out.append(("data.group_by_length", "orders examples padded one to a sequence: it needs a fine-tuning "
                    "kind and data.packing: false"))  # fmt: skip
    return out


@contradiction
def _images(exp: Experiment) -> list[tuple[str, str]]:
    """Images in chat data and a vision-language model's parts (docs/fine-tuning.md#images)."""
    d, m, out = exp.data, exp.model, []
    if d.image_min_pixels and d.image_max_pixels and d.image_min_pixels > d.image_max_pixels:
        out.append(("data.image_min_pixels", f"{d.image_min_pixels} is above data.image_max_pixels "
                    f"({d.image_max_pixels}): no image can be both; lower it or raise the other"))  # fmt: skip
    if (
        m.freeze is not None
        and {"vision_tower", "projector", "language_model"} <= set(m.freeze)
        and m.lora is None
    ):
        out.append(
            ("model.freeze", "every part of the model is frozen: nothing would train; leave a part out")
        )
    if m.freeze is not None and m.lora is not None:
        out.append(("model.freeze", "LoRA trains its adapters only (on the language model), whatever is frozen; "
                    "remove model.freeze, or name what should train in full in model.lora.train_modules"))  # fmt: skip
    return out


@contradiction
def _betas(exp: Experiment) -> list[tuple[str, str]]:
    return [
        (f"optim.betas.{i}", f"{b} must be in [0, 1)")
        for i, b in enumerate(exp.optim.betas)
        if not 0.0 <= b < 1.0
    ]


def warnings(exp: Experiment) -> list[str]:
    """Legal but probably unintended settings, logged at start."""
    out = []
    if exp.optim.warmup_steps >= exp.train.max_steps:
        out.append(
            f"optim.warmup_steps ({exp.optim.warmup_steps}) >= train.max_steps ({exp.train.max_steps}): "
            "the learning rate never reaches its peak"
        )
    c = exp.checkpoint
    if exp.strategy.on_oom == "escalate" and not (c.every_steps or c.every_minutes):
        out.append(
            "strategy.on_oom is escalate but no checkpoint cadence is set (checkpoint.every_steps / every_minutes): "
            "an escalated attempt would start from scratch"
        )
    from trainer.config.rl_schema import rl_warnings

    return out + rl_warnings(exp)


def _template_stage(path: str | None) -> Any:
    """zero_optimization.stage of the DeepSpeed template at `path` (None: none, or unreadable: the template's own
    checks say why when it is loaded)."""
    try:
        zero = json.loads(Path(path).read_text()).get("zero_optimization") if path else None
    except (OSError, ValueError, AttributeError):
        return None
    stage = zero.get("stage") if isinstance(zero, dict) else None
    return stage if isinstance(stage, int) and not isinstance(stage, bool) else None


@contradiction
def _strategy(exp: Experiment) -> list[tuple[str, str]]:
    s = exp.strategy
    out = []
    if s.offload in ("cpu", "nvme") and s.zero_stage in (0, 1):
        out.append(
            (
                "strategy.offload",
                f"offload {s.offload} runs at ZeRO stage 2 or 3 (ZeRO-Offload: stage 2 with the optimizer on the "
                f"host), but zero_stage is {s.zero_stage}; set zero_stage to 2, 3 or auto",
            )
        )
    lora = exp.model.lora
    if lora is not None and lora.quantization == "8bit" and (s.zero_stage == 3 or s.offload == "nvme"):
        out.append(("strategy.zero_stage", "8bit base weights cannot be sharded by ZeRO-3: bitsandbytes' "
                    "Linear8bitLt keeps each layer's whole int8 weight in its state after a forward; use "
                    "model.lora.quantization: 4bit, or zero_stage 0-2 (or auto)"))  # fmt: skip
    if static_generation(exp):
        if s.zero_stage == 3:
            out.append(("train.rl.generation_cache", "static needs the weights in place (ZeRO 0-2), but zero_stage "
                        "is 3 (each layer gathered for every forward); set generation_cache: dynamic, or zero_stage "
                        "0-2 (or auto)"))  # fmt: skip
        elif s.zero_stage == "auto" and _template_stage(s.deepspeed) == 3:
            out.append(("train.rl.generation_cache", f"static needs the weights in place (ZeRO 0-2), but "
                        f"strategy.deepspeed ({s.deepspeed}) sets zero_optimization.stage 3; set generation_cache: "
                        "dynamic, or name a stage 0-2 template"))  # fmt: skip
    if s.offload_params != "auto":
        where = "true" if s.offload_params else "false"
        if s.offload == "none" or s.zero_stage in (0, 1, 2):
            out.append(("strategy.offload_params", f"{where} applies to ZeRO stage 3 with offload, but the "
                        f"experiment sets zero_stage {s.zero_stage} and offload {s.offload}; set "
                        "strategy.offload_params: auto, or zero_stage 3 (or auto) and offload cpu (or auto)"))  # fmt: skip
        elif s.offload == "nvme" and s.offload_params is False:
            out.append(("strategy.offload_params", "false with offload nvme: NVMe offload here moves the "
                        "parameters too; set offload_params: auto or true, or offload: cpu"))  # fmt: skip
        elif (stage := _template_stage(s.deepspeed)) in (0, 1, 2):
            out.append(("strategy.offload_params", f"{where} applies to ZeRO stage 3 with offload, but "
                        f"strategy.deepspeed ({s.deepspeed}) sets zero_optimization.stage {stage}; set "
                        "strategy.offload_params: auto, or name a stage 3 template"))  # fmt: skip
    if s.offload == "nvme":
        if s.zero_stage in (0, 1, 2):
            out.append(("strategy.offload", "nvme offload needs zero_stage 3 (or auto)"))
        if not s.nvme_path:
            out.append(("strategy.nvme_path", "offload nvme needs a directory on a fast local disk"))
    if s.deepspeed is not None and not Path(s.deepspeed).is_file():
        shipped = sorted(p.name for p in TEMPLATES_DIR.glob("*.json"))
        out.append(
            (
                "strategy.deepspeed",
                f"template '{s.deepspeed}' does not exist (resolved against {Path.cwd()}); "
                f"shipped templates: {', '.join('configs/deepspeed/' + n for n in shipped)}",
            )
        )
    return out


@contradiction
def _train(exp: Experiment) -> list[tuple[str, str]]:
    out = []
    if exp.train.eval_every and exp.data.eval is None and exp.data.eval_fraction == 0:
        out.append(
            (
                "train.eval_every",
                "evaluation is asked for but there is no eval data: set data.eval or data.eval_fraction > 0, or eval_every: 0",
            )
        )
    t = exp.train
    if t.micro_batch_size == "auto" and t.global_batch_size is None:
        out.append(("train.micro_batch_size", "auto splits a global batch into the largest micro batch that fits "
                    "and accumulation: set train.global_batch_size (sequences an optimizer step, every rank "
                    "together), or give the micro batch"))  # fmt: skip
    return out


@contradiction
def _objective(exp: Experiment) -> list[tuple[str, str]]:
    """Preference data and the preference objectives go together, and with what they are verified with."""
    t, d = exp.train, exp.data
    kinds = {s.kind for _, s in d.sources} | ({d.eval.kind} if d.eval is not None else set())
    if t.objective == "grpo":
        from trainer.config.rl_schema import rl_problems

        return rl_problems(exp)
    if t.objective == "distill":  # (its data: _distill)
        return []
    if "prompt" in kinds:
        return [("data.train.kind", f"prompt data (prompts alone, no responses) trains only by generating: set "
                 f"train.objective: grpo (train.rl), not {t.objective}")]  # fmt: skip
    if "unpaired" in kinds and t.objective != "kto":
        return [("data.train.kind", f"unpaired rows (one response labelled desirable or not) train with "
                 f"train.objective: kto, not {t.objective}")]  # fmt: skip
    if t.objective == "sft":
        if "preference" in kinds:
            return [("train.objective", "sft trains on one response, and the data is of kind preference (chosen "
                     "and rejected pairs); set train.objective: dpo (or ipo, simpo, orpo)")]  # fmt: skip
        return []
    out = []
    if t.objective == "kto" and kinds != {"unpaired"}:
        out.append(("data.train.kind", "train.objective kto trains on unpaired rows; give data of kind unpaired "
                    f"(prompt, completion, label), not {', '.join(sorted(kinds - {'unpaired'}))} (preference pairs "
                    "as kind unpaired are taken apart, as TRL's KTOTrainer does)"))  # fmt: skip
    elif t.objective != "kto" and kinds != {"preference"}:
        out.append(("data.train.kind", f"train.objective {t.objective} trains on pairs; give data of kind "
                    f"preference (prompt, chosen, rejected), not {', '.join(sorted(kinds - {'preference'}))}"))  # fmt: skip
    if d.packing and "packing" in d.model_fields_set:
        out.append(("data.packing", "preference rows are not packed (each response is a row of its own, a "
                    "micro batch padded to its longest); remove data.packing"))  # fmt: skip
    if exp.model.chunked_loss is True:
        out.append(("model.chunked_loss", f"{t.objective} needs each response's log-probability, which the "
                    "tiled loss does not give; set it to auto or false"))  # fmt: skip
    if exp.strategy.sequence_parallel not in ("auto", 1):
        out.append(("strategy.sequence_parallel", f"{t.objective} with sequence parallelism is not verified "
                    "yet; set it to 1 or auto"))  # fmt: skip
    if d.group_by_length and "group_by_length" in d.model_fields_set:
        out.append(("data.group_by_length", "not verified for preference pairs yet; remove it"))
    return out


@contradiction
def _run_dir(exp: Experiment) -> list[tuple[str, str]]:
    """run_dir must be (or become) a directory: no existing file on its path."""
    path = Path(exp.run_dir).expanduser()
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                what = "is a file" if p == path else f"lies under {p}, which is a file"
                return [
                    (
                        "run_dir",
                        f"'{exp.run_dir}' {what}, not a directory; choose another run_dir (--set run_dir=...)",
                    )
                ]
            break
    return []


@contradiction
def _distill(exp: Experiment) -> list[tuple[str, str]]:
    """train.objective distill with its teacher, data and what it is built with (distill_schema.py)."""
    from trainer.config.distill_schema import distill_problems

    return distill_problems(exp)


@contradiction
def _lock_wait(exp: Experiment) -> list[tuple[str, str]]:
    """The other ranks wait for rank 0's lock in a collective, which dist.timeout_s bounds."""
    wait, timeout = exp.checkpoint.lock_wait_s, exp.dist.timeout_s
    if wait is not None and wait >= timeout:
        return [("checkpoint.lock_wait_s", f"{wait:g} s is not below dist.timeout_s ({timeout:g} s): the other ranks "
                 "wait for the run directory in a collective, which would time out first; lower it or raise "
                 "dist.timeout_s")]  # fmt: skip
    return []


def line_for(loc: tuple, lines: dict[tuple, int | str]) -> int | None:
    while loc:
        if loc in lines:
            return lines[loc]
        loc = loc[:-1]
    return None
