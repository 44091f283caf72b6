"""The transformers config a model section names: its attention implementation (`attention`: auto's choice
on CPU in bf16, varlen for packed rows), its config from a local path, a hub id or a dict (`hf_config`), a
factory's callable, and the longest sequence its positions allow (`positions`, `check_seq_len`)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.common.errors import UserError
from trainer.config import ModelSection, thaw
from trainer.model.quantized import stored_quantized

# model.attn_implementation: auto. On CPU in bf16, sdpa runs PyTorch's flash-attention kernel for CPU,
# whose backward takes 4x its forward at short sequences; eager attention (two batched matmuls and a
# softmax) made whole forward+backward steps 1.1-1.5x faster at 128 and 256 tokens on tiny, a 4x256
# GPT-2 and a grouped-query Llama, and lost on the Llama from 512 tokens (1.05x slower, 1.75x at 1024).
# In fp32 the two are even, and on GPUs sdpa/flash win: there auto keeps the model's default.
# Measured 2026-11-24 on a 2-core AMD EPYC with avx512_bf16 (BENCHMARKS.md).


# model.attn_implementation: auto. On CPU in bf16, sdpa runs PyTorch's flash-attention kernel for CPU,
# whose backward takes 4x its forward at short sequences; eager attention (two batched matmuls and a
# softmax) made whole forward+backward steps 1.1-1.5x faster at 128 and 256 tokens on tiny, a 4x256
# GPT-2 and a grouped-query Llama, and lost on the Llama from 512 tokens (1.05x slower, 1.75x at 1024).
# In fp32 the two are even, and on GPUs sdpa/flash win: there auto keeps the model's default.
# Measured 2026-11-24 on a 2-core AMD EPYC with avx512_bf16 (BENCHMARKS.md).
EAGER_ON_CPU_BF16_UP_TO = 256


def attention(section: ModelSection, *, seq_len: int, precision: str, device_type: str) -> str | None:
    """The attention kernel a run asks transformers for: model.attn_implementation with auto resolved
    (varlen on CUDA in bf16/fp16 for its families: trainer/model/varlen.py; eager on CPU in bf16 up to
    EAGER_ON_CPU_BF16_UP_TO tokens; else None: the model's default; a factory's model is its own and
    keeps None)."""
    attn = section.attn_implementation
    if attn != "auto":
        return attn
    from trainer.model.varlen import VARLEN_FAMILIES

    if device_type == "cuda" and precision in ("bf16", "fp16") and model_type(section) in VARLEN_FAMILIES:
        return "varlen"
    short = seq_len <= EAGER_ON_CPU_BF16_UP_TO
    return (
        "eager"
        if device_type == "cpu" and precision == "bf16" and short and section.factory is None
        else None
    )


def resolved(section: ModelSection, *, seq_len: int, precision: str, device_type: str) -> ModelSection:
    """The model section with attn_implementation's auto decided for this run (see attention)."""
    attn = attention(section, seq_len=seq_len, precision=precision, device_type=device_type)
    return (
        section
        if attn == section.attn_implementation
        else section.model_copy(update={"attn_implementation": attn})
    )


def model_type(section: ModelSection) -> str | None:
    """The model type of `config:` or of a local `pretrained:` directory's config.json (None for a hub id
    not read yet, or a factory), without importing transformers."""
    if section.config is not None:
        return section.config.get("model_type")
    if section.pretrained is not None:
        path = Path(section.pretrained).expanduser() / "config.json"
        with contextlib.suppress(OSError, ValueError, AttributeError):
            return json.loads(path.read_text()).get("model_type")
    return None


def attn_kwargs(section: ModelSection, cfg: Any = None) -> dict[str, Any]:
    """transformers' attn_implementation argument; none for null and for an unresolved auto (the model's
    default: callers that know the device and precision resolve auto first, see `resolved`). varlen is
    registered with transformers first, and refused for a family it is not verified for."""
    attn = section.attn_implementation
    if attn == "varlen":
        from trainer.model import varlen

        problem = varlen.family_problem(
            getattr(cfg, "model_type", None) if cfg is not None else model_type(section)
        )
        if problem:
            raise UserError(f"model.attn_implementation: {problem}")
        varlen.register()
    return {"attn_implementation": attn} if attn and attn != "auto" else {}


def hf_config(section: ModelSection, vocab_size: int | None, eos_id: int | None) -> Any:
    """The transformers config for `config:` or `pretrained:` models."""
    cfg = _hf_config(section, vocab_size, eos_id)
    if section.head == "score":  # a reward model: one label, read at the last token that is not padding
        classifier = any(
            a.endswith("ForSequenceClassification") for a in getattr(cfg, "architectures", None) or []
        )
        if section.pretrained and classifier and getattr(cfg, "num_labels", 1) != 1:
            raise UserError(f"model.pretrained: {section.pretrained} is a sequence classifier of {cfg.num_labels} labels; "
                            "a reward model has one (TRL refuses it too): give a causal LM (its score head is drawn "
                            "new) or a one-label reward model")  # fmt: skip
        cfg.num_labels = 1
        text = cfg.get_text_config()
        if getattr(text, "pad_token_id", None) is None:
            text.pad_token_id = eos_id  # (the run sets the tokenizer's: trainer/objectives/reward.py)
    return cfg


def _hf_config(section: ModelSection, vocab_size: int | None, eos_id: int | None) -> Any:
    from transformers import AutoConfig

    if section.config is not None:
        fields = thaw(section.config)
        model_type = fields.pop("model_type")
        if vocab_size is not None:
            given = fields.get("vocab_size")
            if given is not None and given < vocab_size:
                raise UserError(
                    f"model.config.vocab_size is {given} but the tokenizer has {vocab_size} tokens; remove "
                    "vocab_size (it then follows the tokenizer) or raise it"
                )
            fields.setdefault("vocab_size", vocab_size)
        if eos_id is not None:
            for key in ("bos_token_id", "eos_token_id"):
                fields.setdefault(key, eos_id)
        try:
            return AutoConfig.for_model(model_type, **fields)
        except ValueError as e:
            raise UserError(f"model.config.model_type: {e}") from None
        except TypeError as e:
            raise UserError(f"model.config: {e}") from None
    try:
        cfg = AutoConfig.from_pretrained(
            section.pretrained, revision=section.revision, trust_remote_code=section.trust_remote_code
        )
        stored_quantized(section, cfg)
        return cfg
    except (
        OSError,
        ValueError,
    ) as e:  # ValueError: a directory whose config.json is missing or has no model_type
        local = Path(section.pretrained).expanduser()
        why = (
            f"the directory has no config.json (it holds {', '.join(sorted(p.name for p in local.iterdir())[:5]) or 'nothing'})"
            if local.is_dir() and not (local / "config.json").exists()
            else str(e).splitlines()[0]
        )
        raise UserError(
            f"model.pretrained: cannot load '{section.pretrained}': {why}. Give a local directory with config.json "
            "(a model saved by save_pretrained, or bin/export's output), or a hub id on a machine with network access"
        ) from None


def factory_of(section: ModelSection) -> Callable[..., Any]:
    from trainer.common.dotted import load_callable

    return load_callable(section.factory or "", "model.factory")


def positions(cfg: Any) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length"):
        v = getattr(cfg, key, None)
        if isinstance(v, int):
            return v
    return None


def check_seq_len(cfg: Any, seq_len: int) -> None:
    n = positions(cfg)
    if n is not None and seq_len > n:
        raise UserError(
            f"data.seq_len {seq_len} is longer than the model's {n} positions; lower data.seq_len to at most {n}"
        )
