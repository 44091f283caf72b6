"""The optimizer state of a stage-0 (no ZeRO) DeepSpeed checkpoint, in each layout DeepSpeed writes.

Without ZeRO, DeepSpeed saves the optimizer state inside `mp_rank_00_model_states.pt` (key
`optimizer`), in one of three layouts depending on precision and optimizer:

- `torch`: fp32 training: the optimizer's own state dict (`state` per parameter index,
  `param_groups`); the fp32 weights are the module's.
- `unfused`: bf16 or fp16 with a non-fused optimizer (torch's AdamW, our CPU default):
  DeepSpeed's FP16_UnfusedOptimizer wraps it: loss-scaler fields, `optimizer_state_dict` (torch's
  layout, over fp32 master copies) and `fp32_groups`, the master weights per group and parameter.
- `fused`: bf16 or fp16 with DeepSpeed's FusedAdam (the GPU default): FP16_Optimizer flattens each
  group into one tensor: `fp32_groups_flat` (the masters), and `optimizer_state_dict` whose state
  has one entry per group with flat moments.

In the mixed-precision layouts the module holds bf16/fp16 copies; the fp32 master weights are the
optimizer's. `read` turns any layout into per-parameter fp32 weights, Adam moments and step; `build`
writes them back in the layout of the engine that will load them (its `kind` and loss-scaler fields
come from that engine's live optimizer).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

OPTIMIZER_STATE_DICT = "optimizer_state_dict"  # deepspeed.checkpoint.constants.OPTIMIZER_STATE_DICT
MASTER_KEYS = ("fp32_groups", "fp32_groups_flat")
KINDS = ("torch", "unfused", "fused")


@dataclass
class ParamState:
    """One parameter's full optimizer state in fp32."""

    fp32: Any  # master weight
    state: dict[str, Any]  # the optimizer's tensors for it, by name (Adam: exp_avg, exp_avg_sq)
    step: int


def _tensors(st: Mapping[str, Any]) -> dict[str, Any]:
    """The per-parameter tensors of an optimizer's state entry (its step counter aside)."""
    import torch

    return {k: v for k, v in st.items() if k != "step" and torch.is_tensor(v) and v.dim() > 0}


def kind_of(osd: Mapping[str, Any]) -> str:
    """Which layout a saved stage-0 optimizer state has."""
    if "fp32_groups_flat" in osd:
        return "fused"
    if "fp32_groups" in osd:
        return "unfused"
    if "state" in osd and "param_groups" in osd:
        return "torch"
    raise ValueError(
        f"unknown stage-0 optimizer state layout (keys: {', '.join(map(str, osd))}); expected torch's "
        "(state, param_groups) or DeepSpeed's FP16_Optimizer / FP16_UnfusedOptimizer"
    )


def live_kind(optimizer: Any) -> str:
    """The layout the engine's optimizer (ds.optimizer) saves and loads at stage 0."""
    name = type(optimizer).__name__
    if name == "FP16_Optimizer":
        return "fused"
    if name == "FP16_UnfusedOptimizer":
        return "unfused"
    return "torch"


def wrapper_fields(optimizer: Any) -> dict[str, Any]:
    """A live FP16 wrapper's own fields (loss scaler, clip_grad), to write into a converted state."""
    if live_kind(optimizer) == "torch":
        return {}
    sd = optimizer.state_dict()
    return {k: v for k, v in sd.items() if k != OPTIMIZER_STATE_DICT and k not in MASTER_KEYS}


def _step(value: Any) -> int:
    return int(float(value))


def read(
    osd: Mapping[str, Any], module: Mapping[str, Any], names: list[list[str]]
) -> tuple[dict[str, ParamState], list[dict[str, Any]]]:
    """Per-parameter fp32 state and each group's hyperparameters (without `params`) from a saved
    stage-0 optimizer state in any layout. `names`: parameter names per group, in the optimizer's
    order; `module`: the saved module state dict (for the fp32 weights and the shapes)."""
    kind = kind_of(osd)
    inner = osd if kind == "torch" else osd[OPTIMIZER_STATE_DICT]
    groups = inner["param_groups"]
    if len(groups) != len(names):
        raise ValueError(f"{len(groups)} optimizer groups saved, {len(names)} in the model now")
    out: dict[str, ParamState] = {}
    for gi, (group, group_names) in enumerate(zip(groups, names, strict=True)):
        if kind == "fused":
            out.update(
                _read_flat(
                    osd["fp32_groups_flat"][gi],
                    inner["state"][group["params"][0]],
                    group,
                    group_names,
                    module,
                )
            )
            continue
        ids = group["params"]
        if len(ids) != len(group_names):
            raise ValueError(f"group {gi}: {len(ids)} parameters saved, {len(group_names)} in the model now")
        # DeepSpeed's FusedAdam counts steps on the last parameter of a group only: take the max.
        step = max((_step(inner["state"][i].get("step", 0)) for i in ids if i in inner["state"]), default=0)
        for j, (i, name) in enumerate(zip(ids, group_names, strict=True)):
            master = module[name] if kind == "torch" else osd["fp32_groups"][gi][j]
            state = {k: v.float().clone() for k, v in _tensors(inner["state"].get(i, {})).items()}
            out[name] = ParamState(master.float().clone(), state, step)
    return out, [{k: v for k, v in g.items() if k != "params"} for g in groups]


def _read_flat(
    master: Any, st: Mapping[str, Any], group: Mapping[str, Any], names: list[str], module: Mapping[str, Any]
) -> dict[str, ParamState]:
    """One group of FP16_Optimizer's layout: the master weights and every state tensor flat, the
    parameters one after the other in the group's order."""
    step = _step(st.get("step", group.get("step", 0)))  # an optimizer may count none (SGD)
    flats = _tensors(st)
    out, offset = {}, 0
    for name in names:
        n, shape = module[name].numel(), module[name].shape

        def part(flat: Any, offset: int = offset, n: int = n, shape: Any = shape) -> Any:
            return flat[offset : offset + n].view(shape).float().clone()

        out[name] = ParamState(part(master), {k: part(f) for k, f in flats.items()}, step)
        offset += n
    if offset != master.numel():
        raise ValueError(f"a group of {master.numel()} flat elements saved, {offset} in the model now")
    return out


def build(
    kind: str,
    params: Mapping[str, ParamState],
    names: list[list[str]],
    hparams: list[dict[str, Any]],
    *,
    torch_states: bool,
    fields: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A stage-0 optimizer state in layout `kind` (see the module docstring). `torch_states`: the
    step as torch's optimizers keep it (a tensor) rather than an int; `fields`: the wrapper's own
    fields (loss scaler, clip_grad) taken from the live engine (`wrapper_fields`)."""
    import torch

    def step_value(step: int) -> Any:
        return torch.tensor(float(step)) if torch_states else step

    state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    if kind == "fused":
        flat_masters = []
        for gi, (group_names, hp) in enumerate(zip(names, hparams, strict=True)):
            ps = [params[n] for n in group_names]
            step = max((p.step for p in ps), default=0)
            keys = ps[0].state if ps else {}
            state[gi] = {"step": step_value(step)} | {
                k: torch.cat([p.state[k].reshape(-1) for p in ps]) for k in keys
            }
            flat_masters.append(torch.cat([p.fp32.reshape(-1) for p in ps]))
            groups.append({**hp, "params": [gi]} | ({"step": step} if "step" in hp else {}))
        inner = {"state": state, "param_groups": groups}
        return {**(fields or {}), OPTIMIZER_STATE_DICT: inner, "fp32_groups_flat": flat_masters}
    idx = 0
    masters: list[list[Any]] = []
    for group_names, hp in zip(names, hparams, strict=True):
        ids, group_masters = [], []
        for name in group_names:
            p = params[name]
            state[idx] = {"step": step_value(p.step), **p.state}
            group_masters.append(p.fp32)
            ids.append(idx)
            idx += 1
        groups.append({**hp, "params": ids})
        masters.append(group_masters)
    inner = {"state": state, "param_groups": groups}
    if kind == "torch":
        return inner
    if kind == "unfused":
        return {**(fields or {}), OPTIMIZER_STATE_DICT: inner, "fp32_groups": masters}
    raise ValueError(f"unknown stage-0 optimizer state layout '{kind}'; expected one of {', '.join(KINDS)}")


def master_weights(
    sd: Mapping[str, Any], names: list[list[str]], aliases: Mapping[str, str]
) -> dict[str, Any]:
    """The fp32 weights of a stage-0 checkpoint (`mp_rank_00_model_states.pt`, loaded): in a
    mixed-precision layout the optimizer's masters (tied aliases point at them too), else the
    module's; entries the optimizer does not hold (buffers, frozen weights) from the module."""
    out = {k: v.float() for k, v in sd["module"].items()}
    osd = sd.get("optimizer")
    if not osd or kind_of(osd) == "torch":
        return out
    params, _ = read(osd, sd["module"], names)
    out.update({name: p.fp32 for name, p in params.items()})
    out.update({alias: params[target].fp32 for alias, target in aliases.items() if target in params})
    return out
