"""The conversions between checkpoint layouts that reshard.py runs in its conversion process:
DeepSpeed's ZeRO checkpoints to its universal format (`ds_to_universal`, made loadable by both the
ZeRO-1/2 and the ZeRO-3 loaders), stage-0 checkpoints (trainer/checkpoint/stage0.py's optimizer layouts)
to the universal format, and a universal directory back to a stage-0 checkpoint in the layout of the
engine that loads it.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from trainer.checkpoint import stage0


def parallel(fn: Callable[[Any], Any], items: Iterable[Any], workers: int) -> list[Any]:
    """fn over items in threads (file reads and writes release the GIL)."""
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(fn, items))


def ds_to_universal(ckpt: Path, out: Path, workers: int, info: dict[str, Any] | None = None) -> None:
    """DeepSpeed's conversion of the checkpoint's own files: it lists its input folder recursively, so it reads a view
    of the step directory's files (links), not the directories made beside them (stage0-*, stagesN-*: their model
    states would count as the checkpoint's; review of issue 71). The view is a hidden directory in the checkpoint
    (reshard.py's leftovers prefix), removed after. `info`: the universal-checkpoint metadata every model-states
    file is given in the view (copies), where DeepSpeed reads the first file's alone and the checkpoint's files each
    hold their own (3D: a stage's tensor-parallel patterns in its own file; stages.tensor_parallel_info)."""
    import tempfile

    import torch
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    shards = len(glob.glob(str(ckpt / "*_optim_states.pt")))
    view = Path(tempfile.mkdtemp(prefix=".convert-tmp-view-", dir=ckpt))
    try:
        for f in ckpt.iterdir():
            if (
                info is not None
                and f.is_file()
                and f.name.startswith("mp_rank_")
                and f.name.endswith("_model_states.pt")
            ):
                states = torch.load(f, map_location="cpu", weights_only=False)
                torch.save({**states, "universal_checkpoint_info": info}, view / f.name)
            elif f.is_file() and not f.name.startswith("."):
                os.symlink(f.resolve(), view / f.name)
        args = argparse.Namespace(
            input_folder=str(view),
            output_folder=str(out),
            num_extract_workers=max(1, min(workers, shards)),
            num_merge_workers=max(1, workers // 2),  # merging holds whole parameters: fewer at once
            keep_temp_folder=False,
            strict=True,
            inject_missing_state=True,  # plain HF models carry no universal_checkpoint_info
        )
        ds_to_universal(args)
    finally:
        shutil.rmtree(view, ignore_errors=True)


def link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def fix_for_any_target(out: Path) -> None:
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
        for f in sorted(pdir.glob("*.pt")):  # the fp32 weight and the optimizer's tensors
            if f.name == "step.pt":
                continue
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
            link_or_copy(f, out / f"zero_pp_rank_0_mp_rank_{mp}_model_states.pt")
    if z3_files and not mp_files:  # ...and the ZeRO-1/2 loader for mp_rank_XX_model_states.pt
        for f in z3_files:
            if f.name.startswith("zero_pp_rank_0_"):
                mp = f.name.split("_mp_rank_")[1][:2]
                link_or_copy(f, out / f"mp_rank_{mp}_model_states.pt")


def stage0_to_universal(
    ckpt: Path, out: Path, names: list[list[str]] | Callable[[Any], list[list[str]]], workers: int
) -> None:
    """The universal layout from a stage-0 checkpoint (any of stage0's optimizer layouts): the fp32
    master weights, the optimizer's tensors and the step per parameter. `names`: per group, or a function of the
    saved module's state that gives them."""
    import torch

    sd = torch.load(ckpt / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    if callable(names):  # (names from the saved weights: a run in stages reads a checkpoint without them)
        names = names(sd["module"])
    try:
        params, hparams = stage0.read(sd["optimizer"], sd["module"], names)
    except (ValueError, KeyError, IndexError) as e:
        raise RuntimeError(f"{ckpt}: cannot read its stage-0 optimizer state: {type(e).__name__}: {e}") from e
    write_params(out, params, hparams, workers)
    ms = {k: v for k, v in sd.items() if k != "optimizer"}
    ms["optimizer"] = None
    torch.save(ms, out / "mp_rank_00_model_states.pt")
    link_or_copy(out / "mp_rank_00_model_states.pt", out / "zero_pp_rank_0_mp_rank_00_model_states.pt")


def write_params(
    out: Path, params: dict[str, stage0.ParamState], hparams: list[dict[str, Any]], workers: int
) -> None:
    """The universal layout's optimizer part: a directory a parameter (its fp32 weight, the optimizer's tensors, the
    step) and the groups' hyperparameters."""
    import deepspeed
    import torch
    from deepspeed.checkpoint.constants import CAT_DIM, DS_VERSION, OPTIMIZER_STATE_DICT, PARAM, PARAM_GROUPS

    zdir = out / "zero"
    zdir.mkdir(parents=True)

    def write(item: tuple[str, stage0.ParamState]) -> None:
        name, p = item
        pdir = zdir / name
        pdir.mkdir()
        for key, t in {"fp32": p.fp32, **p.state}.items():
            torch.save({PARAM: t, CAT_DIM: 0}, pdir / f"{key}.pt")
        torch.save(p.step, pdir / "step.pt")

    parallel(write, params.items(), workers)
    step = max((p.step for p in params.values()), default=0)
    groups = [hp | {"params": []} for hp in hparams]
    torch.save(
        {
            DS_VERSION: deepspeed.__version__,
            PARAM_GROUPS: groups,
            OPTIMIZER_STATE_DICT: {"state": {0: {"step": step}}, "param_groups": groups},
        },
        zdir / "optimizer_state.pt",
    )


def read_param(zdir: Path, name: str) -> tuple[str, stage0.ParamState]:
    """One parameter's fp32 weight, optimizer tensors and step from a universal directory's `zero/`."""
    import torch
    from deepspeed.checkpoint.constants import PARAM

    parts = {f.stem: torch.load(f, weights_only=False) for f in sorted((zdir / name).glob("*.pt"))}
    step = int(parts.pop("step"))
    fp32 = parts.pop("fp32")[PARAM]
    return name, stage0.ParamState(fp32, {k: v[PARAM] for k, v in parts.items()}, step)


def hparams(uni: Path) -> list[dict[str, Any]]:
    """Each optimizer group's hyperparameters (without its parameters) from a universal directory."""
    import torch
    from deepspeed.checkpoint.constants import PARAM_GROUPS

    saved = torch.load(uni / "zero" / "optimizer_state.pt", weights_only=False)[PARAM_GROUPS]
    return [{k: v for k, v in g.items() if k != "params"} for g in saved]


def universal_to_stage0(
    uni: Path,
    out: Path,
    names: list[list[str]],
    aliases: dict[str, str],
    target: dict[str, Any],
    workers: int,
) -> None:
    """A stage-0 checkpoint from a universal directory, with the optimizer state in the layout of the
    engine that will load it (`target`: see target_of). The module gets the fp32 weights; a bf16 or
    fp16 engine rounds them on load exactly as it rounds its masters after each step."""
    import torch

    ms = torch.load(
        sorted(uni.glob("*mp_rank_00_model_states.pt"))[0], map_location="cpu", weights_only=False
    )
    params = dict(parallel(lambda n: read_param(uni / "zero", n), [n for g in names for n in g], workers))
    hparams_ = hparams(uni)
    osd = stage0.build(
        target["kind"], params, names, hparams_, torch_states=target["torch_states"], fields=target["fields"]
    )
    full = dict(ms["module"])
    full.update({name: p.fp32 for name, p in params.items()})
    for alias, target_name in aliases.items():  # tied weights point at their parameter again
        if target_name in params:
            full[alias] = params[target_name].fp32
    ms["module"], ms["optimizer"], ms["param_shapes"] = full, osd, None
    torch.save(ms, out / "mp_rank_00_model_states.pt")


# ----------------------------------------------------------------------------- after a universal load


def normalize_steps(ds: Any, torch_states: bool) -> None:
    """Adam's step counter as the live optimizer keeps it: its own tensor per parameter for torch's
    AdamW, an int for DeepSpeed's kernels. DeepSpeed's universal loader hands every parameter the
    same step object; torch increments it in place, so a shared tensor would count once per group."""
    import torch

    opt = getattr(ds, "basic_optimizer", None)
    for st in getattr(opt, "state", {}).values():
        if "step" in st:
            step = float(st["step"])
            st["step"] = torch.tensor(step) if torch_states else int(step)


def uses_torch_optimizer(ds: Any) -> bool:
    import torch

    opt = getattr(ds, "basic_optimizer", None)
    return isinstance(opt, torch.optim.Optimizer) and type(opt).__module__.startswith("torch.optim")


# ----------------------------------------------------------------------------- the conversion process


def restore_group_hparams(ds: Any, uni: Path) -> None:
    """Undo DeepSpeed's stage-3 universal load copying group 0's hyperparameters into every group."""
    saved, groups = hparams(uni), ds.optimizer.param_groups
    if len(saved) != len(groups):
        raise RuntimeError(f"{uni}: {len(saved)} optimizer groups saved, {len(groups)} now")
    for g, s in zip(groups, saved, strict=True):
        g.update({k: v for k, v in s.items() if k != "step"})


def joined(shards: list[Any], name: str, info: dict[str, Any]) -> Any:
    """A parameter's tensor-parallel shards (`shards`, by rank) whole, as the universal-checkpoint metadata AutoTP
    attaches to the model states (`info`) says: replicated (one), by rows (dimension 1), else by columns (0)."""
    import re

    import torch

    def matches(key: str) -> bool:
        return any(re.match(p, name) for p in info.get(key, ()))

    if len(shards) == 1 or matches("tp_replicated_parameter_patterns") or shards[0].dim() == 0:
        return shards[0]
    dim = 1 if matches("parameter_with_row_parallelism_patterns") and shards[0].dim() > 1 else 0
    return torch.cat(shards, dim=dim)
