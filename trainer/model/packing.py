"""data.packing for a model family, checked by this project itself rather than listed by hand.

Packed fine-tuning examples are kept apart only by their position ids restarting at each example:
transformers then builds per-example causal masks (no attention mask, no cache). Whether a model
family does that is checked here: a small model of the family (the run's config with its layers,
widths and vocabulary shrunk, its attention kinds, sliding windows and other settings kept) trains on
one packed row of two short examples, and the loss and gradients must equal those of the two
examples run one by one (fp32, CPU). A second forward without the restarting positions must differ
(the check could fail). The verdict is cached per model type, attention kernel, transformers version
and the config's fields, in `data.cache_dir/packing/`, so a family is checked once per machine.
A family whose layers keep state across positions (recurrent or linear-attention hybrids) fails:
packing is refused there with the measured difference."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
from pathlib import Path
from typing import Any

from trainer.common.files import write_atomic

VOCAB = 96
MAX_LAYERS = 8
LENGTHS, PROMPTS = (11, 7), (4, 2)  # two examples: tokens, and how many of them are prompt
TOLERANCE = {"loss": 1e-5, "grads": 1e-4}  # relative: the loss, the gradients' largest difference / largest


def _set(cfg: Any, name: str, value: Any) -> None:
    """Set a config field by its standard name (attribute_map gives gpt2's n_embd for hidden_size...)."""
    with contextlib.suppress(AttributeError, TypeError, ValueError):
        setattr(cfg, name, value)


def shrunk(config: Any) -> Any:
    """`config` small enough to run in a second on a CPU: width 64, 4 heads of 16 (2 of them key/value
    heads where the family groups them), a vocabulary of VOCAB; its first MAX_LAYERS layers kept (which
    of them attend and which are recurrent or convolutional is what the check is about: hybrids repeat
    their pattern within 8), every other field kept, but dropout (off) and sliding windows (6 tokens,
    so that the window bites inside the examples)."""
    cfg = copy.deepcopy(config)
    layers = getattr(cfg, "num_hidden_layers", None)
    if isinstance(layers, int) and layers > MAX_LAYERS:
        _set(cfg, "num_hidden_layers", MAX_LAYERS)
        if isinstance(getattr(cfg, "layer_types", None), list):
            _set(cfg, "layer_types", cfg.layer_types[:MAX_LAYERS])
    for name, value in (("hidden_size", 64), ("num_attention_heads", 4), ("intermediate_size", 128),
                        ("vocab_size", VOCAB)):  # fmt: skip
        _set(cfg, name, value)
    mla = isinstance(getattr(cfg, "kv_lora_rank", None), int)  # multi-head latent attention (DeepSeek):
    for name, value in (("num_key_value_heads", 4 if mla else 2), ("head_dim", 16), ("moe_intermediate_size", 32),
                        ("shared_expert_intermediate_size", 32)):  # its own head sizes, a key/value head each  # fmt: skip
        if getattr(cfg, name, None) is not None and not (mla and name == "head_dim"):
            _set(cfg, name, value)
    for name, cap in (("num_experts", 4), ("num_local_experts", 4), ("num_experts_per_tok", 2)):
        if isinstance(getattr(cfg, name, None), int):
            _set(cfg, name, min(getattr(cfg, name), cap))
    if isinstance(getattr(cfg, "sliding_window", None), int):
        _set(cfg, "sliding_window", min(cfg.sliding_window, 6))
    for name, value in list(vars(cfg).items()):
        if isinstance(value, float) and (name.endswith("dropout") or name.endswith("pdrop")):
            _set(cfg, name, 0.0)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value >= VOCAB:
            _set(cfg, name, {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}[name])
        elif isinstance(value, list):
            _set(cfg, name, [v if v < VOCAB else 2 for v in value])
    return cfg


def _rows() -> tuple[list[list[int]], list[list[int]]]:
    import torch

    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]
    labels = [[-100] * p + x[p:] for x, p in zip(ids, PROMPTS, strict=True)]
    return ids, labels


def measure(config: Any, attn: str | None) -> dict[str, Any]:
    """Relative differences of a packed row against its examples one by one: loss, gradients, and the
    second example's logits without restarting positions (which must differ: the check can fail)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    kwargs = {"attn_implementation": attn} if attn else {}
    model = AutoModelForCausalLM.from_config(shrunk(config), **kwargs).float().train()
    ids, labels = _rows()
    row = torch.tensor([sum(ids, [])])
    lab = torch.tensor([sum(labels, [])])
    pos = torch.tensor([sum((list(range(n)) for n in LENGTHS), [])])

    def grads() -> Any:
        out = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        model.zero_grad()
        return out

    packed = model(input_ids=row, labels=lab, position_ids=pos, use_cache=False).loss
    packed.backward()
    g_packed = grads()
    counts = [sum(x != -100 for x in lb[1:]) for lb in labels]
    alone = sum(
        model(input_ids=torch.tensor([x]), labels=torch.tensor([lb]), use_cache=False).loss * n
        for x, lb, n in zip(ids, labels, counts, strict=True)
    ) / sum(counts)
    alone.backward()
    g_alone = grads()
    with torch.no_grad():  # the second example's logits, alone and after the first without reset positions
        second = model(input_ids=torch.tensor([ids[1]]), use_cache=False).logits[0]
        crossed = model(input_ids=row, use_cache=False).logits[0, LENGTHS[0] :]
    return {
        "kernel": getattr(model.config, "_attn_implementation", attn),
        "loss": abs(packed.item() - alone.item()) / abs(alone.item()),
        "grads": ((g_packed - g_alone).abs().max() / g_alone.abs().max()).item(),
        "crossed": ((crossed - second).abs().max() / second.abs().max()).item(),
    }


def verdict(
    config: Any,
    attn: str | None,
    cache_dir: str | Path | None = None,
    measure_fn: Any = None,
    label: str = "",
    version: int = 0,
) -> dict[str, Any]:
    """{"packs": bool, "why": str, the differences}: whether packed rows train as their examples one by
    one for this config's family under `attn` (eager or sdpa; otherwise the family's default kernel on
    the CPU). flash_attention_2 reads packed sequences from the position ids only in a batch of one
    row (transformers' `_is_packed_sequence`): the engine flattens each fine-tuning micro batch into
    one row for it (trainer/engine.py), and the check runs the family's default CPU kernel. `measure_fn` and
    `label`: another measurement of the same differences (trainer/model/vision_packing.py: rows with images) and
    the words that name it; `version`: that measurement's, in the cache's key (a changed one is judged again)."""
    import transformers

    kernel = attn if attn in ("eager", "sdpa") else None  # None: the family's default on this CPU
    fields = {k: v for k, v in config.to_diff_dict().items() if not k.startswith("_")}
    versions = [version] if version else []
    key = json.dumps(
        [kernel, transformers.__version__, fields, label, *versions], sort_keys=True, default=str
    )
    path = None
    if cache_dir is not None:
        path = (
            Path(cache_dir).expanduser() / "packing" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
        )
        with contextlib.suppress(OSError, ValueError):
            return json.loads(path.read_text())
    what = f"model type '{config.model_type}' " + (label or f"with {kernel or 'its default'} attention")
    try:
        d = (measure_fn or measure)(config, kernel)
    except Exception as e:  # noqa: BLE001 (a family whose small model cannot be built or run)
        out = {"packs": False, "why": f"{what}: the check could not run ({type(e).__name__}: {str(e)[:200]})"}
    else:
        what = f"model type '{config.model_type}' " + (label or f"with {d['kernel']} attention")
        ok = d["loss"] <= TOLERANCE["loss"] and d["grads"] <= TOLERANCE["grads"] and d["crossed"] > 1e-3
        shown = f"loss {d['loss']:.1e}, gradients {d['grads']:.1e} relative" + (
            f", {d['kernel']} attention" if label else ""
        )
        why = (
            f"{what}: a packed row trains as its examples one by one ({shown})"
            if ok
            else f"{what}: a packed row does not train as its examples one by one ({shown}; tolerance "
            f"{TOLERANCE['loss']:g} and {TOLERANCE['grads']:g})"
        )
        out = {"packs": ok, "why": why, **d}
    if path is not None and "could not run" not in out["why"]:  # an error may pass: measure again next time
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(out))
    return out
