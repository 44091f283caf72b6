"""LoRA adapters (`model.lora`) with peft: the base weights frozen, low-rank adapters on the attention
and MLP projections trained (and optionally whole modules, `train_modules`).

The engine's module is then peft's `PeftModel`, so every parameter name starts with `base_model.model.`
and an adapter's carries peft's adapter name (`...c_attn.lora_A.default.weight`). Only trainable
parameters reach the optimizer (trainer/model/create.py: param_groups), so gradients and optimizer
state exist for the adapters only, at every ZeRO stage.

A checkpoint's `adapter/` is peft's format (adapter_config.json, adapter_model.safetensors): the
trainable parameters gathered (at ZeRO-3 only those, never the whole model) onto rank 0, verified
(every expected tensor present with its full shape, finite, none of the B matrices all zero once a
step with a nonzero learning rate was applied, `TrainState.moved`: the saved-adapter-is-empty failure
of ZeRO-3 trainers), then written.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainer.common.errors import UserError

ADAPTER_DIR = "adapter"

_LLAMA_LIKE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# The attention and MLP projections of each family: what LoRA papers and peft's examples target.
DEFAULT_TARGETS: dict[str, list[str]] = {
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    **{t: _LLAMA_LIKE for t in ("llama", "mistral", "qwen2", "qwen3")},
    # vision-language models: the language model's (the vision tower and projector excluded: `_vision_excluded`)
    # (Llama 3.2 Vision: its cross-attention layers' projections too)
    **{t: _LLAMA_LIKE for t in ("qwen2_vl", "qwen2_5_vl", "gemma3", "llava", "idefics3", "mllama")},
}


class AdapterError(RuntimeError):
    """A checkpoint's adapter failed its verification: the save fails, nothing becomes visible."""


def _projections(model: Any) -> dict[str, str]:
    """Leaf modules that can carry an adapter (linear layers, GPT-2's Conv1D): name -> type."""
    import torch

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear | torch.nn.Embedding) or type(m).__name__ == "Conv1D":
            out[name] = type(m).__name__
    return out


def targets(lora: Any, model: Any, present: dict[str, str]) -> list[str]:
    """model.lora.target_modules, or the family's default; each must match a module (by its name or
    the end of it, as peft matches), else an error that lists the modules there are (`present`:
    `_projections(model)`)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    names = list(lora.target_modules) if lora.target_modules else DEFAULT_TARGETS.get(model_type or "")
    leaves = sorted({n.rsplit(".", 1)[-1] for n in present if n})
    if not names:
        raise UserError(
            f"model.lora.target_modules: no default for model type '{model_type}'; name the modules to adapt, "
            f"e.g. some of: {', '.join(leaves)}"
        )
    for key, wanted in (("target_modules", names), ("train_modules", list(lora.train_modules))):
        for t in wanted:
            every = (n for n, _ in model.named_modules())
            if not any(n == t or n.endswith("." + t) for n in every):
                raise UserError(
                    f"model.lora.{key}: '{t}' matches no module of this {model_type or 'model'}; its linear "
                    f"layers and embeddings are named: {', '.join(leaves)}"
                )
    return names


def apply(model: Any, lora: Any) -> Any:
    """`model` wrapped by peft with LoRA adapters (the base frozen). Returns the PeftModel."""
    from peft import LoraConfig, get_peft_model

    present = _projections(model)
    names = targets(lora, model, present)
    conv1d = any(
        t == "Conv1D" for n, t in present.items() if any(n == x or n.endswith("." + x) for x in names)
    )
    # a reward model (model.head score): its new score layer trains in full beside the adapters (peft's SEQ_CLS task
    # adds it to modules_to_save, as TRL recommends)
    score = type(model).__name__.endswith("ForSequenceClassification")
    cfg = LoraConfig(
        exclude_modules=_vision_excluded(model),
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=names,
        modules_to_save=list(lora.train_modules) or None,
        fan_in_fan_out=conv1d,  # GPT-2's Conv1D stores its weight transposed
        # a tied LM head trained in full (train_modules) stays tied to the embedding
        ensure_weight_tying=bool(lora.train_modules)
        and bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False)),
        bias="none",
        task_type="SEQ_CLS" if score else "CAUSAL_LM",
    )
    import warnings

    with warnings.catch_warnings():  # peft asks transformers 5 for a renamed property
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, cfg)


def _vision_excluded(model: Any) -> str | None:
    """A vision-language model's vision tower and projector, as peft's exclude_modules (a regex): adapters go on
    the language model only (model.freeze says what else trains)."""
    import re

    from trainer.model.vision import family

    fam = family(getattr(getattr(model, "config", None), "model_type", None))
    if fam is None:
        return None
    prefixes = sorted({p.rstrip(".") for p in fam.vision_tower + fam.projector})
    return "(" + "|".join(re.escape(p) for p in prefixes) + r")\..*"


def trainable(module: Any) -> tuple[int, int]:
    """(trainable, all) parameters, tied ones once; ZeRO-3 placeholders by their full shape."""
    seen: dict[int, tuple[int, bool]] = {}
    for p in module.parameters():
        n = int(getattr(p, "ds_numel", 0) or p.numel())
        seen[id(p)] = (n, p.requires_grad)
    return sum(n for n, g in seen.values() if g), sum(n for n, _ in seen.values())


def is_peft(module: Any) -> bool:
    return hasattr(module, "peft_config") and hasattr(module, "base_model")


def _trainable_named(module: Any) -> list[tuple[str, Any]]:
    """The trainable parameters under every name they have: a tied weight trained in full (train_modules:
    [lm_head] with tie_word_embeddings) is one parameter that peft's head and embedding wrappers both hold,
    and peft's state dict asks for it under each (named_parameters() keeps only the first name)."""
    return [(n, p) for n, p in module.named_parameters(remove_duplicate=False) if p.requires_grad]


def gather_trainable(module: Any, zero3: bool, is_main: bool) -> dict[str, Any] | None:
    """The trainable parameters, full and on the CPU, on rank 0 (None elsewhere), under every name (a tied
    one under each). At ZeRO-3 every rank takes part in gathering these, and only these (a collective);
    stages 0-2 hold them whole."""
    named = _trainable_named(module)
    if not zero3:
        return {n: p.detach().to("cpu", copy=True) for n, p in named} if is_main else None
    import deepspeed

    unique = list({id(p): p for _, p in named}.values())
    with deepspeed.zero.GatheredParameters(unique, modifier_rank=None):
        return {n: p.detach().to("cpu", copy=True) for n, p in named} if is_main else None


def expected_shapes(module: Any) -> dict[str, tuple[int, ...]]:
    """Full shapes of the trainable parameters under every name (ZeRO-3's placeholders by `ds_shape`)."""
    return {n: tuple(getattr(p, "ds_shape", None) or p.shape) for n, p in _trainable_named(module)}


def verify(state: Mapping[str, Any], expected: Mapping[str, tuple[int, ...]], stepped: bool) -> list[str]:
    """What is wrong with a gathered adapter (names as the module has them); [] when it is sound."""
    import torch

    problems = []
    for name, shape in expected.items():
        t = state.get(name)
        if t is None:
            problems.append(f"{name}: missing")
        elif tuple(t.shape) != tuple(shape):
            problems.append(
                f"{name}: shape {tuple(t.shape)}, expected {tuple(shape)} (a partition, not gathered)"
            )
        elif not torch.isfinite(t).all():
            problems.append(f"{name}: not finite")
        elif (stepped or "lora_B" not in name) and t.numel() and not t.any():
            # B starts at zero (the adapter adds nothing at first); the first applied step with LR > 0 moves it
            problems.append(f"{name}: all zero" + (" after training steps" if stepped else ""))
    return problems


def write(out: Path, module: Any, state: Mapping[str, Any], *, base_name: str | None = None) -> int:
    """peft's adapter files from the gathered trainable parameters: adapter_config.json and
    adapter_model.safetensors (peft's key names). Returns the bytes written."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    sd = get_peft_model_state_dict(module, state_dict=dict(state), save_embedding_layers=False)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "adapter_model.safetensors"))
    cfg = module.peft_config["default"]
    if base_name is not None:
        cfg.base_model_name_or_path = base_name
    cfg.save_pretrained(str(out))
    return sum(p.stat().st_size for p in out.iterdir())


def save(out: Path, module: Any, zero3: bool, is_main: bool, stepped: bool, base_name: str | None) -> int:
    """Every rank (a collective at ZeRO-3): gather the trainable parameters; rank 0 verifies them and
    writes `out` (raising AdapterError, with every problem, when the adapter is not sound)."""
    state = gather_trainable(module, zero3, is_main)
    if not is_main:
        return 0
    problems = verify(state, expected_shapes(module), stepped)
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise AdapterError(
            f"the adapter of this checkpoint failed its verification, so the save fails: {shown}"
        )
    return write(out, module, state, base_name=base_name)
