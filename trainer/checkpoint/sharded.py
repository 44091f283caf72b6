"""The whole weights of a checkpoint saved under tensor or expert parallelism (export.py's `consolidated_state_dict`
calls `whole_weights` where reshard.py's `saved_axes` says a checkpoint holds shards).

- Tensor parallelism: each tensor-parallel rank's files are read as a checkpoint of their own (stage 0: stage0.py's
  master weights; stages 1-3: DeepSpeed's zero_to_fp32 over the data-parallel partitions), and the ranks' shards
  joined as the universal-checkpoint metadata AutoTP attaches to the model states says: replicated, by rows (the
  row-parallel output projections: dimension 1), else by columns (dimension 0). (DeepSpeed's universal
  conversion leaves a tied head one rank's shard at ZeRO-1 and stops on a ZeRO-3 checkpoint: review of issue 70.)
- Expert parallelism: DeepSpeed's universal checkpoint (`ds_to_universal`) merges AutoEP's experts from every
  expert-parallel rank; its `zero/<name>/fp32.pt` are the master weights.

AutoEP's layers name a mixture's experts their own way; `transformers_names` gives them transformers' names
back (its fused gate_up_proj is the gate's rows, then the up projection's: w1 then w3 in AutoEP's terms).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.checkpoint import universal

Layout = tuple[
    list[list[str]], dict[str, str]
]  # parameter names per optimizer group, tied aliases (export.py)


def whole_weights(
    ckpt: Path, stage: int, layout: Layout, read: Callable[[Path, int, Layout], dict[str, Any]]
) -> dict[str, Any]:
    """Every parameter of `ckpt` whole, in fp32, under transformers' names. `read`: export.py's reader of a
    checkpoint of one tensor-parallel rank (its stage-0 master weights, or zero_to_fp32's)."""
    import torch

    from trainer.checkpoint.reshard import model_state_files

    files = model_state_files(ckpt)
    # tensor parallelism: each rank's shards whole over the data-parallel ranks, then joined
    if len(files) > 1:
        info = (
            torch.load(files[0], map_location="cpu", weights_only=False).get("universal_checkpoint_info")
            or {}
        )
        parts = [one_rank(ckpt, r, stage, layout, read) for r in range(len(files))]
        # a tied head is an alias some ranks' files name and others' do not: the parameter is its embedding's
        names = [k for k in parts[0] if all(k in p for p in parts)]
        out = {k: universal.joined([p[k] for p in parts], k, info) for k in names}
        out.update(
            {alias: out[name] for alias, name in layout[1].items() if alias not in out and name in out}
        )
        return transformers_names(out)
    return transformers_names(_expert_parallel(ckpt, files[0]))


def _expert_parallel(ckpt: Path, states: str) -> dict[str, Any]:
    """Expert parallelism: DeepSpeed's universal checkpoint merges AutoEP's experts from every expert-parallel
    rank; its fp32 weights, ZeRO-3's flat ones shaped by the model states' shapes (the experts' first dimension
    whole: every expert-parallel rank's)."""
    import torch

    from trainer.checkpoint.universal import ds_to_universal

    shapes = {k: v for group in torch.load(states, map_location="cpu", weights_only=False).get("param_shapes") or []
              for k, v in group.items()}  # fmt: skip
    weights = {}
    with tempfile.TemporaryDirectory(prefix="export-universal-") as tmp:
        out = Path(tmp) / "universal"
        ds_to_universal(ckpt, out, workers=2)
        for d in sorted((out / "zero").iterdir()):
            if (d / "fp32.pt").is_file():
                t = torch.load(d / "fp32.pt", map_location="cpu", weights_only=False)
                t = (t["param"] if isinstance(t, dict) else t).float()
                shape = shapes.get(d.name)
                weights[d.name] = t.view(-1, *shape[1:]) if t.dim() == 1 and shape and len(shape) > 1 else t
    return weights


def one_rank(
    ckpt: Path, r: int, stage: int, layout: Layout, read: Callable[[Path, int, Layout], dict[str, Any]],
    staged: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """Model-parallel rank `r`'s weights whole over its data-parallel ranks (a tensor-parallel rank; `staged`: a
    pipeline stage): its files (`*mp_rank_RR*`) seen as a checkpoint of one rank (links named `mp_rank_00`), read as
    any checkpoint of that stage. A stage's model states hold no module (its weights are the layer files): an
    empty one in their copy, as zero_to_fp32 reads the module's buffers."""
    import torch

    mine = f"mp_rank_{r:02d}"
    with tempfile.TemporaryDirectory(prefix="export-rank-") as tmp:
        step = Path(tmp) / ckpt.name
        step.mkdir()
        for f in ckpt.iterdir():
            if mine not in f.name:
                continue
            if staged and f.name == f"{mine}_model_states.pt":
                states = torch.load(f, map_location="cpu", weights_only=False)
                torch.save(
                    {**states, "module": states.get("module") or {}}, step / "mp_rank_00_model_states.pt"
                )
            else:
                os.symlink(f, step / f.name.replace(mine, "mp_rank_00"))
        return {k: v.float() for k, v in read(step, stage, layout).items()}


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
