"""The whole weights of a checkpoint saved under tensor or expert parallelism (export.py's `consolidated_state_dict`
calls `whole_weights` where reshard.py's `saved_axes` says a checkpoint holds shards).

- ZeRO stages 1-3: DeepSpeed's universal checkpoint (`ds_to_universal`, the conversion a resume at another degree
  makes) merges each parameter's shards from the universal-checkpoint metadata AutoTP attaches to the model
  states, and AutoEP's experts from every expert-parallel rank; its `zero/<name>/fp32.pt` are the master weights.
- ZeRO stage 0: each tensor-parallel rank's file holds its shards whole (stage0.py reads the master weights of
  each), joined as that metadata says: replicated, by rows (the row-parallel output projections: dimension 1),
  else by columns (dimension 0).

AutoEP's layers name a mixture's experts their own way; `transformers_names` gives them transformers' names
back (its fused gate_up_proj is the gate's rows, then the up projection's: w1 then w3 in AutoEP's terms).
"""

from __future__ import annotations

import glob
import re
import tempfile
from pathlib import Path
from typing import Any


def whole_weights(ckpt: Path, stage: int, layout: tuple[list[list[str]], dict[str, str]]) -> dict[str, Any]:
    """Every parameter of `ckpt` whole, in fp32, under transformers' names."""
    import torch

    if stage == 0:
        from trainer.checkpoint import stage0

        files = sorted(glob.glob(str(ckpt / "mp_rank_*_model_states.pt")))
        states = [torch.load(f, map_location="cpu", weights_only=False) for f in files]
        info = states[0].get("universal_checkpoint_info") or {}
        parts = [stage0.master_weights(sd, *layout) for sd in states]
        return transformers_names({k: _joined([p[k] for p in parts], k, info) for k in parts[0]})
    from trainer.checkpoint.universal import ds_to_universal

    with tempfile.TemporaryDirectory(prefix="export-universal-") as tmp:
        out = Path(tmp) / "universal"
        ds_to_universal(ckpt, out, workers=2)
        weights = {}
        for d in sorted((out / "zero").iterdir()):
            if (d / "fp32.pt").is_file():
                t = torch.load(d / "fp32.pt", map_location="cpu", weights_only=False)
                weights[d.name] = (t["param"] if isinstance(t, dict) else t).float()
    return transformers_names(weights)


def _joined(shards: list[Any], name: str, info: dict[str, Any]) -> Any:
    import torch

    def matches(key: str) -> bool:
        return any(re.match(p, name) for p in info.get(key, ()))

    if len(shards) == 1 or matches("tp_replicated_parameter_patterns") or shards[0].dim() == 0:
        return shards[0]
    dim = 1 if matches("parameter_with_row_parallelism_patterns") and shards[0].dim() > 1 else 0
    return torch.cat(shards, dim=dim)


def transformers_names(weights: dict[str, Any]) -> dict[str, Any]:
    """AutoEP's expert and router names back to transformers' (Mixtral, Qwen3-MoE): mlp.router.gate.weight ->
    mlp.gate.weight; mlp.experts.w1 and w3 -> mlp.experts.gate_up_proj (the gate's rows, then the up
    projection's); w2 -> down_proj. Other names pass as they are."""
    import torch

    out = {}
    for name, t in weights.items():
        if name.endswith(".mlp.gate.gate.weight") and name.replace(".gate.gate.", ".router.gate.") in weights:
            continue  # AutoEP's layer also names its router's gate as its own `gate`: the same tensor
        if name.endswith(".mlp.router.gate.weight"):
            out[name.replace(".mlp.router.gate.", ".mlp.gate.")] = t
        elif name.endswith(".mlp.experts.w1"):
            out[name[: -len("w1")] + "gate_up_proj"] = torch.cat([t, weights[name[:-2] + "w3"]], dim=1)
        elif name.endswith(".mlp.experts.w2"):
            out[name[: -len("w2")] + "down_proj"] = t
        elif not name.endswith(".mlp.experts.w3"):
            out[name] = t
    return out
