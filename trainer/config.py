"""Experiment configuration: one YAML file -> a typed, immutable `Experiment`.

The YAML mirrors the tree below one to one: one pydantic model per section, every field
with a one-line description (that is also the config reference: `bin/train --describe-config`).
Precedence is defaults < YAML < `--set section.key=value`, each override converted by the type
of the field it names.

Every problem is collected and reported at once, each naming the file, the line, the key path,
what was found and what is allowed: unknown keys (with a did-you-mean), wrong types,
out-of-range values, then contradictions between fields.
"""

from __future__ import annotations

import os
import re
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
)

from trainer.errors import ConfigError, Problem, UserError, did_you_mean

# ----------------------------------------------------------------------------- field helpers


def choice(*allowed: Any) -> Any:
    """A field that takes exactly one of `allowed` (type-exact: True is not 1)."""
    shown = ", ".join(_show(a) for a in allowed)

    def check(value: Any) -> Any:
        if isinstance(value, str):
            value = value.strip()
            lowered = value.lower()
            for a in allowed:
                if isinstance(a, str) and a == lowered:
                    return a
        for a in allowed:
            if type(value) is type(a) and value == a:
                return a
        raise ValueError(f"must be one of: {shown}")

    check.allowed = shown.replace(", ", "|")  # type: ignore[attr-defined]  (for the reference)
    return Annotated[Any, BeforeValidator(check)]


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(value: Any) -> int | None:
    """'80GB', '80GiB', '512M', 1e9 -> bytes. GB means 2**30 here, as in DeepSpeed's estimators
    and nvidia-smi (an '80GB' H100 reports about 80 GiB)."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    if isinstance(value, float):
        return int(value)
    m = _SIZE.match(str(value))
    if not m:
        raise ValueError("must be a size such as 80GB, 24GiB, 512MB or a number of bytes")
    scale = 1024 ** "_kmgtp".index(m.group(2).lower() or "_")
    return int(float(m.group(1)) * scale)


def format_size(n: float) -> str:
    for unit, scale in (("TB", 2**40), ("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _freeze(value: Any) -> Any:
    """Deeply read-only view of YAML mappings/lists, so the config tree is immutable."""
    if isinstance(value, Mapping):
        return types.MappingProxyType({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """A plain, mutable deep copy of a frozen mapping (to hand to libraries)."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [thaw(v) for v in value]
    return value


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


FrozenMapping = Annotated[Mapping[str, Any], AfterValidator(_freeze), PlainSerializer(lambda v: thaw(v))]
Size = Annotated[int | None, BeforeValidator(parse_size)]
Globs = Annotated[list[str], BeforeValidator(_as_list)]
AutoBool = choice("auto", True, False)


class Section(BaseModel):
    """Base of every section: unknown keys are errors and the tree is immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


# ----------------------------------------------------------------------------- sections


# model.chunked_loss: model types whose logits are plain lm_head(base_model(...)[0]): no logit scale
# (cohere, granite), no soft-capping (gemma2/3), no router loss added to the LM loss (mixtral...).
CHUNKED_LOSS_TYPES = frozenset(
    {
        "gpt2",
        "gpt_neox",
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "phi3",
        "olmo",
        "olmo2",
        "gemma",
        "smollm3",
        "opt",
    }
)


LOSS_CHUNK_BYTES = 1 << 30  # model.chunked_loss: fp32 logits per chunk


def loss_chunk_rows(vocab: int) -> int:
    """model.chunked_loss: rows (tokens) per chunk, LOSS_CHUNK_BYTES of fp32 logits."""
    return max(1, LOSS_CHUNK_BYTES // (4 * vocab))


def chunked_loss_problem(model_type: str | None) -> str | None:
    """Why model.chunked_loss cannot serve this model type (None: it can)."""
    if model_type in CHUNKED_LOSS_TYPES:
        return None
    return (
        f"not available for model_type '{model_type}' (it supports {', '.join(sorted(CHUNKED_LOSS_TYPES))}: "
        "models whose logits are the LM head's output, unscaled and uncapped); set it to false"
    )


class ModelSection(Section):
    """What to train. Exactly one of `config`, `pretrained`, `factory`."""

    config: FrozenMapping | None = Field(
        None,
        description="transformers config for a randomly initialised model: `model_type` plus its "
        "fields (e.g. {model_type: gpt2, n_layer: 4}); vocab_size defaults to the tokenizer's",
    )
    pretrained: str | None = Field(
        None, description="local directory or hub id, loaded with AutoModelForCausalLM.from_pretrained"
    )
    revision: str | None = Field(None, description="hub revision (branch, tag or commit) for `pretrained`")
    factory: str | None = Field(
        None, description="'package.module:function' returning a torch.nn.Module (see README: Models)"
    )
    factory_args: FrozenMapping = Field(
        default_factory=dict, description="keyword arguments passed to `factory`"
    )
    trust_remote_code: bool = Field(False, description="allow model code from the hub (pretrained only)")
    activation_checkpointing: bool = Field(
        False, description="recompute activations in backward (less memory, about 30% more compute)"
    )
    attn_implementation: choice(None, "eager", "sdpa", "flash_attention_2") = Field(
        None, description="attention kernel for transformers models; null keeps the model's default"
    )
    chunked_loss: bool = Field(
        False,
        description="LM head and cross-entropy in chunks, never the whole logits (less memory and memory "
        "traffic; transformers causal LMs with a plain LM head, see README: Models)",
    )


class DataSource(Section):
    """One dataset: local files (globs) or a hub dataset."""

    files: Globs | None = Field(
        None, description="file globs (text, json/jsonl, parquet), relative to the current directory"
    )
    hub: str | None = Field(None, description="hub dataset id, loaded with datasets.load_dataset")
    name: str | None = Field(None, description="hub dataset configuration name")
    split: str = Field("train", description="split to read")
    format: choice("auto", "text", "json", "parquet") = Field(
        "auto", description="file format; auto = from the file extension"
    )
    text_field: str = Field("text", description="column holding the text (json/parquet/hub)")
    sample_by: choice("document", "paragraph", "line") = Field(
        "document", description="for text files: one sample per file, paragraph or line"
    )


class DataSection(Section):
    """Tokenized, packed, per-rank data."""

    train: DataSource = Field(description="training data")
    eval: DataSource | None = Field(None, description="held-out data; default: `eval_fraction` of train")
    eval_fraction: float = Field(
        0.01, ge=0.0, lt=0.5, description="share of training documents held out for eval (0 = none)"
    )
    tokenizer: str = Field(
        "byte", description="'byte' (built in, 256 bytes + EOS, no files), a local path or a hub id"
    )
    seq_len: int = Field(256, ge=8, description="tokens per packed training sequence")
    append_eos: bool = Field(True, description="append the EOS token after every document")
    num_workers: int = Field(4, ge=0, description="DataLoader worker processes per rank")
    pin_memory: bool = Field(True, description="page-locked host batches (used on GPU only)")
    persistent_workers: bool = Field(True, description="keep workers across epochs (when num_workers > 0)")
    num_proc: int | None = Field(None, ge=1, description="tokenizer processes; null = min(8, CPU cores)")
    shuffle: bool = Field(True, description="reshuffle every epoch (seeded; same order for the same seed)")
    cache_dir: str = Field(
        "~/.cache/trainer/data", description="where tokenized, packed data is cached between runs"
    )


class TrainSection(Section):
    """Batch, length and precision of training."""

    micro_batch_size: int = Field(8, ge=1, description="sequences per rank per forward/backward")
    grad_accum: int = Field(1, ge=1, description="micro batches accumulated per optimizer step")
    max_steps: int = Field(description="optimizer steps to train", ge=1)
    precision: choice("auto", "fp32", "bf16", "fp16") = Field(
        "auto", description="auto = bf16 on GPUs that support it, else fp32"
    )
    grad_clip: float = Field(1.0, ge=0.0, description="clip the global gradient norm to this (0 = off)")
    log_every: int = Field(10, ge=1, description="log metrics every N steps")
    eval_every: int = Field(0, ge=0, description="evaluate every N steps (0 = only at the end)")
    eval_batches: int = Field(50, ge=1, description="at most this many micro batches per rank per eval")
    compile: bool = Field(
        False,
        description="torch.compile the model through DeepSpeed's engine.compile() (first steps compile)",
    )


class OptimSection(Section):
    """Optimizer and learning-rate schedule (passed to DeepSpeed, which owns the update)."""

    name: choice("adamw", "adam") = Field("adamw", description="optimizer")
    implementation: choice("auto", "deepspeed", "torch") = Field(
        "auto",
        description="auto = DeepSpeed's fused Adam on GPU / CPUAdam with offload, torch AdamW on CPU (bitwise resume)",
    )
    lr: float = Field(3e-4, gt=0.0, description="peak learning rate (before lr_scaling)")
    lr_scaling: choice("none", "linear", "sqrt") = Field(
        "none", description="scale lr with world size x grad_accum relative to one rank (Goyal et al.)"
    )
    weight_decay: float = Field(0.0, ge=0.0, description="decoupled weight decay (not on biases and norms)")
    betas: tuple[float, float] = Field((0.9, 0.95), description="Adam betas")
    eps: float = Field(1e-8, gt=0.0, description="Adam epsilon")
    warmup_steps: int = Field(0, ge=0, description="linear warmup steps")
    schedule: choice("cosine", "linear", "constant") = Field(
        "cosine", description="decay after warmup (DeepSpeed WarmupCosineLR / WarmupDecayLR / WarmupLR)"
    )
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="cosine: final lr as a share of lr")
    schedule_steps: int | None = Field(
        None,
        ge=1,
        description="steps the LR schedule spans (warmup + decay); null = train.max_steps at the run's first "
        "start, kept on resume so a changed max_steps does not move the lr; set it to re-plan the schedule",
    )


class StrategySection(Section):
    """How the model is spread over ranks: the ZeRO stage and offload (see README: Escalation)."""

    zero_stage: choice("auto", 0, 1, 2, 3) = Field(
        "auto", description="auto = first of 0 -> 2 -> 3 that fits; 1 only when asked for"
    )
    offload: choice("auto", "none", "cpu", "nvme") = Field(
        "auto", description="auto = none unless nothing fits on the device, then cpu, then nvme"
    )
    nvme_path: str | None = Field(None, description="directory for NVMe offload (offload: nvme)")
    justification: str = Field(
        "", description="why a stage/offload above the one the rules pick is pinned (required then)"
    )
    deepspeed: str | None = Field(
        None, description="explicit DeepSpeed JSON template (e.g. configs/deepspeed/zero2.json)"
    )
    allow_deepspeed_keys: list[str] = Field(
        default_factory=list, description="extra top-level DeepSpeed keys to accept in a template"
    )
    on_oom: choice("fail", "escalate") = Field(
        "fail", description="escalate = on out-of-memory, restart from the last checkpoint one rung up"
    )
    device_memory: Size = Field(None, description="memory per device, e.g. 80GB; null = read the GPU")
    host_memory: Size = Field(None, description="host memory per node for offload; null = read it")
    headroom: float = Field(0.9, gt=0.0, le=1.0, description="share of device memory the plan may use")


class DistSection(Section):
    """How ranks talk, and how a job that stops making progress ends (see README: Multi-node)."""

    timeout_s: float = Field(
        600.0, gt=0, description="timeout of every collective (all process groups, DeepSpeed's too)"
    )
    watchdog_s: float = Field(
        1800.0,
        ge=0,
        description="end the job when a rank makes no progress (step, eval, save) this long; 0 = off",
    )
    preflight: bool = Field(
        True, description="check at start: all-reduce works, every rank holds the same weights"
    )
    nan_check: bool = Field(
        True, description="stop every rank at the same step on a NaN/inf loss (before the update)"
    )
    straggler_margin: float = Field(
        0.2, ge=0, description="report a rank whose step time exceeds the median by this share"
    )


class CheckpointSection(Section):
    """When and how checkpoints are written and resumed (see README: Checkpoints)."""

    every_steps: int = Field(0, ge=0, description="save every N steps (0 = off)")
    every_minutes: float = Field(0.0, ge=0.0, description="save every N minutes (0 = off)")
    keep_last: int = Field(3, ge=0, description="keep the newest N complete checkpoints (0 = all)")
    save_final: bool = Field(True, description="save at the end of training")
    save_on_signal: bool = Field(True, description="on SIGTERM/SIGUSR1: finish the step, save, exit")
    signal_exit_code: int = Field(0, ge=0, le=255, description="exit status after a save on a signal")
    resume: choice("never", "auto") = Field(
        "never", description="auto = resume from the latest complete checkpoint if there is one"
    )
    on_data_change: choice("error", "continue") = Field(
        "error",
        description="on resume, when the training data differs from the checkpoint's: error, or continue "
        "at the saved position in the new data (see README: Checkpoints)",
    )
    convert_timeout_minutes: float = Field(
        120.0,
        gt=0,
        description="how long every rank waits for a checkpoint's conversion to another stage or world size",
    )


class WandbSection(Section):
    """Weights & Biases logging, rank 0 only."""

    enabled: AutoBool = Field(
        False,
        description="true, false, or auto (on when wandb is installed and logged in, or WANDB_MODE is set)",
    )
    project: str | None = Field(None, description="project; null = the experiment name")
    entity: str | None = Field(None, description="team or user")
    run_name: str | None = Field(None, description="display name; null = the experiment name")
    tags: list[str] = Field(default_factory=list, description="tags")
    mode: choice("online", "offline") = Field("offline", description="offline writes to the run directory")


class LoggingSection(Section):
    """What rank 0 prints and records."""

    progress: AutoBool = Field("auto", description="progress bar; auto = only when stdout is a terminal")
    level: choice("debug", "info", "warning") = Field("info", description="log level of rank 0")
    peak_tflops: float | None = Field(
        None, gt=0, description="dense bf16 peak of one GPU in TFLOP/s, for MFU; null = from the GPU's name"
    )
    wandb: WandbSection = Field(default_factory=WandbSection, description="Weights & Biases")


class Experiment(Section):
    """One experiment: everything `bin/train` needs."""

    name: str = Field("experiment", pattern=r"^[A-Za-z0-9._-]+$", description="experiment name")
    seed: int = Field(1234, ge=0, description="seed for model init (same on every rank) and data order")
    run_dir: str = Field("", description="metrics and checkpoints go here; default runs/<name>")
    model: ModelSection = Field(description="the model")
    data: DataSection = Field(description="the data")
    train: TrainSection = Field(description="training length, batch and precision")
    optim: OptimSection = Field(default_factory=OptimSection, description="optimizer and LR schedule")
    strategy: StrategySection = Field(default_factory=StrategySection, description="ZeRO stage, offload")
    dist: DistSection = Field(
        default_factory=DistSection, description="timeouts, watchdog, consistency checks"
    )
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection, description="checkpoints")
    logging: LoggingSection = Field(default_factory=LoggingSection, description="logging")

    def to_dict(self) -> dict[str, Any]:
        return thaw(self.model_dump(mode="python"))

    def to_yaml(self) -> str:
        return yaml.safe_dump(_plain(self.to_dict()), sort_keys=False, default_flow_style=False)

    def replace(self, **changes: Any) -> Experiment:
        """A copy with some sections/fields replaced, validated again."""
        data = self.to_dict()
        for dotted, value in changes.items():
            _set_path(data, dotted.split("__"), value)
        return Experiment.model_validate(data)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


SECTIONS = ("model", "data", "train", "optim", "strategy", "dist", "checkpoint", "logging")

# ----------------------------------------------------------------------------- loading


def load(path: str | os.PathLike, overrides: typing.Sequence[str] = ()) -> Experiment:
    """Read, override and validate an experiment file; raise ConfigError with every problem."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise UserError(
            f"experiment file {source} does not exist (looked in {Path(path).resolve().parent}); "
            "pass the path of a YAML file, e.g. configs/experiments/tiny.yaml"
        ) from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read experiment file {source}: {e}") from None
    raw, lines = parse_yaml(text, source)
    problems = list(lines.pop(DUPLICATES, []))  # type: ignore[arg-type]
    for override in overrides:
        problems += apply_override(raw, override, lines)
    return validate(raw, source=source, lines=lines, problems=problems)


DUPLICATES = ("<duplicates>",)


def parse_yaml(text: str, source: str) -> tuple[dict[str, Any], dict[tuple, int | str]]:
    """YAML -> (dict, line of every key path). Syntax errors and duplicate keys carry the line."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        what = getattr(e, "problem", None) or str(e)
        context = getattr(e, "context", None)
        msg = f"invalid YAML: {what}" + (f" ({context})" if context else "")
        raise ConfigError(source, [Problem("", msg + "; fix the syntax at this line", line)]) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(
            source, [Problem("", "the file must be a YAML mapping of sections (model:, data:, ...)", 1)]
        )
    lines: dict[tuple, int | str] = {}
    dups: list[Problem] = []
    _walk_lines(node, (), lines, dups)
    if dups:
        lines[DUPLICATES] = dups  # type: ignore[assignment]  (reported with the other problems)
    return raw, lines


def _walk_lines(
    node: yaml.Node | None, path: tuple, lines: dict[tuple, int | str], dups: list[Problem]
) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: set[Any] = set()
        for key_node, value_node in node.value:
            key = key_node.value
            child = (*path, key)
            if key in seen:
                dups.append(
                    Problem(
                        ".".join(map(str, child)), "duplicate key; keep one", key_node.start_mark.line + 1
                    )
                )
            seen.add(key)
            lines[child] = key_node.start_mark.line + 1
            _walk_lines(value_node, child, lines, dups)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[(*path, i)] = item.start_mark.line + 1
            _walk_lines(item, (*path, i), lines, dups)


def apply_override(
    raw: dict[str, Any], override: str, lines: dict[tuple, int | str] | None = None
) -> list[Problem]:
    """Apply one `--set a.b.c=value`; the value is parsed by the type of the field it names.
    Problems with an overridden key are then reported as coming from --set, not the file."""
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not key:
        return [
            Problem(key, f"--set '{override}': expected KEY=VALUE, e.g. --set train.max_steps=100", "--set")
        ]
    parts = key.split(".")
    annotation: Any = Experiment
    for i, part in enumerate(parts):
        model = _model_of(annotation)
        if model is None:
            if _is_mapping(annotation):  # free-form mapping (model.config): any sub-key goes
                annotation = Any
                continue
            where = ".".join(parts[:i])
            return [
                Problem(key, f"--set: '{where}' is a value, not a section; it has no key '{part}'", "--set")
            ]
        if part not in model.model_fields:
            prefix = ".".join(parts[:i])
            known = ", ".join(model.model_fields)
            return [
                Problem(
                    key,
                    f"--set: no such key '{part}' in {prefix or 'the experiment'}."
                    f"{did_you_mean(part, model.model_fields)} Known keys: {known}",
                    "--set",
                )
            ]
        annotation = model.model_fields[part].annotation
    value: Any
    if _is_str(annotation):
        value = text
    else:
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError:
            value = text
    _set_path(raw, parts, value)
    if lines is not None:
        for path in [p for p in lines if p[: len(parts)] == tuple(parts)]:
            del lines[path]
        lines[tuple(parts)] = "--set"
    return []


def _set_path(data: dict, parts: typing.Sequence[str], value: Any) -> None:
    for part in parts[:-1]:
        nxt = data.get(part)
        if not isinstance(nxt, dict):
            nxt = {}
            data[part] = nxt
        data = nxt
    data[parts[-1]] = value


def _unwrap(annotation: Any) -> list[Any]:
    """The member types of Optional/Union/Annotated annotations."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(annotation) for m in _unwrap(a)]
    return [annotation]


def _model_of(annotation: Any) -> type[BaseModel] | None:
    for member in _unwrap(annotation):
        if isinstance(member, type) and issubclass(member, BaseModel):
            return member
    return None


def _is_mapping(annotation: Any) -> bool:
    return any(typing.get_origin(m) in (Mapping, dict) or m in (dict, Mapping) for m in _unwrap(annotation))


def _is_str(annotation: Any) -> bool:
    members = [m for m in _unwrap(annotation) if m is not type(None)]
    return bool(members) and all(m is str for m in members)


# ----------------------------------------------------------------------------- validation


def validate(
    raw: dict[str, Any],
    source: str | None = None,
    lines: dict[tuple, int | str] | None = None,
    problems: list[Problem] | None = None,
) -> Experiment:
    """Validate each section on its own (so every section's problems are reported), then the
    contradictions between sections that validated."""
    lines = lines or {}
    problems = list(problems or [])
    raw = dict(raw)
    if not raw.get("run_dir") and isinstance(raw.get("name", "experiment"), str):
        raw["run_dir"] = f"runs/{raw.get('name', 'experiment')}"

    fields = Experiment.model_fields
    for key in raw:
        if key not in fields:
            problems.append(
                Problem(
                    str(key),
                    f"unknown top-level key.{did_you_mean(str(key), fields)} Allowed: {', '.join(fields)}",
                    lines.get((key,)),
                )
            )
    valid: dict[str, Any] = {}
    for name, info in fields.items():
        if name not in raw:
            if info.is_required():
                problems.append(Problem(name, f"required section is missing: {info.description}", None))
            elif not info.is_required():
                valid[name] = info.get_default(call_default_factory=True)
            continue
        try:
            valid[name] = getattr(_field_adapter(name).model_validate({name: raw[name]}), name)
        except ValidationError as e:
            problems += _problems_from(e, lines)
    # Contradictions between the sections that validated (a check that needs a broken section is skipped).
    problems += contradictions(types.SimpleNamespace(**valid), lines)  # type: ignore[arg-type]
    if not problems:
        return Experiment.model_validate({k: raw[k] for k in raw if k in fields})
    raise ConfigError(source, _sorted(problems))


_ADAPTERS: dict[str, type[BaseModel]] = {}


def _field_adapter(name: str) -> type[BaseModel]:
    if name not in _ADAPTERS:
        from pydantic import create_model

        info = Experiment.model_fields[name]
        _ADAPTERS[name] = create_model(  # a model with just this field, same type and constraints
            f"_Only_{name}",
            __config__=ConfigDict(extra="forbid"),
            **{name: (info.rebuild_annotation(), Field(...))},
        )
    return _ADAPTERS[name]


def _problems_from(error: ValidationError, lines: dict[tuple, int | str]) -> list[Problem]:
    out = []
    for e in error.errors(include_url=False):
        loc = tuple(e["loc"])
        key = ".".join(str(p) for p in loc)
        line = _line_for(loc, lines)
        kind = e["type"]
        if kind == "extra_forbidden":
            parent = _model_at(loc[:-1])
            allowed = list(parent.model_fields) if parent else []
            msg = f"unknown key.{did_you_mean(str(loc[-1]), allowed)} Allowed here: {', '.join(allowed)}"
        elif kind == "missing":
            desc = _description_at(loc)
            msg = "required key is missing" + (f": {desc}" if desc else "")
        else:
            text = e["msg"]
            text = text.removeprefix("Value error, ")
            text = text[0].lower() + text[1:]
            text = text.replace("input should be", "must be")
            desc = _description_at(loc)
            msg = f"{text}; got {_show_input(e.get('input'))}" + (f" ({desc})" if desc else "")
        out.append(Problem(key, msg, line))
    return out


def _show_input(value: Any) -> str:
    if isinstance(value, Mapping):
        return "a mapping"
    text = repr(value)
    return text if len(text) < 60 else text[:57] + "..."


def _line_for(loc: tuple, lines: dict[tuple, int | str]) -> int | None:
    while loc:
        if loc in lines:
            return lines[loc]
        loc = loc[:-1]
    return None


def _model_at(loc: tuple) -> type[BaseModel] | None:
    annotation: Any = Experiment
    for part in loc:
        model = _model_of(annotation)
        if model is None or part not in model.model_fields:
            return None
        annotation = model.model_fields[part].annotation
    return _model_of(annotation)


def _description_at(loc: tuple) -> str | None:
    parent = _model_at(loc[:-1]) if loc else None
    if parent is None or not loc or loc[-1] not in parent.model_fields:
        return None
    return parent.model_fields[loc[-1]].description


def _sorted(problems: list[Problem]) -> list[Problem]:
    return sorted(
        problems, key=lambda p: (not isinstance(p.line, int), p.line if isinstance(p.line, int) else 0, p.key)
    )


# ----------------------------------------------------------------------------- contradictions


def _positions(config: Mapping[str, Any]) -> tuple[str, int] | None:
    for key in ("n_positions", "max_position_embeddings", "n_ctx", "max_seq_len", "seq_length"):
        if isinstance(config.get(key), int):
            return key, config[key]
    return None


Check = Callable[[Experiment], list[tuple[str, str]]]
CHECKS: list[Check] = []


def check(fn: Check) -> Check:
    CHECKS.append(fn)
    return fn


def contradictions(exp: Experiment, lines: dict[tuple, int | str] | None = None) -> list[Problem]:
    """Problems that involve more than one field; each names the key to change."""
    lines = lines or {}
    out = []
    for fn in CHECKS:
        try:
            found = fn(exp)
        except AttributeError:  # a section this check needs did not validate
            continue
        for key, msg in found:
            out.append(Problem(key, msg, _line_for(tuple(key.split(".")), lines)))
    return out


@check
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
    if m.chunked_loss and m.factory is not None:
        out.append(("model.chunked_loss", "a factory's model computes its own loss; set it to false"))
    if m.chunked_loss and m.config is not None and isinstance(m.config.get("model_type"), str):
        problem = chunked_loss_problem(m.config["model_type"])
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


@check
def _data_sources(exp: Experiment) -> list[tuple[str, str]]:
    out = []
    for key, src in (("data.train", exp.data.train), ("data.eval", exp.data.eval)):
        if src is None:
            continue
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


@check
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
    return out


@check
def _strategy(exp: Experiment) -> list[tuple[str, str]]:
    s = exp.strategy
    out = []
    if s.offload in ("cpu", "nvme") and s.zero_stage == 0:
        out.append(
            (
                "strategy.offload",
                f"offload {s.offload} needs a ZeRO optimizer (stage 1, 2 or 3), but zero_stage is 0; "
                "set zero_stage to 2, 3 or auto",
            )
        )
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


@check
def _train(exp: Experiment) -> list[tuple[str, str]]:
    out = []
    if exp.train.eval_every and exp.data.eval is None and exp.data.eval_fraction == 0:
        out.append(
            (
                "train.eval_every",
                "evaluation is asked for but there is no eval data: set data.eval or data.eval_fraction > 0, or eval_every: 0",
            )
        )
    return out


@check
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


TEMPLATES_DIR = Path(__file__).resolve().parent.parent / "configs" / "deepspeed"


# ----------------------------------------------------------------------------- reference


def describe(model: type[BaseModel] = Experiment, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, description) for every field: the config reference."""
    rows = []
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        sub = _model_of(info.annotation)
        if sub is not None and _model_of(info.annotation) is not None and name != "config":
            rows.append((key, "section", "", info.description or ""))
            rows += describe(sub, key + ".")
            continue
        if info.is_required():
            default = "required"
        elif info.default_factory is not None:
            default = _show(thaw(info.default_factory()))
        else:
            default = _show(info.default)
        rows.append((key, _type_name(info), default, info.description or ""))
    return rows


def _type_name(info: Any) -> str:
    for meta in info.metadata:
        allowed = getattr(getattr(meta, "func", None), "allowed", None)
        if allowed:
            return allowed
    annotation = info.annotation
    members = [m for m in _unwrap(annotation) if m is not type(None)]
    names = []
    for m in members:
        names.append(getattr(m, "__name__", str(m)).replace("typing.", ""))
    return " | ".join(names) + (" | null" if type(None) in _unwrap(annotation) else "")
