"""train.objective distill: the student trained on a teacher's next-token distributions over the data's own tokens
(off-policy: TRL's DistillationTrainer and GKD at lmbda 0), the divergence of trainer/objectives/divergence.py
(TRL's beta and temperature) summed over the targets and divided as the token loss is (the step's targets over
ranks and accumulation: split-invariant).

The teacher is loaded once a process (`teacher`: its vocabulary checked against the student's before its weights
load), frozen and in eval mode, outside the student (no optimizer state, not in checkpoints), moved to the
student's device and compute precision at its first forward. The student's forward is replaced on the instance
(as model.chunked_loss replaces it): with labels it runs both models' base to their last hidden states and the
divergence a vocabulary chunk at a time, so neither model's whole logits exist; without labels (generation,
samples) the model's own forward runs. At ZeRO-3 the student's LM head is registered as an external parameter
(DeepSpeed gathers it for the forward and backward); the teacher is then a whole copy a rank.
"""

from __future__ import annotations

from typing import Any

from trainer.common.errors import UserError


def _config(spec: str) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(spec)
    except (OSError, ValueError) as e:
        raise UserError(
            f"train.distill.teacher: cannot load '{spec}' ({type(e).__name__}: {str(e)[:200]}); give a local "
            "directory or hub id of a causal LM"
        ) from None


def check_vocabulary(spec: str, student: Any, tokenizer: Any = None) -> Any:
    """The teacher's config, once its vocabulary is the student's (sizes, and where the teacher's local directory
    holds a tokenizer, the same tokens): exit 2 naming both, before any weight loads."""
    cfg = _config(spec)
    for key, each in (("model", student), ("train.distill.teacher", cfg)):
        _family(each, key)
    theirs, ours = cfg.get_text_config().vocab_size, student.get_text_config().vocab_size
    if theirs != ours:
        raise UserError(
            f"train.distill.teacher: '{spec}' has a vocabulary of {theirs:,} and the student ({student.model_type}) "
            f"one of {ours:,}: the divergence compares the two distributions entry by entry, so they need one "
            "tokenizer (distilling across tokenizers, TRL's GOLD, is not built here); give a teacher of the "
            "student's tokenizer"
        )
    from pathlib import Path

    local = Path(spec).expanduser()
    if tokenizer is not None and any(
        (local / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        from transformers import AutoTokenizer

        try:
            their_tok = AutoTokenizer.from_pretrained(str(local))
        except (OSError, ValueError):
            return cfg  # a tokenizer that does not load: the sizes said it
        if their_tok.get_vocab() != tokenizer.get_vocab():
            raise UserError(
                f"train.distill.teacher: '{spec}''s tokenizer is not data.tokenizer's (the same {theirs:,} ids "
                "for other tokens); give a teacher of the student's tokenizer"
            )
    return cfg


def teacher_key(settings: Any) -> str:
    """What identifies the teacher for a resume (the data's fingerprint): its hub id, or its local directory's
    config and weight files (name, size, and the config's bytes); and its top-k where only those train."""
    import hashlib
    from pathlib import Path

    spec = settings.teacher
    sparse = f", top-{settings.top_k} {settings.missing}" if settings.top_k else ""
    local = Path(spec).expanduser()
    if not local.is_dir():
        return spec + sparse
    h = hashlib.sha256()
    for f in sorted(local.iterdir()):
        if f.suffix in (".json", ".safetensors", ".bin") and f.is_file():
            h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
            if f.name == "config.json":
                h.update(f.read_bytes())
    return f"{spec} ({h.hexdigest()[:16]}){sparse}"


def require_bitsandbytes() -> None:
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        raise UserError("train.distill.quantization: 4bit needs bitsandbytes, which is not installed: pip install -e "
                        "'.[qlora]' (or pip install 'bitsandbytes>=0.50'), or set it to none")  # fmt: skip


def cpu_four_bit(config: Any) -> None:
    """bitsandbytes' 4-bit inference on CPU (eval mode, no gradients: the teacher's) reshapes each layer's absmax by
    its in-features over 64 and fails otherwise (0.50.2: "shape '[288, 1]' is invalid"): such a teacher is refused
    on CPU from its config (exit 2), before any weight loads."""
    import torch

    if torch.cuda.is_available():
        return
    text = config.get_text_config()
    widths = {int(getattr(text, k)) for k in ("hidden_size", "n_embd", "intermediate_size", "n_inner")
              if isinstance(getattr(text, k, None), int)}  # fmt: skip
    odd = sorted(w for w in widths if w % 64)
    if odd:
        raise UserError(f"train.distill.quantization: 4bit on CPU: bitsandbytes' 4-bit inference needs each layer's "
                        f"inputs in multiples of 64, and the teacher's are {', '.join(map(str, odd))} wide; set it to "
                        "none on CPU (a GPU runs it)")  # fmt: skip


def four_bit(dtype: Any) -> dict[str, Any]:
    """from_pretrained's arguments for a 4-bit teacher (train.distill.quantization): QLoRA's NF4 with double
    quantization computing in `dtype`, on this rank's device; its embeddings and head stay in `dtype`."""
    require_bitsandbytes()
    import torch
    from transformers import BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=dtype)  # fmt: skip
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    return {"quantization_config": config, "device_map": {"": device}}


def compute_dtype(precision: str) -> Any:
    """The torch dtype a run's precision computes in (bf16, fp16; else fp32): the teacher's."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)


def teacher(
    spec: str, config: Any, dtype: Any = None, ds_config: Any = None, quantization: str = "none"
) -> Any:
    """The teacher of `config` (check_vocabulary's), frozen and in eval mode, in `dtype` (the run's compute
    precision; on the host until its first forward moves it to the device). With `ds_config` (the student's, at
    ZeRO-3) it is loaded partitioned (zero.Init) and run by a DeepSpeed inference engine of its own, as TRL does:
    each rank holds its share, and each layer is gathered for its forward. `quantization` 4bit: its linear layers
    in NF4 (`four_bit`), a whole copy a rank at every stage."""
    import contextlib

    import torch
    from transformers import AutoModelForCausalLM

    from trainer.model.create import _zero3_context

    dtype = dtype or torch.float32
    more = four_bit(dtype) if quantization == "4bit" else {}
    with _zero3_context(ds_config) if ds_config is not None else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_pretrained(spec, config=config, dtype=dtype, **more)
    model.eval().requires_grad_(False)
    _heads(model, "train.distill.teacher")
    if ds_config is not None:
        import deepspeed

        cfg = {k: v for k, v in ds_config.items() if k not in ("optimizer", "scheduler")}
        cfg["zero_optimization"] = {
            k: v for k, v in cfg["zero_optimization"].items() if k != "offload_optimizer"
        }
        engine, *_ = deepspeed.initialize(model=model, config=cfg)
        engine.eval()
        # (its hooks gather each layer: kept alive with the model, and not as its submodule: the engine's module is
        # the model, and a module's train() or modules() would go round the circle)
        object.__setattr__(model, "inference_engine", engine)
    return model


def shard_line(model: Any) -> str:
    """The start-up log's line for a teacher partitioned at ZeRO-3: the share of its parameters this rank holds."""
    held = sum(int(getattr(p, "ds_tensor", p).numel()) for p in model.parameters())
    whole = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())
    return (f"teacher: sharded at ZeRO-3 (an inference engine of its own: each layer gathered for its forward), "
            f"{held:,} of its {whole:,} parameters on this rank")  # fmt: skip


def _family(config: Any, key: str) -> None:
    """A causal LM whose logits are its LM head's output, unscaled and uncapped (the families model.chunked_loss
    serves), and not a vision-language model: exit 2 otherwise, from its config."""
    from trainer.config import chunked_loss_problem
    from trainer.model.vision import is_vision

    model_type = getattr(config, "model_type", None)
    problem = chunked_loss_problem(model_type, config.get_text_config())
    if is_vision(model_type):
        problem = "a vision-language model, which distill is not verified with"
    if problem:
        problem = problem.replace(", which the tiled loss leaves out; set it to false", "").replace(
            "; set it to false", ""
        )
        raise UserError(
            f"{key} ({model_type}): {problem}; distill computes the logits from the last hidden states and the LM "
            "head alone: give a model of a family whose logits are its head's output (llama, mistral, qwen2, qwen3, "
            "gpt2 and the others model.chunked_loss serves)"
        )


def _heads(model: Any, key: str) -> tuple[Any, Any]:
    """(the base model, the LM head) of a transformers causal LM whose logits are head(hidden) unscaled and uncapped."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    _family(inner.config, key)
    head = inner.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None:
        raise UserError(f"{key}: {type(inner).__name__} has no bias-free LM head: distill computes the logits from the "
                        "last hidden states and the LM head alone")  # fmt: skip
    return inner.base_model, head


def attach(model: Any, teach: Any, settings: Any, zero3: bool = False, store: Any = None) -> Any:
    """Give the student `model` (under LoRA: peft's wrapper) the divergence to `teach` (or, offline, to the teacher's
    top-k read from `store`: trainer/objectives/teacher_store.py) as its loss."""
    import torch
    from transformers.modeling_outputs import CausalLMOutput

    from trainer.data.pack import IGNORE
    from trainer.objectives import divergence, sparse

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    base, head = _heads(inner, "model")
    sharded = store is None and hasattr(teach, "inference_engine")
    # (4 bits: on its device already, and not castable)
    placed = sharded or getattr(teach, "is_loaded_in_4bit", False)
    if store is None:
        t_base, t_head = _heads(teach, "train.distill.teacher")
    if zero3:
        import deepspeed

        deepspeed.zero.register_external_parameter(inner, head.weight)
    original = inner.forward
    scale = settings.temperature**2 if settings.temperature_squared else 1.0
    beta, temp, k = settings.beta, settings.temperature, settings.top_k

    def forward(input_ids: Any = None, labels: Any = None, **kwargs: Any) -> Any:
        if labels is None:
            return original(input_ids=input_ids, **kwargs)
        num_items = kwargs.pop("num_items_in_batch", None)
        kwargs.pop("shift_labels", None)
        hidden = base(input_ids=input_ids, **kwargs)[0]
        mask = labels[:, 1:] != IGNORE
        count = num_items if num_items is not None else mask.sum().clamp(min=1)
        keep = mask.reshape(-1).nonzero().flatten()
        h_s = hidden[:, :-1].reshape(-1, hidden.shape[-1])[keep]
        if store is not None:
            t_ids, t_logp = store.lookup(input_ids, labels, kwargs.get("position_ids"))
        else:
            if not placed:
                place(teach, hidden.device, hidden.dtype)
            with torch.no_grad():
                t_hidden = t_base(input_ids=input_ids, **kwargs)[0]
            h_t = t_hidden[:, :-1].reshape(-1, t_hidden.shape[-1])[keep]
            with _gathered(t_head.weight, sharded):  # the teacher's head whole for what reads it (at ZeRO-3)
                if k is None:
                    div = divergence.per_token(h_s, head.weight, h_t, t_head.weight, beta, temp)
                else:
                    t_ids, t_logp = sparse.teacher_topk(h_t, t_head.weight, k, temp)
        if store is not None or k is not None:  # the top-k, stored or the live teacher's
            div = sparse.per_token(h_s, head.weight, t_ids, t_logp, beta, temp, settings.missing)
        return CausalLMOutput(loss=div.sum() * scale / count)

    inner.forward = forward
    return model


def place(teach: Any, device: Any, dtype: Any) -> None:
    """A whole teacher (not sharded, not in 4 bits) on the student's device in its compute dtype."""
    first = next(teach.parameters())
    if first.device != device or first.dtype != dtype:
        teach.to(device=device, dtype=dtype)


def _gathered(weight: Any, sharded: bool) -> Any:
    import contextlib

    if not sharded:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters([weight], modifier_rank=None)
