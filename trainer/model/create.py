"""The model: from a transformers config (random init), a local path or hub id, or a factory.

`info()` counts parameters and the largest layer on the meta device (no weights allocated), for
the planner; the transformers config a section names, and its attention, are spec.py's. `build()` makes the real module; at ZeRO stage 3 it is built under DeepSpeed's
zero.Init (through transformers' HfDeepSpeedConfig), so no rank ever holds the whole model.

A factory (`model.factory: package.module:function`) returns a torch.nn.Module whose forward
takes `input_ids` and `labels` and returns either the loss tensor or an object with `.loss`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import importlib.metadata
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from trainer.common.errors import UserError
from trainer.common.files import write_atomic
from trainer.config import ModelSection, chunked_loss_problem, thaw
from trainer.model.quantized import loaded_quantized, quantization, quantized_count
from trainer.model.shape import shape, structure
from trainer.model.spec import attn_kwargs, check_seq_len, factory_of, hf_config
from trainer.strategy import ModelInfo
from trainer.strategy.planning.candidates import Experts, Quantized
from trainer.strategy.planning.images import Vision


def count(module: Any) -> tuple[int, int]:
    """(unique parameters, largest parameter count held directly by one module)."""
    unique = {id(p): p.numel() for p in module.parameters()}
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules()), default=0)
    return sum(unique.values()), largest


def sizes(module: Any) -> tuple[int, ...]:
    """Elements of each unique parameter tensor, ascending (ZeRO-3 keeps those up to a threshold whole)."""
    return tuple(sorted({id(p): p.numel() for p in module.parameters()}.values()))


def info(
    section: ModelSection,
    vocab_size: int | None = None,
    eos_id: int | None = None,
    cache_dir: str | Path | None = None,
) -> ModelInfo:
    """Count the model on the meta device: no weights are allocated, even for 70B.

    With `cache_dir`, the count is kept in `<cache_dir>/model-info/` keyed by the model section, the
    vocabulary and the transformers version, so that `--plan` and `--print-config` of a model seen
    before import neither torch nor transformers (whose import alone takes seconds: torch,
    accelerate, DTensor, torch._dynamo). Factories and hub ids are counted every time: their code or
    config can change under the same name."""
    key = _info_key(section, vocab_size, eos_id)
    path = Path(cache_dir).expanduser() / "model-info" / f"{key}.json" if cache_dir and key else None
    if path is not None and path.is_file():
        with contextlib.suppress(OSError, ValueError, TypeError):
            found = json.loads(path.read_text())
            return _from_json(found)
    found = _count(section, vocab_size, eos_id)
    if path is not None:
        with contextlib.suppress(OSError):  # a read-only cache only costs speed
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(dataclasses.asdict(found), indent=1) + "\n")
    return found


def _from_json(found: dict[str, Any]) -> ModelInfo:
    """A ModelInfo from its cached JSON (lists back to tuples, the nested records back to theirs)."""
    q, e = found.get("quantized"), found.get("experts")
    return ModelInfo(**{
        **found, "param_sizes": tuple(found.get("param_sizes", ())), "layer_windows": tuple(found.get("layer_windows", ())),
        "latent": tuple(found["latent"]) if found.get("latent") else None,
        "quantized": Quantized(**{**q, "sizes": tuple(q["sizes"])}) if q else None,
        "experts": Experts(**e) if e else None, "vision": _vision(found.get("vision")),
    })  # fmt: skip


def _vision(found: dict[str, Any] | None) -> Vision | None:
    return (
        Vision(**{**found, **{k: tuple(found[k]) for k in ("layer", "rest", "cross") if k in found}})
        if found
        else None
    )


def _info_key(section: ModelSection, vocab_size: int | None, eos_id: int | None) -> str | None:
    if section.factory is not None:
        return None
    extra = None
    if section.pretrained is not None:
        config = Path(section.pretrained).expanduser() / "config.json"
        if not config.is_file():
            return None
        extra = hashlib.sha256(config.read_bytes()).hexdigest()
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None
    payload = {
        "v": 18,  # 18: a score head not quantized; 4: intermediate, kv_heads; 5: ulysses; 6: masks dropped; 7: window; 8: active; 9: chunked; 13: quantized; 14-15: the layers' shape; 16: qkv_bias; 17: vision
        "model": thaw(section.model_dump(mode="python")),
        "vocab": vocab_size,
        "eos": eos_id,
        "transformers": version,
        "config_json": extra,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _count(section: ModelSection, vocab_size: int | None, eos_id: int | None) -> ModelInfo:
    import torch

    if section.factory is not None:
        fn = factory_of(section)
        try:
            with torch.device("meta"):
                module = fn(**thaw(section.factory_args))
        except Exception:  # a factory that cannot build on meta: build it for real once
            module = fn(**thaw(section.factory_args))
        cfg = getattr(module, "config", None)
        module, trainable = _with_lora(module, section)
        params, largest = count(module)
        facts = {**shape(cfg), **structure(module, cfg)} if cfg is not None else {}
        return ModelInfo(
            params=params, largest_layer=largest, trainable=trainable, param_sizes=sizes(module),
            intermediate=_gated_width(module, cfg), **facts,
        )  # fmt: skip
    cfg = hf_config(section, vocab_size, eos_id)
    kwargs = attn_kwargs(section, cfg)
    with torch.device("meta"), _quiet_transformers():
        module = auto_class(cfg, section.head).from_config(cfg, **kwargs)
        attn = getattr(module.config, "_attn_implementation", None)
        frozen = _frozen(module, cfg, section)
        module, trainable = _with_lora(module, section)
    seen = _vision_record(cfg, module)
    if frozen and trainable is None:
        trainable = adapters_trainable(module)
    params, largest = count(module)
    from trainer.model.experts import active_params
    from trainer.model.sequence import ulysses_verdict

    return ModelInfo(
        params=params, largest_layer=largest, attn_implementation=attn, trainable=trainable,
        param_sizes=sizes(module), intermediate=_gated_width(module, cfg), **shape(cfg), **structure(module, cfg),
        ulysses=ulysses_verdict(cfg, "sdpa"), active=active_params(module, cfg),
        chunked_problem=chunked_loss_problem(getattr(cfg, "model_type", None), cfg.get_text_config()),
        quantized=quantized_count(module, section), vision=seen,
    )  # fmt: skip


def _vision_record(cfg: Any, module: Any) -> Vision | None:
    """A vision-language model's tower as the planner counts it (measured: vision_count.py), frozen as the built
    module is: model.freeze's parts, or under LoRA the tower and projector unless model.lora.train_modules
    trains them (peft's modules_to_save: the module's own parameters say)."""
    from trainer.model import vision

    fam = vision.family(getattr(cfg, "model_type", None))
    if fam is None:
        return None
    from trainer.model.vision_count import measure

    base = (
        module.get_base_model() if hasattr(module, "get_base_model") else module
    )  # under LoRA, peft's wrapper
    trained = {vision.freeze_part(fam, name) for name, p in base.named_parameters() if p.requires_grad}
    return measure(cfg, tuple(part for part in vision.PARTS if part not in trained))


def auto_class(cfg: Any, head: str = "causal_lm") -> Any:
    """transformers' auto class for the config: image-text-to-text for a vision-language model; with model.head
    score, sequence classification (a reward model)."""
    import transformers

    from trainer.model.vision import is_vision

    vision = is_vision(getattr(cfg, "model_type", None))
    if head == "score" and vision:
        raise UserError(f"model.head: score: {cfg.model_type} is a vision-language model; a reward model over images "
                        "is not built (train.objective reward): give a text model")  # fmt: skip
    if head == "score":
        return transformers.AutoModelForSequenceClassification
    if vision:
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def _frozen(module: Any, cfg: Any, section: ModelSection) -> int:
    """model.freeze's parts of a vision-language model frozen (by default its vision tower): parameters frozen."""
    from trainer.model import vision

    fam = vision.family(getattr(cfg, "model_type", None))
    if fam is None:
        if section.freeze:
            raise UserError(
                f"model.freeze: {list(section.freeze)} names parts of a vision-language model; this model "
                f"({getattr(cfg, 'model_type', None)}) is not one: remove model.freeze"
            )
        return 0
    return vision.freeze(module, fam, vision.frozen_parts(fam, section.freeze))


def adapters_trainable(module: Any) -> int:
    from trainer.model import adapters

    return adapters.trainable(module)[0]


def _gated_width(module: Any, cfg: Any) -> int | None:
    """A gated MLP's width (Llama's gate_proj/up_proj: the planner counts its activations), else None (a
    multimodal config: its text model's)."""
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    width = getattr(text, "intermediate_size", None)
    if not isinstance(width, int):
        return None
    gated = any(name.endswith(("gate_proj", "gate_up_proj")) for name, _ in module.named_modules())
    return width if gated else None


def _with_lora(module: Any, section: ModelSection) -> tuple[Any, int | None]:
    """The module with model.lora's adapters applied, and its trainable parameters (None: all train)."""
    if section.lora is None:
        return module, None
    from trainer.model import adapters

    module = adapters.apply(module, section.lora)
    return module, adapters.trainable(module)[0]


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def build(
    section: ModelSection,
    *,
    vocab_size: int | None,
    eos_id: int | None,
    seq_len: int,
    ds_config: Mapping[str, Any] | None = None,
) -> Any:
    """The real module, in training mode. At ZeRO stage 3 it is created partitioned (zero.Init)."""
    import torch

    # the run's seed (dist.seed_all): LoRA's adapters start from it, however the base loads
    seed = torch.initial_seed()
    zero3 = bool(ds_config) and ds_config.get("zero_optimization", {}).get("stage") == 3
    with _zero3_context(ds_config if zero3 else None), _quiet_transformers():
        if section.factory is not None:
            import deepspeed

            fn = factory_of(section)
            init = (
                deepspeed.zero.Init(config_dict_or_path=dict(ds_config))
                if zero3
                else contextlib.nullcontext()
            )
            with init:
                model = fn(**thaw(section.factory_args))
            cfg = getattr(model, "config", None)
        else:
            model, cfg = _transformers_model(section, vocab_size, eos_id, seq_len, ds_config)
    if cfg is not None:
        check_seq_len(cfg, seq_len)
        _frozen(model, cfg, section)
    if section.activation_checkpointing is True:  # auto is decided by the plan (planned.model)
        if not hasattr(model, "gradient_checkpointing_enable"):
            raise UserError(
                "model.activation_checkpointing: the factory's model has no gradient_checkpointing_enable(); "
                "implement it or set activation_checkpointing: false"
            )
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if getattr(model, "config", None) is not None and hasattr(model.config, "use_cache"):
            model.config.use_cache = False
    if section.kernels == "liger":
        from trainer.model import kernels

        # chunked_loss (no whole logits) is then Liger's fused linear cross-entropy: 8% faster than
        # ours beside Liger's layers on a Llama 1B (BENCHMARKS.md)
        kernels.apply(model, fused_loss=section.chunked_loss is True, zero3=zero3)
    elif section.chunked_loss is True:
        from trainer.model import loss

        loss.attach(model, zero3=zero3)
    if section.lora is not None:
        from trainer.model import adapters

        # the adapters' initial values from the run's seed alone: loading the base under zero.Init draws from the
        # generator otherwise than without it (LLaVA's did: LoRA's A differed at ZeRO-3, its gradients 8% apart)
        torch.manual_seed(seed)
        model = adapters.apply(model, section.lora)  # the base frozen, adapters trainable
        if section.lora.kernels == "fused":
            from trainer.model.lora_kernels import install

            install(model)
    from trainer.model.varlen import no_cudnn

    no_cudnn(section.cudnn_attention)
    # Training mode: from_pretrained returns a model in eval mode, so a fine-tuning run trained without
    # dropout until its first eval switched it back (and then ran 50% slower at once: the steps pay
    # for dropout from there on).
    model.train()
    return model


def disable_dropout(model: Any) -> int:
    """Every dropout of `model` off (train.preference.disable_dropout): the dropout layers' p (peft's
    adapter dropout among them) and the float rates attention kernels read off their module
    (`attention_dropout`); not the config, which checkpoints and exports save (a later fine-tune keeps
    the model's dropout). Returns how many were on."""
    import torch

    on = 0
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            on += m.p > 0
            m.p = 0.0
        for name, value in list(vars(m).items()):
            if isinstance(value, float) and name.endswith(("dropout", "pdrop")) and value > 0:
                on += 1
                setattr(m, name, 0.0)
    return on


def _transformers_model(
    section: ModelSection, vocab_size: int | None, eos_id: int | None, seq_len: int,
    ds_config: Mapping[str, Any] | None,
) -> tuple[Any, Any]:  # fmt: skip
    """(the model, its config) from `config:` (random init) or `pretrained:` (weights loaded)."""
    cfg = hf_config(section, vocab_size, eos_id)
    check_seq_len(cfg, seq_len)
    kwargs = attn_kwargs(section, cfg)
    auto = auto_class(cfg, section.head)
    if section.config is not None:
        model = auto.from_config(cfg, **kwargs)
    else:
        # fp32 training holds fp32 weights: from_pretrained's own default ("auto") would keep a
        # bf16-stored hub model in bf16. In bf16/fp16 DeepSpeed casts whatever is loaded.
        mixed = any((ds_config or {}).get(k, {}).get("enabled") is True for k in ("bf16", "fp16"))
        try:
            import torch

            zero3 = (ds_config or {}).get("zero_optimization", {}).get("stage") == 3
            held = next((d for k, d in (("bf16", torch.bfloat16), ("fp16", torch.float16))
                         if (ds_config or {}).get(k, {}).get("enabled") is True), torch.float32)  # fmt: skip
            quantized = quantization(section, held, zero3, cfg.model_type)
            model = auto.from_pretrained(
                section.pretrained,
                config=cfg,
                revision=section.revision,
                trust_remote_code=section.trust_remote_code,
                dtype="auto" if mixed else torch.float32,
                **kwargs,
                **quantized,
            )
            if quantized:
                loaded_quantized(model, section, held, zero3)
        except OSError as e:
            raise UserError(f"model.pretrained: cannot load weights of '{section.pretrained}': {e}") from None
    vocab = cfg.get_text_config().vocab_size  # (a vision-language model's: its text model's)
    # Llama 3.2 Vision embeds 8 ids past its vocabulary (its <|image|> 128256, never a target, is one)
    vocab = max(vocab, getattr(model.get_input_embeddings(), "num_embeddings", 0) or 0)
    if vocab_size is not None and vocab < vocab_size:
        raise UserError(
            f"data.tokenizer has {vocab_size} tokens but the model's vocab_size is {vocab}; use the model's own "
            "tokenizer"
        )
    return model, cfg


@contextlib.contextmanager
def _zero3_context(ds_config: Mapping[str, Any] | None) -> Iterator[None]:
    """Make transformers build/load the model under zero.Init (the weakref needs a live object)."""
    if ds_config is None:
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    keep = HfDeepSpeedConfig(dict(ds_config))
    try:
        yield
    finally:
        del keep
        unset_hf_deepspeed_config()


def param_groups(model: Any, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices only: biases and norm weights (1-D) get no weight decay. Under ZeRO-3 a
    parameter is a 1-D placeholder, so its real shape is `ds_shape`."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if len(getattr(p, "ds_shape", p.shape)) >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def loss_of(output: Any) -> Any:
    """The loss from a model's output: a tensor, or an object/dict with `.loss`."""
    if hasattr(output, "loss"):
        return output.loss
    if isinstance(output, Mapping) and "loss" in output:
        return output["loss"]
    return output
