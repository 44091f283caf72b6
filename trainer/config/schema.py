"""The experiment schema: one pydantic model per section, the YAML mirrors it one to one. Every
field has a one-line description, which is also the config reference (`bin/train
--describe-config`, `describe`). Rules between fields are in `rules.py`, loading in `loading.py`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, model_validator

from trainer.common.optimizers import OPTIMIZERS
from trainer.config.checkpoint_schema import FLEET_MTBF_NODE_HOURS, CheckpointSection  # noqa: F401 (re-exported)
from trainer.config.data_schema import DataSection, DataSource  # noqa: F401 (DataSource: re-exported)
from trainer.config.distill_schema import DistillSection
from trainer.config.fields import (
    AutoBool,
    FrozenMapping,
    Section,
    auto_or_count,
    choice,
    thaw,
)
from trainer.config.preference_schema import KTOSection, PreferenceSection, RewardSection  # noqa: F401
from trainer.config.rl_schema import RLSection
from trainer.config.strategy_schema import StrategySection

TEMPLATES_DIR = Path(__file__).resolve().parent.parent.parent / "configs" / "deepspeed"

# model.chunked_loss: model types whose logits are plain lm_head(base_model(...)[0]): no logit scale
# (cohere, granite), no soft-capping (gemma2); the mixtures of experts and Gemma 3 measured equal to their
# own loss in the family matrix (tests/unit/test_family_matrix.py), unless their config asks for a
# router loss or a logit softcap (chunked_loss_problem's `config`).
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
        "gemma3_text",
        "qwen3_moe",
        "mixtral",
        "deepseek_v3",
        "gpt_oss",
    }
)
# config fields that put more than the LM head between the hidden states and the loss
CHUNKED_LOSS_FIELDS = {
    "final_logit_softcapping": "soft-caps the logits",
    "logit_scale": "scales the logits",
    "output_router_logits": "adds the router's auxiliary loss to the LM loss",
}


LOSS_CHUNK_BYTES = 1 << 30  # model.chunked_loss: fp32 logits per chunk


def loss_chunk_rows(vocab: int) -> int:
    """model.chunked_loss: rows (tokens) per chunk, LOSS_CHUNK_BYTES of fp32 logits."""
    return max(1, LOSS_CHUNK_BYTES // (4 * vocab))


def chunked_loss_problem(model_type: str | None, config: Any = None) -> str | None:
    """Why model.chunked_loss cannot serve this model type, or this model config (a mapping or a
    transformers config: CHUNKED_LOSS_FIELDS set), None: it can."""
    get = config.get if isinstance(config, Mapping) else (lambda k: getattr(config, k, None))
    for name, what in CHUNKED_LOSS_FIELDS.items():
        value = get(name) if config is not None else None
        idle = (
            value is None or value is False or (name == "logit_scale" and value == 1)
        )  # a scale of 1 is none
        if not idle:
            return f"the model's config sets {name} ({value!r}: it {what}), which the tiled loss leaves out; set it to false"
    if model_type in CHUNKED_LOSS_TYPES:
        return None
    return (
        f"not available for model_type '{model_type}' (it supports {', '.join(sorted(CHUNKED_LOSS_TYPES))}: "
        "models whose logits are the LM head's output, unscaled and uncapped); set it to false"
    )


class LoraSection(Section):
    """LoRA adapters (peft) on a frozen base model (see docs/fine-tuning.md)."""

    r: int = Field(16, ge=1, description="adapter rank")
    alpha: float = Field(32.0, gt=0, description="scaling numerator: the update is (alpha / r) B A x")
    dropout: float = Field(0.05, ge=0.0, lt=1.0, description="dropout on the adapter's input")
    target_modules: list[str] | None = Field(
        None,
        description="module names (or name suffixes) that get adapters; null = the model family's attention "
        "and MLP projections (gpt2: c_attn c_proj c_fc; llama, mistral, qwen2, qwen3: q/k/v/o_proj, "
        "gate/up/down_proj)",
    )
    train_modules: list[str] = Field(
        default_factory=list,
        description="modules trained in full beside the adapters (peft's modules_to_save), e.g. [lm_head]",
    )
    quantization: choice(None, "none", "4bit", "8bit") = Field(
        None,
        description="the frozen base's weights, loaded from model.pretrained quantized by bitsandbytes (pip "
        "install -e '.[qlora]'): 4bit = QLoRA; 8bit = LLM.int8; null/none = in the training precision (see "
        "docs/fine-tuning.md: QLoRA)",
    )
    quant_type: choice("nf4", "fp4") = Field(
        "nf4", description="4bit: the 4-bit data type (QLoRA's NormalFloat4)"
    )
    double_quant: bool = Field(
        True, description="4bit: quantize the quantization constants too (QLoRA's double quantization)"
    )
    compute_dtype: choice("auto", "bf16", "fp32") = Field(
        "auto", description="4bit: the dtype a quantized layer computes in; auto = the run's precision"
    )
    kernels: choice("fused", "peft") = Field(
        "fused",
        description="how an adapter computes: fused = its branch as one autograd function (one dropout "
        "kernel, two matmuls, the scaling and sum in one addmm; the layer input kept once for all its "
        "adapters), peft = peft's modules as they are; the same math (docs/fine-tuning.md)",
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
        None, description="'package.module:function' returning a torch.nn.Module (see docs/experiments.md)"
    )
    factory_args: FrozenMapping = Field(
        default_factory=dict, description="keyword arguments passed to `factory`"
    )
    trust_remote_code: bool = Field(False, description="allow model code from the hub (pretrained only)")
    activation_checkpointing: AutoBool = Field(
        "auto",
        description="recompute activations in backward (less memory, about 30% more compute); auto = when the "
        "plan needs it (docs/strategies.md: the activation levers)",
    )
    tiled_mlp: AutoBool = Field(
        "auto",
        description="DeepSpeed's TiledMLP: each layer's MLP run in shards of the sequence and recomputed in "
        "backward, so its intermediates are never kept; auto = when the plan needs it",
    )
    offload_activations: AutoBool = Field("auto", description="with activation checkpointing, keep the "
                                          "checkpointed layer inputs in host memory; auto = when the plan needs it (GPU only)")  # fmt: skip
    attn_implementation: choice(None, "auto", "eager", "sdpa", "flash_attention_2", "varlen") = Field(
        "auto",
        description="attention kernel for transformers models; varlen = PyTorch's FlashAttention-2 kernel over "
        "the examples of each packed row (one call a layer, no mask; llama, mistral, qwen2, qwen3); auto = "
        "varlen on CUDA in bf16/fp16 for those families, eager on CPU in bf16 with data.seq_len <= 256 "
        "(measured 1.1-1.5x faster steps there), else (and for factories) the model's default; null keeps "
        "the model's default",
    )
    cudnn_attention: bool = Field(
        False,
        description="let sdpa use cuDNN's attention kernel on CUDA (torch's first choice on Hopper); false "
        "turns it off (flash and memory-efficient kernels instead): its plans cost the host milliseconds a "
        "call (docs/performance.md)",
    )
    chunked_loss: AutoBool = Field(
        "auto",
        description="LM head and cross-entropy in chunks, never the whole logits (less memory and memory "
        "traffic; transformers causal LMs with a plain LM head, see docs/experiments.md); auto = when the plan "
        "needs it, and always on CPU in bf16 (the faster loss there)",
    )
    kernels: choice("none", "liger") = Field(
        "none",
        description="fused GPU kernels for the model's layers: liger = Liger-Kernel's RMSNorm, SwiGLU, "
        "RoPE, and with chunked_loss its fused linear cross-entropy; CUDA only, see docs/experiments.md",
    )
    head: choice("causal_lm", "score") = Field(
        "causal_lm",
        description="causal_lm = the language model's head (AutoModelForCausalLM); score = one number a sequence "
        "read at its last token that is not padding (AutoModelForSequenceClassification, num_labels 1: a reward "
        "model, TRL's RewardTrainer's); train.objective reward sets it (docs/preference.md)",
    )
    lora: LoraSection | None = Field(
        None, description="LoRA adapters on the frozen model (null = full training); see docs/fine-tuning.md"
    )
    freeze: tuple[choice("vision_tower", "projector", "language_model"), ...] | None = Field(
        None,
        description="vision-language models: the parts not trained (vision_tower, projector, language_model); "
        "null = the vision tower frozen, the projector and language model trained (docs/fine-tuning.md#images)",
    )

    @property
    def checkpoints_hold_frozen(self) -> bool:
        """False for LoRA on a pretrained model: its checkpoints leave the frozen base out, which
        model.pretrained holds (trainer/checkpoint/frozen.py; the planner's host copy follows)."""
        return self.lora is None or self.pretrained is None


class TrainSection(Section):
    """Batch, length and precision of training."""

    objective: choice("sft", "dpo", "ipo", "simpo", "orpo", "grpo", "distill", "reward", "kto") = Field(
        "sft",
        description="sft = next-token loss on the targets; dpo, ipo (against the reference: the model as "
        "training starts, its log-probs computed once) and simpo, orpo (reference-free) train on data of kind "
        "preference (docs/fine-tuning.md); grpo generates completions of prompts (data of kind prompt) and "
        "trains on their rewards (train.rl, docs/rl.md); distill trains on a teacher's next-token distributions "
        "over the data's tokens (train.distill, docs/distillation.md); reward trains a reward model on preference "
        "pairs (model.head score, train.reward, docs/preference.md); kto trains on unpaired rows, each response "
        "labelled desirable or not (data kind unpaired, train.kto, docs/preference.md)",
    )
    rl: RLSection = Field(
        default_factory=RLSection, description="train.objective grpo's settings (docs/rl.md)"
    )
    preference: PreferenceSection = Field(
        default_factory=PreferenceSection,
        description="the preference objectives' settings (dpo, ipo, simpo, orpo; beta also kto's)",
    )
    distill: DistillSection = Field(
        default_factory=DistillSection, description="train.objective distill's teacher and divergence"
    )
    reward: RewardSection = Field(
        default_factory=RewardSection, description="train.objective reward's settings (docs/preference.md)"
    )
    kto: KTOSection = Field(default_factory=KTOSection, description="train.objective kto's settings")

    micro_batch_size: auto_or_count("a number of sequences") = Field(
        8,
        description="sequences per rank per forward/backward; auto = the largest the plan fits that trains "
        "fastest (needs global_batch_size; docs/strategies.md: the micro batch)",
    )
    grad_accum: int = Field(
        1,
        ge=1,
        description="micro batches accumulated per optimizer step (set from global_batch_size when given)",
    )
    global_batch_size: int | None = Field(
        None,
        ge=1,
        description="sequences per optimizer step, every rank together, kept exactly: grad_accum = global / "
        "(micro x data-parallel ranks); null = micro x ranks x grad_accum as written",
    )
    max_steps: int = Field(description="optimizer steps to train", ge=1)
    precision: choice("auto", "fp32", "bf16", "fp16") = Field(
        "auto", description="auto = bf16 on GPUs that support it, else fp32"
    )
    grad_clip: float = Field(1.0, ge=0.0, description="clip the global gradient norm to this (0 = off)")
    log_every: int = Field(10, ge=1, description="log metrics every N steps")
    eval_every: int = Field(0, ge=0, description="evaluate every N steps (0 = only at the end)")
    eval_batches: int = Field(50, ge=1, description="at most this many micro batches per rank per eval")
    eval_prompts: list[str] = Field(
        default_factory=list,
        description="prompts whose greedy completions are printed (rank 0) and logged at each eval; every "
        "rank takes part (ZeRO-3; under pipeline stages through the stages, docs/strategies.md)",
    )
    eval_max_new_tokens: int = Field(
        48, ge=1, le=4096, description="tokens generated per eval prompt at most"
    )
    compile: bool = Field(
        False,
        description="torch.compile the model through DeepSpeed's engine.compile() (first steps compile)",
    )
    compile_mode: choice("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs") = Field(
        "default",
        description="torch.compile's mode with train.compile: reduce-overhead adds CUDA graphs (fewer kernel "
        "launches), max-autotune also tries matmul kernels (longer compile)",
    )

    def sequences_per_step(self, world_size: int) -> int:
        """The global batch: micro_batch_size x world size x grad_accum, the one DeepSpeed sees."""
        return self.micro_batch_size * world_size * self.grad_accum


class OptimSection(Section):
    """Optimizer and learning-rate schedule (passed to DeepSpeed, which owns the update)."""

    name: choice(*OPTIMIZERS) = Field("adamw", description="optimizer (trainer/common/optimizers.py)")
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
    warmup_steps: int = Field(
        0,
        ge=0,
        description="linear warmup: step k applies (k-1)/warmup_steps of the peak, as the HF Trainer; 0: "
        "the peak from step 1 (linear schedule: 0, then the peak)",
    )
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


class DistSection(Section):
    """How ranks talk, and how a job that stops making progress ends (see docs/launching.md)."""

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


# Llama 3 (Dubey et al. 2024, section 3.3.4): 419 unexpected interruptions in 54 days of pre-training on
# 16,384 H100 GPUs (2,048 nodes of 8): 54 x 24 x 2048 / 419 = 6,335 node-hours between failures.
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


def reward_head(data: Any) -> Any:
    """train.objective reward: the model's head is a score (model.head), unless written (the raw experiment)."""
    train, model = (data.get("train"), data.get("model")) if isinstance(data, Mapping) else (None, None)
    if isinstance(train, Mapping) and train.get("objective") == "reward" and isinstance(model, Mapping):
        return data if "head" in model else {**data, "model": {**model, "head": "score"}}
    return data


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

    @model_validator(mode="before")
    @classmethod
    def _reward_head(cls, data: Any) -> Any:
        return reward_head(data)

    def to_dict(self) -> dict[str, Any]:
        return thaw(self.model_dump(mode="python", by_alias=True))

    def to_yaml(self) -> str:
        """The whole experiment as YAML (what checkpoints save and --print-config prints), which validates
        as it is: data.packing, which preference pairs never use (and the rules refuse when written), is
        left out for them, and data.eval_fraction for grpo (it holds no prompts out) unless it was written."""
        out = self.to_dict()
        given = self.data.model_fields_set
        if self.train.objective not in ("sft", "distill") and self.data.packing and "packing" not in given:
            out["data"].pop("packing", None)
        if self.train.objective == "grpo" and "eval_fraction" not in given:
            out["data"].pop("eval_fraction", None)
        return yaml.safe_dump(_plain(out), sort_keys=False, default_flow_style=False)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


SECTIONS = ("model", "data", "train", "optim", "strategy", "dist", "checkpoint", "logging")
