"""What the planner reads of a model's shape (trainer/strategy/planning/layers.py counts its layers from it):
from the transformers config (`shape`: sizes, head sizes, each layer's window, DeepSeek's latent attention) and
from the module built on the meta device (`structure`: how queries and keys are normalised, the experts, tied and
looked-up embeddings) -- the family's own code, not a guess from its name."""

from __future__ import annotations

import contextlib
from typing import Any

from trainer.model.spec import positions
from trainer.strategy.planning.candidates import Experts


def shape(cfg: Any) -> dict[str, Any]:
    """What the config says of the model's shape (a multimodal config: its text model's)."""
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg

    def first(*names: str) -> Any:
        for n in names:
            v = getattr(cfg, n, None)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
        return None

    latent = first("kv_lora_rank")
    head_dim, v_head_dim = first("head_dim"), None
    if (
        latent
    ):  # DeepSeek's latent attention: heads of nope + rope for queries and keys, v_head_dim for values
        head_dim = (first("qk_nope_head_dim") or 0) + (first("qk_rope_head_dim") or 0) or None
        v_head_dim = first("v_head_dim")
    windows = _layer_windows(cfg)
    return {
        "hidden": first("hidden_size", "n_embd", "d_model"),
        "layers": first("num_hidden_layers", "n_layer", "num_layers"),
        "heads": first("num_attention_heads", "n_head"),
        "vocab": first("vocab_size"),
        "positions": positions(cfg),
        "model_type": getattr(cfg, "model_type", None),
        "kv_heads": first("num_key_value_heads"),
        "window": min((w for w in windows if w), default=None),
        "head_dim": head_dim,
        "v_head_dim": v_head_dim,
        "layer_windows": windows,
        "activation": next(
            (
                a
                for a in (
                    getattr(cfg, n, None) for n in ("hidden_act", "hidden_activation", "activation_function")
                )
                if isinstance(a, str)
            ),
            None,
        ),  # fmt: skip
        "latent": (first("q_lora_rank") or 0, latent, first("qk_rope_head_dim") or 0) if latent else None,
        "router_logits": getattr(cfg, "output_router_logits", False) is True,
    }


def _layer_windows(cfg: Any) -> tuple[int, ...]:
    """Each layer's sliding window or attention chunk (0: full attention), as transformers' caches read them
    (cache_utils.get_layer_types_and_kwargs: the config's layer_types, else its sliding_window on every layer)."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        _, kwargs = get_layer_types_and_kwargs(cfg)
        return tuple(max(0, int(k.get("sliding_window") or 0)) for k in kwargs)  # a window of 0 or less: none
    except (ImportError, AttributeError, TypeError, ValueError):
        window = (
            getattr(cfg, "sliding_window", None)
            if getattr(cfg, "use_sliding_window", True) is not False
            else None
        )
        layers = getattr(cfg, "num_hidden_layers", None) or 0
        return (int(window),) * layers if isinstance(window, int) else ()


def structure(module: Any, cfg: Any) -> dict[str, Any]:
    """What the module says of the layers' shape: how queries and keys are normalised, the experts, tied
    embeddings (read off the meta module: the family's own code, not its name)."""
    import torch

    lists = [m for m in module.modules() if isinstance(m, torch.nn.ModuleList)]
    layers = list(max(lists, key=len)) if lists else []
    qk_norm, qkv_bias = None, 0
    for layer in layers[:1]:
        # the query, key and value projections' biases of a layer (Qwen2's), elements: AutoTP divides them too
        qkv_bias = sum(getattr(getattr(m, "bias", None), "numel", lambda: 0)() for n, m in layer.named_modules()
                       if n.endswith(("q_proj", "k_proj", "v_proj")))  # fmt: skip
        norm = next((m for n, m in layer.named_modules() if n.endswith(("q_norm", "q_layernorm"))), None)
        weight = getattr(norm, "weight", None)
        if weight is not None:
            head = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
            size = getattr(head, "head_dim", None)
            qk_norm = "head" if weight.numel() == size else "projection"
    head = decoder = None
    with contextlib.suppress(AttributeError, TypeError, NotImplementedError):
        head = module.get_output_embeddings()
    with contextlib.suppress(AttributeError, TypeError, NotImplementedError):
        decoder = module.get_decoder()
    head_weight = getattr(head, "weight", None)
    embeddings = {id(m.weight): m.weight for m in module.modules() if isinstance(m, torch.nn.Embedding)}
    return {
        "qk_norm": qk_norm, "qkv_bias": qkv_bias, "tied": head_weight is not None and id(head_weight) in embeddings,
        "experts": _experts(layers, cfg), "idle": _idle(module, decoder, head_weight, embeddings),
    }  # fmt: skip


def _idle(module: Any, decoder: Any, head_weight: Any, embeddings: dict[int, Any]) -> int:
    """Parameters a text token never multiplies by: embeddings that are only looked up (an untied input
    embedding, positions) and what lies outside the text decoder and its head (a vision tower, a projector)."""
    lookups = sum(w.numel() for w in embeddings.values() if w is not head_weight)
    if decoder is None or decoder is module:
        return lookups
    text = {id(p) for p in decoder.parameters()} | ({id(head_weight)} if head_weight is not None else set())
    outside = {id(p): p.numel() for p in module.parameters() if id(p) not in text}
    return lookups + sum(n for key, n in outside.items() if key not in embeddings)


def _experts(layers: list[Any], cfg: Any) -> Experts | None:
    """A mixture of experts' facts: top-k of how many routed experts, their width, the layers that have them
    and the shared experts' width (None for a dense model)."""
    from trainer.model.experts import ROUTED, routing

    found = routing(cfg)
    if found is None:
        return None
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    k, e = found
    moe = sum(any(ROUTED.search(n) for n, _ in layer.named_parameters()) for layer in layers)
    width = getattr(text, "moe_intermediate_size", None)
    width = getattr(text, "intermediate_size", None) if width is None else width  # Mixtral, gpt-oss: theirs
    shared = getattr(text, "shared_expert_intermediate_size", None) or (
        (getattr(text, "n_shared_experts", None) or 0) * (getattr(text, "moe_intermediate_size", None) or 0)
    )
    return Experts(routed=e, per_token=k, width=int(width or 0), layers=moe, shared_width=int(shared or 0))
