"""Resume a checkpoint on another number of ranks or another ZeRO stage.

DeepSpeed loads a ZeRO checkpoint only into the same stage and data-parallel size. Otherwise we go
through DeepSpeed's universal checkpoint format (one directory per parameter holding the fp32
weight and both Adam moments), converted once by rank 0 into `<checkpoint>/universal/` while the
other ranks wait, then loaded by every rank. Three gaps in DeepSpeed 0.19 are bridged here:

- stage 0 checkpoints (a plain torch optimizer state) are not covered by `ds_to_universal`: we
  write the universal layout ourselves from the module and optimizer state;
- a universal directory made from stage 1/2 does not load into stage 3 and vice versa (file names,
  flat vs shaped tensors, a missing `step.pt` / `optimizer_state_dict`): `_fix_for_any_target`;
- a stage-3 universal load copies param group 0's hyperparameters (weight decay!) into every
  group: `_restore_group_hparams` puts the saved per-group values back.

Loading into stage 0 turns the universal directory back into a stage-0 checkpoint. Needs a
filesystem that every rank sees (as DeepSpeed's own checkpoints do).
"""

from __future__ import annotations

import argparse
import glob
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("trainer")

DONE = "CONVERTED"


def names_and_aliases(module: Any, groups: list[dict[str, Any]]) -> tuple[list[list[str]], dict[str, str]]:
    """Parameter names per optimizer group (in order), and state-dict keys that alias a parameter
    (tied weights such as lm_head.weight -> transformer.wte.weight). Call before deepspeed.initialize."""
    name_of = {id(p): n for n, p in module.named_parameters()}
    names = [[name_of[id(p)] for p in g["params"]] for g in groups]
    aliases = {
        key: name_of[id(t)]
        for key, t in module.state_dict(keep_vars=True).items()
        if id(t) in name_of and name_of[id(t)] != key
    }
    return names, aliases


def saved_layout(ckpt: Path) -> tuple[int, int]:
    """(ZeRO stage, data-parallel size) a checkpoint was written with."""
    import torch

    files = sorted(glob.glob(str(ckpt / "mp_rank_*_model_states.pt"))) or sorted(
        glob.glob(str(ckpt / "zero_pp_rank_0_mp_rank_*_model_states.pt"))
    )
    if not files:
        raise FileNotFoundError(f"no DeepSpeed model states in {ckpt}")
    sd = torch.load(files[0], map_location="cpu", weights_only=False)
    return int(sd["ds_config"].get("zero_optimization", {}).get("stage", 0)), int(sd["dp_world_size"])


def needs_conversion(src: tuple[int, int], dst: tuple[int, int]) -> bool:
    (s_stage, s_dp), (d_stage, d_dp) = src, dst
    if s_stage == d_stage == 0:
        return False  # stage 0 holds full states: any world size loads it
    return not (s_dp == d_dp and (s_stage == d_stage or {s_stage, d_stage} == {1, 2}))


def load(
    engine: Any, ckpt: Path, names: list[list[str]], aliases: dict[str, str], rank: int, group: Any = None
) -> None:
    """Load `ckpt` (a step directory) into `engine`, converting when stage or world size differ."""
    ds = engine.ds
    src = saved_layout(ckpt)
    dst = (ds.zero_optimization_stage(), ds.dp_world_size)
    if not needs_conversion(src, dst):
        path, _ = ds.load_checkpoint(
            str(ckpt.parent), tag=ckpt.name, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint in {ckpt}")
        return
    torch_states = _uses_torch_optimizer(ds)
    result: list[Any] = [None]
    if rank == 0:
        t0 = time.perf_counter()
        try:
            result = [_convert(ckpt, src[0], dst[0] == 0, names, aliases, torch_states)]
            log.info(
                f"converted {ckpt.name} (stage {src[0]}, {src[1]} ranks) for stage {dst[0]} on {dst[1]} ranks "
                f"in {time.perf_counter() - t0:.1f} s"
            )
        except Exception as e:  # tell the other ranks instead of leaving them waiting
            result = [f"{type(e).__name__}: {e}"]
    if ds.dp_world_size > 1 or dst[1] > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(result, src=0, group=group)
    tag = result[0]
    if not (isinstance(tag, str) and tag.startswith(("universal", "stage0"))):
        raise RuntimeError(f"converting checkpoint {ckpt} failed on rank 0: {tag}")
    if dst[0] == 0:
        ds.load_checkpoint(str(ckpt), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True)
    else:
        ds._config.load_universal_checkpoint = True  # for this one load only (it breaks later loads)
        try:
            ds.load_checkpoint(str(ckpt), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True)
        finally:
            ds._config.load_universal_checkpoint = False
        _restore_group_hparams(ds, ckpt / tag)
    _normalize_steps(ds, torch_states)


def _normalize_steps(ds: Any, torch_states: bool) -> None:
    """Adam's step counter as the live optimizer keeps it: its own tensor per parameter for torch's
    AdamW, an int for DeepSpeed's kernels. DeepSpeed's universal loader hands every parameter the
    same step object; torch increments it in place, so a shared tensor would count once per group."""
    import torch

    opt = getattr(ds, "basic_optimizer", None)
    for st in getattr(opt, "state", {}).values():
        if "step" in st:
            step = float(st["step"])
            st["step"] = torch.tensor(step) if torch_states else int(step)


def _uses_torch_optimizer(ds: Any) -> bool:
    import torch

    opt = getattr(ds, "basic_optimizer", None)
    return isinstance(opt, torch.optim.Optimizer) and type(opt).__module__.startswith("torch.optim")


def _convert(
    ckpt: Path,
    src_stage: int,
    to_stage0: bool,
    names: list[list[str]],
    aliases: dict[str, str],
    torch_states: bool,
) -> str:
    """Rank 0: make (once) the universal directory, and the stage-0 one if needed. Returns the tag."""
    uni = ckpt / "universal"
    if not (uni / DONE).exists():
        shutil.rmtree(uni, ignore_errors=True)
        if src_stage == 0:
            _stage0_to_universal(ckpt, uni, names)
        else:
            _ds_to_universal(ckpt, uni)
            _fix_for_any_target(uni)
        (uni / DONE).touch()
    if not to_stage0:
        return "universal"
    s0 = ckpt / "stage0"
    if not (s0 / DONE).exists():
        shutil.rmtree(s0, ignore_errors=True)
        _universal_to_stage0(uni, s0, names, aliases, torch_states)
        (s0 / DONE).touch()
    return "stage0"


def _ds_to_universal(ckpt: Path, out: Path) -> None:
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    args = argparse.Namespace(
        input_folder=str(ckpt),
        output_folder=str(out),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # plain HF models carry no universal_checkpoint_info
    )
    ds_to_universal(args)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _fix_for_any_target(out: Path) -> None:
    """Make one universal directory loadable by both DeepSpeed's ZeRO-1/2 and ZeRO-3 loaders."""
    import deepspeed
    import torch
    from deepspeed.checkpoint.constants import CAT_DIM, DS_VERSION, OPTIMIZER_STATE_DICT, PARAM, PARAM_GROUPS

    zdir = out / "zero"
    osd_path = zdir / "optimizer_state.pt"
    osd = torch.load(osd_path, weights_only=False)
    mp_files = sorted(out.glob("mp_rank_*_model_states.pt"))
    z3_files = sorted(out.glob("zero_pp_rank_*_mp_rank_*_model_states.pt"))
    ms = torch.load((mp_files or z3_files)[0], map_location="cpu", weights_only=False)
    shapes: dict[str, Any] = {}
    for grp in ms.get("param_shapes") or []:
        shapes.update(grp)
    if OPTIMIZER_STATE_DICT in osd:
        step = next(iter(osd[OPTIMIZER_STATE_DICT]["state"].values()))["step"]
    else:
        steps = list(zdir.glob("*/step.pt"))
        step = torch.load(steps[0], weights_only=False) if steps else None
    for name, shape in shapes.items():
        pdir = zdir / name
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            f = pdir / f"{key}.pt"
            d = torch.load(f, weights_only=False)
            if torch.is_tensor(d):  # ZeRO-3 output: flat tensors; ZeRO-1/2 loaders want shaped ones
                torch.save({PARAM: d.view(shape), CAT_DIM: 0}, f)
        if step is not None and not (pdir / "step.pt").exists():
            torch.save(step, pdir / "step.pt")
    if OPTIMIZER_STATE_DICT not in osd:
        osd[OPTIMIZER_STATE_DICT] = {"state": {0: {"step": step}}, "param_groups": osd[PARAM_GROUPS]}
    osd.setdefault(DS_VERSION, deepspeed.__version__)
    torch.save(osd, osd_path)
    if mp_files and not z3_files:  # the ZeRO-3 loader looks for zero_pp_rank_0_mp_rank_XX_model_states.pt
        for f in mp_files:
            mp = f.name[len("mp_rank_") : len("mp_rank_") + 2]
            _link_or_copy(f, out / f"zero_pp_rank_0_mp_rank_{mp}_model_states.pt")
    if z3_files and not mp_files:  # ...and the ZeRO-1/2 loader for mp_rank_XX_model_states.pt
        for f in z3_files:
            if f.name.startswith("zero_pp_rank_0_"):
                mp = f.name.split("_mp_rank_")[1][:2]
                _link_or_copy(f, out / f"mp_rank_{mp}_model_states.pt")


def _stage0_to_universal(ckpt: Path, out: Path, names: list[list[str]]) -> None:
    """The universal layout from a stage-0 checkpoint (module + torch-style optimizer state)."""
    import deepspeed
    import torch
    from deepspeed.checkpoint.constants import CAT_DIM, DS_VERSION, OPTIMIZER_STATE_DICT, PARAM, PARAM_GROUPS

    zdir = out / "zero"
    zdir.mkdir(parents=True)
    sd = torch.load(ckpt / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    osd, module = sd["optimizer"], sd["module"]
    if len(osd["param_groups"]) != len(names):
        raise RuntimeError(f"{ckpt}: {len(osd['param_groups'])} optimizer groups saved, {len(names)} now")
    groups = []
    step = 0
    for g, group_names in zip(osd["param_groups"], names, strict=True):
        # DeepSpeed's FusedAdam counts steps on the last parameter of a group only: take the max.
        step = max(int(float(osd["state"][i]["step"])) for i in g["params"] if i in osd["state"])
        for i, name in zip(g["params"], group_names, strict=True):
            st = osd["state"][i]
            pdir = zdir / name
            pdir.mkdir()
            torch.save({PARAM: module[name].float().clone(), CAT_DIM: 0}, pdir / "fp32.pt")
            torch.save({PARAM: st["exp_avg"].float().clone(), CAT_DIM: 0}, pdir / "exp_avg.pt")
            torch.save({PARAM: st["exp_avg_sq"].float().clone(), CAT_DIM: 0}, pdir / "exp_avg_sq.pt")
            torch.save(step, pdir / "step.pt")
        groups.append({k: v for k, v in g.items() if k != "params"} | {"params": []})
    torch.save(
        {
            DS_VERSION: deepspeed.__version__,
            PARAM_GROUPS: groups,
            OPTIMIZER_STATE_DICT: {"state": {0: {"step": step}}, "param_groups": groups},
        },
        zdir / "optimizer_state.pt",
    )
    ms = {k: v for k, v in sd.items() if k != "optimizer"}
    ms["optimizer"] = None
    torch.save(ms, out / "mp_rank_00_model_states.pt")
    _link_or_copy(out / "mp_rank_00_model_states.pt", out / "zero_pp_rank_0_mp_rank_00_model_states.pt")


def _universal_to_stage0(
    uni: Path, out: Path, names: list[list[str]], aliases: dict[str, str], torch_states: bool
) -> None:
    """A stage-0 checkpoint (module + torch-style optimizer state) from a universal directory."""
    import torch
    from deepspeed.checkpoint.constants import PARAM, PARAM_GROUPS

    zdir = uni / "zero"
    ms = torch.load(
        sorted(uni.glob("*mp_rank_00_model_states.pt"))[0], map_location="cpu", weights_only=False
    )
    saved_groups = torch.load(zdir / "optimizer_state.pt", weights_only=False)[PARAM_GROUPS]
    state, groups, module, idx = {}, [], {}, 0
    for group_names, pg in zip(names, saved_groups, strict=True):
        ids = []
        for name in group_names:

            def part(key: str, name: str = name) -> Any:
                return torch.load(zdir / name / f"{key}.pt", weights_only=False)

            module[name] = part("fp32")[PARAM]
            step = int(part("step"))
            state[idx] = {
                "step": torch.tensor(float(step)) if torch_states else step,
                "exp_avg": part("exp_avg")[PARAM],
                "exp_avg_sq": part("exp_avg_sq")[PARAM],
            }
            ids.append(idx)
            idx += 1
        groups.append({k: v for k, v in pg.items() if k != "params"} | {"params": ids})
    full = dict(ms["module"])
    full.update(module)
    for alias, target in aliases.items():  # tied weights point at their parameter again
        if target in module:
            full[alias] = module[target]
    ms["module"], ms["optimizer"], ms["param_shapes"] = full, {"state": state, "param_groups": groups}, None
    out.mkdir(parents=True, exist_ok=True)
    torch.save(ms, out / "mp_rank_00_model_states.pt")


def _restore_group_hparams(ds: Any, uni: Path) -> None:
    """Undo DeepSpeed's stage-3 universal load copying group 0's hyperparameters into every group."""
    import torch
    from deepspeed.checkpoint.constants import PARAM_GROUPS

    saved = torch.load(uni / "zero" / "optimizer_state.pt", weights_only=False)[PARAM_GROUPS]
    groups = ds.optimizer.param_groups
    if len(saved) != len(groups):
        raise RuntimeError(f"{uni}: {len(saved)} optimizer groups saved, {len(groups)} now")
    for g, s in zip(groups, saved, strict=True):
        for k, v in s.items():
            if k not in ("params", "step"):
                g[k] = v
