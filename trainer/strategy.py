"""The parallelism strategy: which ZeRO stage and offload, and the exact DeepSpeed JSON.

`plan()` estimates per-rank memory for every candidate and applies the escalation rules
(0 -> 2 -> 3 -> 3+cpu -> 3+nvme, the first that fits `device memory x headroom`; stage 1 only
when asked for). `ds_config()` turns a template plus the experiment plus the plan into the one
dict handed to `deepspeed.initialize`: every value the experiment owns (batch sizes, precision,
clipping, optimizer, scheduler, stage, offload) comes from the experiment; a template `"auto"` is
filled; a template value that disagrees is an error listing every mismatch.

Nothing here imports torch or deepspeed: planning runs anywhere, in well under a second.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainer.config import TEMPLATES_DIR, Experiment, chunked_loss_problem, format_size, loss_chunk_rows
from trainer.errors import ConfigError, Problem, UserError, did_you_mean

# ----------------------------------------------------------------------------- model facts


@dataclass(frozen=True)
class ModelInfo:
    """What the planner needs to know about a model, counted without allocating its weights."""

    params: int  # unique parameters (tied weights once)
    largest_layer: int  # most parameters held directly by one module (ZeRO-3 gathers it whole)
    hidden: int | None = None
    layers: int | None = None
    heads: int | None = None
    vocab: int | None = None
    positions: int | None = None
    attn_implementation: str | None = None  # eager materialises attention scores; sdpa/flash do not
    model_type: str | None = None


# ----------------------------------------------------------------------------- candidates


@dataclass(frozen=True, order=True)
class Candidate:
    """A ZeRO stage plus where optimizer states (and, at stage 3, parameters) live."""

    stage: int
    offload: str = "none"  # none | cpu | nvme
    offload_params: bool = False  # stage 3 only: parameters offloaded too

    @property
    def name(self) -> str:
        if self.offload == "none":
            return f"zero{self.stage}"
        what = "" if self.offload_params or self.stage < 3 else " (optimizer only)"
        return f"zero{self.stage}+{self.offload}{what}"

    @property
    def cost(self) -> int:
        """Position on the escalation ladder: higher = more communication or slower memory."""
        if self.offload == "none":
            return self.stage
        return {"cpu": 4, "nvme": 6}[self.offload] + (self.stage == 3)

    @property
    def template(self) -> str:
        suffix = {"none": "", "cpu": "_offload", "nvme": "_nvme"}[self.offload]
        return f"zero{self.stage}{suffix}.json"


def _c(stage: int, offload: str = "none") -> Candidate:
    return Candidate(stage, offload, offload_params=(stage == 3 and offload != "none"))


LADDER = (_c(0), _c(2), _c(3), _c(3, "cpu"), _c(3, "nvme"))
TABLE = (_c(0), _c(1), _c(2), _c(2, "cpu"), _c(3), _c(3, "cpu"), _c(3, "nvme"))

# ----------------------------------------------------------------------------- memory model

GiB = 2**30
CUDA_CONTEXT = 1 * GiB  # CUDA context, NCCL and allocator slack on a GPU (not counted on CPU)
HOST_BUFFER_FACTOR = 1.5  # DeepSpeed estimators' additional_buffer_factor


@dataclass(frozen=True)
class Estimate:
    """Bytes per rank for one candidate (host figures per node)."""

    candidate: Candidate
    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    host: int  # host memory needed per node
    fits_device: bool = False
    fits_host: bool = True

    gather: int = 0  # stage 3: the gathered layer inside `params` (transient, 4 x largest layer)

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.model_states + self.activations + self.buffers

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host


def model_states(
    c: Candidate, p: int, largest: int, n: int, lp: int, grad_accum: int = 1
) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes per rank for Adam, following DeepSpeed's estimators.

    p parameters, n data-parallel ranks, lp bytes per low-precision value (2 for bf16/fp16, 4 for
    fp32). Mixed precision keeps an fp32 master copy (4), Adam keeps two fp32 moments (8) and ZeRO
    keeps fp32 gradient partitions (4). With lp=2 this gives DeepSpeed's figures: stage 0: 16P,
    stage 2: 2P + 18P/N, stage 3: 18P/N + 4 x largest layer (a gathered layer, counted with the
    parameters as DeepSpeed does); offload moves the optimizer (and at stage 3 the parameters) off
    the device. Stage 1 keeps full gradients only between micro steps (grad_accum > 1); at the
    accumulation boundary DeepSpeed reduces them into partitions during backward, as stage 2 does.
    """
    master = 4  # fp32 master weights (a separate fp32 copy in DeepSpeed's ZeRO even for fp32 models)
    moments = 8
    fp32_grads = 4 if lp < 4 else 0
    if c.stage == 0:
        params, grads, optim = lp * p, lp * p, (master if lp < 4 else 0) * p + moments * p
    elif c.stage == 1:
        full = lp * p if grad_accum > 1 else lp * p / n
        params, grads, optim = lp * p, full + fp32_grads * p / n, (master + moments) * p / n
    elif c.stage == 2:
        params, grads, optim = lp * p, (lp + fp32_grads) * p / n, (master + moments) * p / n
    else:
        params = lp * p / n + 4 * largest  # own shard + one gathered layer (DeepSpeed: 4 x largest)
        grads = (lp if lp == 4 else fp32_grads) * p / n
        optim = (master + moments) * p / n
    if c.offload != "none":
        optim = 0
        grads = 0 if c.stage == 2 else grads / 2  # fp32 gradient partitions move to the host
        if c.stage == 2:
            grads = 0
        if c.offload_params:
            params = 4 * largest
            grads = 0
    return int(params), int(grads), int(optim)


def host_needs(c: Candidate, p: int, largest: int, n: int, gpus_per_node: int) -> int:
    """Host bytes per node, DeepSpeed's estimator formulas (zero_init for stage 3)."""
    nodes = max(1, n // max(1, gpus_per_node))
    f = HOST_BUFFER_FACTOR
    if c.stage == 3:
        if c.offload == "none":
            return int(largest * 4 * gpus_per_node * f)
        per = 18 if c.offload_params else 16
        if c.offload == "nvme":  # states live on NVMe; the host keeps pinned swap buffers
            return int(largest * 4 * gpus_per_node * f + 2 * GiB)
        return int(p * per / nodes * f)
    if c.offload != "none":
        return int(p * max(4 * n, 16) * f / nodes)
    return int(p * 4 * gpus_per_node * f)


def activations(
    info: ModelInfo, micro_batch: int, seq_len: int, lp: int, checkpointing: bool, chunked_loss: bool = False
) -> int:
    """Activation bytes per rank: Korthikanti et al. (2022) per layer s*b*h*(34 + 5*a*s/h) for
    16-bit activations; the 5as/h attention-score term only with eager attention; with activation
    checkpointing the layer inputs (2sbh per layer) plus one layer's full activations. Plus the
    logits for the loss: b*s*V*3*(lp + 4) bytes, that is the logits, their fp32 copy and its
    log-softmax, then in backward their gradients (an H100 measured 17.2 bytes per logit for GPT-2
    124M in bf16 at micro batch 64, where this gives 18 and the former 2*(lp + 4) gave 12 and
    predicted a ZeRO-2 fit that ran out of memory). With `model.chunked_loss`, one chunk of rows
    instead: its fp32 logits and their low-precision gradient (twice, for the allocator), plus the
    saved gradients towards the hidden states (lp) and the head's weight (fp32)."""
    h, layers, a, v = info.hidden, info.layers, info.heads, info.vocab
    if not (h and layers):
        return 0
    s, b = seq_len, micro_batch
    scale = lp / 2
    attn = 5 * (a or 1) * s / h if (info.attn_implementation or "eager") == "eager" else 0
    per_layer = s * b * h * (34 + attn) * scale
    if checkpointing:
        total = 2 * s * b * h * scale * layers + per_layer
    else:
        total = per_layer * layers
    if v and chunked_loss:
        rows = min(b * s, loss_chunk_rows(v))
        total += 2 * rows * v * (4 + lp) + b * s * h * lp + v * h * 4
    elif v:
        total += 3 * b * s * v * (lp + 4)
    return int(total)


def buffers(c: Candidate, info: ModelInfo, lp: int, on_gpu: bool, template: Mapping[str, Any] | None) -> int:
    """Fixed per-rank buffers: CUDA context on a GPU plus ZeRO's communication buckets."""
    zero = (template or {}).get("zero_optimization", {}) if template else {}
    h = info.hidden or 1024
    bucket = _number(zero.get("reduce_bucket_size"), auto_bucket(h))
    out = CUDA_CONTEXT if on_gpu else 0
    if c.stage in (1, 2):
        out += int(2 * bucket * lp)  # reduce bucket, double-buffered with overlap_comm
    elif c.stage == 3:
        prefetch = _number(zero.get("stage3_prefetch_bucket_size"), int(0.9 * auto_bucket(h)))
        out += int((bucket + prefetch) * lp)
    return out


def auto_bucket(hidden: int) -> int:
    """Bucket size (elements) for "auto": hidden^2, as the Hugging Face integration does."""
    return hidden * hidden


def _number(value: Any, default: int) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else default


# ----------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Plan:
    """The decision and the evidence for it."""

    candidate: Candidate
    reason: str
    estimates: tuple[Estimate, ...]
    budget: int  # device bytes the plan may use (device memory x headroom)
    device_memory: int
    host_memory: int | None  # None: planning for another machine whose host memory was not given
    world_size: int
    gpus_per_node: int
    precision: str
    device_type: str
    pinned: bool = False
    justification: str = ""
    auto_choice: Candidate | None = None

    @property
    def estimate(self) -> Estimate:
        return next(e for e in self.estimates if e.candidate == self.candidate)

    def table(self) -> str:
        head = (
            "candidate",
            "params",
            "grads",
            "optimizer",
            "activations",
            "buffers",
            "total/rank",
            "host/node",
            "fits",
        )
        rows = [head]
        for e in self.estimates:
            mark = " <-" if e.candidate == self.candidate else ""
            fits = "yes" if e.fits else ("no (host)" if e.fits_device else "no")
            if e.candidate.offload == "nvme" and not e.fits and e.total <= self.budget:
                fits = "no (needs strategy.nvme_path)"
            rows.append(
                (
                    e.candidate.name,
                    *(
                        format_size(x)
                        for x in (e.params, e.grads, e.optimizer, e.activations, e.buffers, e.total, e.host)
                    ),
                    fits + mark,
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        last = len(head) - 1
        lines = [
            "  ".join(
                c.ljust(w) if i in (0, last) else c.rjust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            ).rstrip()
            for r in rows
        ]
        lines.insert(1, "-" * len(lines[0]))
        return "\n".join(lines)

    def summary(self) -> dict[str, Any]:
        """What goes into logs and trainer_state.json."""
        e = self.estimate
        return {
            "stage": self.candidate.stage,
            "offload": self.candidate.offload,
            "offload_params": self.candidate.offload_params,
            "reason": self.reason,
            "pinned": self.pinned,
            "justification": self.justification,
            "estimate_bytes": {
                "params": e.params,
                "grads": e.grads,
                "optimizer": e.optimizer,
                "activations": e.activations,
                "buffers": e.buffers,
                "total": e.total,
                "host_per_node": e.host,
                "gathered_layer": e.gather,
            },
            "budget_bytes": self.budget,
            "device_memory_bytes": self.device_memory,
            "world_size": self.world_size,
            "precision": self.precision,
        }


def resolve_precision(
    precision: str, device_type: str, bf16_supported: bool = True, source: str | None = None
) -> str:
    """train.precision for the device: auto = bf16 on a GPU that has it, else fp32. fp16 needs a
    CUDA GPU: DeepSpeed's CPU accelerator trains fp32 and bf16 only (its loss scaler is GPU-only)."""
    if precision == "fp16" and device_type == "cpu":
        raise ConfigError(
            source,
            [
                Problem(
                    "train.precision",
                    "fp16 needs a CUDA GPU, and training here runs on CPU (DeepSpeed's CPU accelerator has no "
                    "fp16 training); set train.precision: bf16 (mixed precision that runs on CPU and on "
                    "Ampere or newer GPUs) or auto (fp32 on CPU, bf16 on such a GPU), e.g. "
                    "--set train.precision=bf16",
                )
            ],
        )
    if precision != "auto":
        return precision
    return "bf16" if device_type == "cuda" and bf16_supported else "fp32"


def low_precision_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def plan(
    exp: Experiment,
    info: ModelInfo,
    *,
    world_size: int,
    gpus_per_node: int,
    device_type: str,
    device_memory: int,
    host_memory: int | None,
    precision: str,
    template: Mapping[str, Any] | None = None,
    force: bool = False,
) -> Plan:
    """Estimate every candidate and choose by the escalation rules (see module docstring).

    Raises UserError when a pinned candidate is above the rules' choice without a justification,
    or is predicted not to fit (unless `force`), or when nothing fits."""
    s = exp.strategy
    lp = low_precision_bytes(precision)
    budget = int(device_memory * s.headroom)

    def activations_with(chunked_loss: bool) -> int:
        m = exp.model
        return activations(
            info, exp.train.micro_batch_size, exp.data.seq_len, lp, m.activation_checkpointing, chunked_loss
        )

    act = activations_with(exp.model.chunked_loss)
    on_gpu = device_type == "cuda"

    want_stage, want_offload, offload_params = pinned_choice(exp, template)
    table = list(TABLE)
    if want_stage == 3 and want_offload not in (None, "none") and not offload_params:
        table.insert(table.index(_c(3, want_offload)), Candidate(3, want_offload, False))

    estimates = []
    for c in table:
        par, grad, opt = model_states(
            c, info.params, info.largest_layer, world_size, lp, exp.train.grad_accum
        )
        buf = buffers(c, info, lp, on_gpu, template)
        host = host_needs(c, info.params, info.largest_layer, world_size, gpus_per_node)
        total = par + grad + opt + act + buf
        nvme_ok = c.offload != "nvme" or bool(s.nvme_path) or want_offload == "nvme"
        estimates.append(
            Estimate(
                c,
                par,
                grad,
                opt,
                act,
                buf,
                host,
                fits_device=total <= budget and nvme_ok,
                fits_host=host_memory is None or host <= host_memory,  # None: a target machine, not known
                gather=4 * info.largest_layer if c.stage == 3 else 0,
            )
        )
    by = {e.candidate: e for e in estimates}
    auto_choice = next((c for c in LADDER if by[c].fits), None)

    is_pinned = want_stage is not None or want_offload is not None
    if not is_pinned:
        options = list(LADDER)
    else:  # the pinned part is fixed; the free part escalates by cost (stage 1 only when named)
        options = sorted(
            (
                c
                for c in by
                if (want_stage is None or c.stage == want_stage)
                and (want_offload is None or c.offload == want_offload)
                and (c.stage != 1 or want_stage == 1)
                and (c.stage < 3 or c.offload == "none" or c.offload_params == offload_params)
            ),
            key=lambda c: c.cost,
        )
    chosen = next((c for c in options if by[c].fits), None)

    hint = _chunked_loss_hint(exp, info, act - activations_with(True), budget, [by[c] for c in LADDER])

    def fail(msg: str) -> UserError:
        return UserError(
            msg
            + (f" Or {hint}." if hint else "")
            + "\n\n"
            + _table_for(by, budget, device_memory, s.headroom, world_size)
        )

    if chosen is None:
        if is_pinned and force and options:
            chosen = options[0]
        elif is_pinned and options:
            e = by[options[0]]
            raise fail(
                f"strategy: the pinned {options[0].name} is predicted not to fit: {format_size(e.total)} per rank "
                f"(host {format_size(e.host)}) against {format_size(budget)} usable of {format_size(device_memory)}. "
                + (
                    f"The rules would pick {auto_choice.name}; set strategy.zero_stage/offload: auto. "
                    if auto_choice
                    else ""
                )
                + "Pass --force to run anyway."
            )
        else:
            raise fail(
                f"strategy: nothing fits in {format_size(budget)} per rank ({format_size(device_memory)} x headroom "
                f"{s.headroom}) on {world_size} rank(s): lower train.micro_batch_size or data.seq_len, set "
                "model.activation_checkpointing: true, add ranks, or give strategy.nvme_path for NVMe offload."
            )

    e = by[chosen]
    use = f"{format_size(e.total)} of {format_size(budget)} per rank"
    if not is_pinned:
        skipped = LADDER[: LADDER.index(chosen)]
        why = "; ".join(
            f"{c.name} needs {format_size(by[c].total)}" + (" (host)" if by[c].fits_device else "")
            for c in skipped
        )
        reason = (
            f"{chosen.name} is the first rung that fits ({use})"
            + (f"; {why}" if why else "")
            + (f"; {hint}" if hint else "")
        )
    else:
        reason = f"{chosen.name} pinned by the experiment ({use})"
        if auto_choice is not None and chosen.cost > auto_choice.cost:
            if not s.justification.strip():
                raise UserError(
                    f"strategy: {chosen.name} is pinned, but the cheaper {auto_choice.name} fits "
                    f"({format_size(by[auto_choice].total)} of {format_size(budget)} per rank). Set "
                    f"strategy.zero_stage/offload to auto to use {auto_choice.name}, or say why in "
                    "strategy.justification."
                )
            reason += f"; the rules would pick {auto_choice.name}; justification: {s.justification.strip()}"
        if not e.fits:
            reason += "; predicted NOT to fit (--force)"
    return Plan(
        candidate=chosen,
        reason=reason,
        estimates=tuple(estimates),
        budget=budget,
        device_memory=device_memory,
        host_memory=host_memory,
        world_size=world_size,
        gpus_per_node=gpus_per_node,
        precision=precision,
        device_type=device_type,
        pinned=is_pinned,
        justification=s.justification.strip(),
        auto_choice=auto_choice,
    )


def _chunked_loss_hint(
    exp: Experiment, info: ModelInfo, saved: int, budget: int, ladder: list[Estimate]
) -> str:
    """When the whole logits cost a rung of the ladder (or every rung): what model.chunked_loss
    would save (`saved` bytes per rank), and the rung that would then fit. Empty when it would
    change nothing."""
    if exp.model.chunked_loss or exp.model.factory is not None or chunked_loss_problem(info.model_type):
        return ""
    for e in ladder:
        if e.fits or e.candidate.offload == "nvme":
            return ""  # the rungs below the chosen one would not fit even without the logits
        if e.fits_host and e.total - saved <= budget:
            return (
                f"set model.chunked_loss: true (no whole logits: {format_size(saved)} less per rank) "
                f"and {e.candidate.name} fits"
            )
    return ""


def _table_for(
    by: dict[Candidate, Estimate], budget: int, device_memory: int, headroom: float, world: int
) -> str:
    plan_ = Plan(
        candidate=Candidate(-1),
        reason="",
        estimates=tuple(by.values()),
        budget=budget,
        device_memory=device_memory,
        host_memory=0,
        world_size=world,
        gpus_per_node=1,
        precision="",
        device_type="",
    )
    return (
        plan_.table()
        + f"\nusable per rank: {format_size(budget)} ({format_size(device_memory)} x {headroom})"
    )


def pinned_choice(exp: Experiment, template: Mapping[str, Any] | None) -> tuple[int | None, str | None, bool]:
    """(stage, offload, offload_params) that the experiment or its template fixes; None = free."""
    s = exp.strategy
    stage = None if s.zero_stage == "auto" else s.zero_stage
    offload = None if s.offload == "auto" else s.offload
    offload_params = True
    zero = (template or {}).get("zero_optimization")
    if isinstance(zero, Mapping):
        t_stage = zero.get("stage")
        if stage is None and isinstance(t_stage, int) and not isinstance(t_stage, bool):
            stage = t_stage
        opt_dev = _device(zero.get("offload_optimizer"))
        par_dev = _device(zero.get("offload_param"))
        if offload is None and opt_dev is not None:
            offload = opt_dev
        if par_dev in (None, "none") and opt_dev not in (None, "none"):
            offload_params = False
    return stage, offload, offload_params


def _device(section: Any) -> str | None:
    if isinstance(section, Mapping):
        dev = section.get("device")
        return dev if isinstance(dev, str) and dev != "auto" else None
    return None


# ----------------------------------------------------------------------------- DeepSpeed JSON

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
OPTIMIZERS = {"adamw": "AdamW", "adam": "Adam"}


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
    return data


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


def optimizer_implementation(choice: str, device_type: str, offload: str) -> str:
    """auto: DeepSpeed's fused Adam on GPU and DeepSpeedCPUAdam with offload (the fast paths); torch's
    AdamW on a CPU device, where DeepSpeed's SIMD kernel rounds differently depending on where a
    reloaded tensor lands in memory, which would make resumed runs differ in the last bit."""
    if choice != "auto":
        return choice
    return "deepspeed" if device_type == "cuda" or offload != "none" else "torch"


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
    batch = t.micro_batch_size * world_size * t.grad_accum
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
    t, o = exp.train, exp.optim
    world = plan_.world_size
    d = json.loads(json.dumps(template))  # deep copy
    f = _Filler(template_path)
    why_batch = f"micro {t.micro_batch_size} x world {world} x grad_accum {t.grad_accum}"
    f.own(d, "train_micro_batch_size_per_gpu", t.micro_batch_size, why="train.micro_batch_size")
    f.own(d, "gradient_accumulation_steps", t.grad_accum, why="train.grad_accum")
    f.own(d, "train_batch_size", t.micro_batch_size * world * t.grad_accum, why=why_batch)
    f.own(d, "gradient_clipping", t.grad_clip, why="train.grad_clip")
    precision = plan_.precision
    f.own(d, "bf16.enabled", precision == "bf16", why=f"train.precision resolves to {precision}")
    if precision == "fp16" or "fp16" in d:
        f.own(d, "fp16.enabled", precision == "fp16", why=f"train.precision resolves to {precision}")
    if "bfloat16" in d:  # old alias of bf16
        f.own(d, "bfloat16.enabled", precision == "bf16", why=f"train.precision resolves to {precision}")

    sched = sched or schedule(exp, world)
    lr = sched.lr
    f.own(d, "optimizer.type", OPTIMIZERS[o.name], why="optim.name")
    f.own(d, "optimizer.params.lr", lr, why="optim.lr x lr_scaling")
    f.own(d, "optimizer.params.betas", list(o.betas), why="optim.betas")
    f.own(d, "optimizer.params.eps", o.eps, why="optim.eps")
    f.own(d, "optimizer.params.weight_decay", o.weight_decay, why="optim.weight_decay")
    impl = optimizer_implementation(o.implementation, plan_.device_type, plan_.candidate.offload)
    f.own(d, "optimizer.params.torch_adam", impl == "torch", why=f"optim.implementation resolves to {impl}")

    kind = SCHEDULERS[o.schedule]
    warm = max(1, o.warmup_steps)
    f.own(d, "scheduler.type", kind, why="optim.schedule")
    if kind == "WarmupCosineLR":
        f.own(
            d, "scheduler.params.total_num_steps", sched.horizon, why="train.max_steps / optim.schedule_steps"
        )
        f.own(d, "scheduler.params.warmup_num_steps", warm, why="optim.warmup_steps")
        f.own(d, "scheduler.params.warmup_min_ratio", 0.0, why="warmup starts at 0")
        f.own(d, "scheduler.params.cos_min_ratio", o.min_lr_ratio, why="optim.min_lr_ratio")
        f.own(d, "scheduler.params.warmup_type", "linear", why="linear warmup")
    else:
        if kind == "WarmupDecayLR":
            f.own(
                d,
                "scheduler.params.total_num_steps",
                sched.horizon,
                why="train.max_steps / optim.schedule_steps",
            )
        f.own(d, "scheduler.params.warmup_min_lr", 0.0, why="warmup starts at 0")
        f.own(d, "scheduler.params.warmup_max_lr", lr, why="optim.lr x lr_scaling")
        f.own(d, "scheduler.params.warmup_num_steps", warm, why="optim.warmup_steps")
        f.own(d, "scheduler.params.warmup_type", "linear", why="linear warmup")

    c = plan_.candidate
    f.own(d, "zero_optimization.stage", c.stage, why="strategy.zero_stage / the plan")
    zero = d["zero_optimization"]
    if c.offload != "none":
        f.own(d, "zero_optimization.offload_optimizer.device", c.offload, why="strategy.offload")
        if c.offload == "nvme":
            f.own(
                d,
                "zero_optimization.offload_optimizer.nvme_path",
                exp.strategy.nvme_path,
                why="strategy.nvme_path",
            )
        if c.stage == 3 and c.offload_params:
            f.own(d, "zero_optimization.offload_param.device", c.offload, why="strategy.offload")
            if c.offload == "nvme":
                f.own(
                    d,
                    "zero_optimization.offload_param.nvme_path",
                    exp.strategy.nvme_path,
                    why="strategy.nvme_path",
                )
    else:
        for k in ("offload_optimizer", "offload_param"):
            dev = _device(zero.get(k))
            if dev not in (None, "none"):
                f.mismatches.append(
                    Problem(
                        f"zero_optimization.{k}.device",
                        f"template offloads to {dev}, the experiment says offload none",
                    )
                )

    # Model-dependent sizes the Hugging Face integration also calls "auto".
    h = info.hidden or 1024
    for key, value in (
        ("reduce_bucket_size", auto_bucket(h)),
        ("allgather_bucket_size", auto_bucket(h)),
        ("stage3_prefetch_bucket_size", int(0.9 * auto_bucket(h))),
        ("stage3_param_persistence_threshold", 10 * h),
    ):
        if zero.get(key) == "auto":
            zero[key] = value

    leftover = sorted(_autos(d))
    for path in leftover:
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


def _autos(d: Any, prefix: str = "") -> list[str]:
    if isinstance(d, dict):
        return [p for k, v in d.items() for p in _autos(v, f"{prefix}{k}.")]
    return [prefix[:-1]] if d == "auto" else []


def describe_plan(plan_: Plan) -> str:
    mem = f"{format_size(plan_.device_memory)} {plan_.device_type} memory x headroom -> {format_size(plan_.budget)} usable per rank"
    host = (
        f"host memory {format_size(plan_.host_memory)} per node"
        if plan_.host_memory is not None
        else "host memory not checked (set strategy.host_memory for the target machine)"
    )
    return (
        f"{plan_.table()}\n\n{mem}; {host}; world size {plan_.world_size} ({plan_.gpus_per_node} per node); "
        f"precision {plan_.precision}\ndecision: {plan_.candidate.name}: {plan_.reason}"
    )


def plan_dict(plan_: Plan) -> dict[str, Any]:
    out = asdict(plan_)
    out["candidate"] = plan_.candidate.name
    return out
