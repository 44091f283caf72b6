"""Resume a checkpoint on another number of ranks or another ZeRO stage.

DeepSpeed loads a ZeRO checkpoint only into the same stage and data-parallel size. Otherwise we go
through DeepSpeed's universal checkpoint format (one directory per parameter holding the fp32
weight and the optimizer's state, e.g. both Adam moments), made once into `<checkpoint>/universal/`
and kept for later resumes.
Three gaps in DeepSpeed 0.19 are bridged here:

- stage 0 checkpoints (a plain torch optimizer state, or DeepSpeed's bf16/fp16 wrappers around it:
  trainer/checkpoint/stage0.py) are not covered by `ds_to_universal`: we write the universal layout ourselves,
  from the fp32 master weights and moments, and back into the layout of the engine that loads it;
- a universal directory made from stage 1/2 does not load into stage 3 and vice versa (file names,
  flat vs shaped tensors, a missing `step.pt` / `optimizer_state_dict`): `_fix_for_any_target`;
- a stage-3 universal load copies param group 0's hyperparameters (weight decay!) into every group:
  `_restore_group_hparams` puts the saved per-group values back.

The conversion runs in a separate process that rank 0 starts (`python -m trainer.checkpoint.reshard`), with several
worker processes, writing into a hidden directory renamed into place when complete. It is not inside a
collective, so `dist.timeout_s` does not bound it: every rank waits for the completion marker (or rank 0's
failure report) for up to `checkpoint.convert_timeout_minutes`. An interrupted conversion leaves only a hidden
directory, which the next one removes before starting again. Needs a filesystem that every rank sees.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import uuid
import zipfile
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from trainer.checkpoint import stage0
from trainer.errors import UserError
from trainer.faults import Faults

log = logging.getLogger("trainer")

DONE = "CONVERTED"
UNIVERSAL = "universal"
TMP_PREFIX = ".convert-tmp-"
FAILED_PREFIX = ".convert-failed-"
LOCK = ".convert.lock"
PACKAGE_ROOT = Path(__file__).resolve().parent.parent


class ResumeError(UserError):
    """A checkpoint cannot be loaded into this job: a restart would fail the same way."""


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
    """(ZeRO stage, data-parallel size) a checkpoint was written with; no tensor read (mmap, but legacy)."""
    import torch

    files = sorted(glob.glob(str(ckpt / "mp_rank_*_model_states.pt"))) or sorted(
        glob.glob(str(ckpt / "zero_pp_rank_0_mp_rank_*_model_states.pt"))
    )
    if not files:
        raise FileNotFoundError(f"no DeepSpeed model states in {ckpt}")
    sd = torch.load(files[0], map_location="cpu", weights_only=False, mmap=zipfile.is_zipfile(files[0]))
    return int(sd["ds_config"].get("zero_optimization", {}).get("stage", 0)), int(sd["dp_world_size"])


def needs_conversion(src: tuple[int, int], dst: tuple[int, int]) -> bool:
    (s_stage, s_dp), (d_stage, d_dp) = src, dst
    if s_stage == d_stage == 0:
        return False  # stage 0 holds full states: any world size loads it
    return not (s_dp == d_dp and (s_stage == d_stage or {s_stage, d_stage} == {1, 2}))


def target_of(ds: Any) -> dict[str, Any]:
    """What a converted checkpoint must look like for this engine to load it."""
    if ds.zero_optimization_stage() != 0:
        return {"stage0": False}
    return {
        "stage0": True,
        "kind": stage0.live_kind(ds.optimizer),
        "fields": stage0.wrapper_fields(ds.optimizer),
        "torch_states": _uses_torch_optimizer(ds),
    }


def target_tag(target: dict[str, Any]) -> str:
    """The directory (inside the checkpoint) the engine loads: `universal`, or a stage-0 checkpoint
    per optimizer layout and loss-scaler settings (bf16 and fp16 engines need different ones)."""
    if not target["stage0"]:
        return UNIVERSAL
    digest = hashlib.sha256(json.dumps(target, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"stage0-{target['kind']}-{digest}"


def load(
    engine: Any,
    ckpt: Path,
    names: list[list[str]],
    aliases: dict[str, str],
    rank: int,
    group: Any = None,
    wait_s: float = 7200.0,
    custom_load_fn: Callable[..., None] | None = None,
) -> None:
    """Load `ckpt` (a step directory) into `engine`, converting when stage or world size differ.
    `custom_load_fn`: DeepSpeed's, for the module's state (frozen.strict_but_frozen: a checkpoint
    without the frozen weights, which the engine keeps as built)."""
    ds = engine.ds
    src = saved_layout(ckpt)
    dst = (ds.zero_optimization_stage(), ds.dp_world_size)

    def load_tag(root: Path, tag: str) -> Any:
        return ds.load_checkpoint(
            str(root), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True,
            custom_load_fn=custom_load_fn,
        )  # fmt: skip

    if not needs_conversion(src, dst):
        path, _ = load_tag(ckpt.parent, ckpt.name)
        if path is None:
            raise ResumeError(f"DeepSpeed found no checkpoint in {ckpt}")
        return
    target = target_of(ds)
    tag = target_tag(target)
    what = f"converting {ckpt} (stage {src[0]}, {src[1]} ranks) for stage {dst[0]} on {dst[1]} ranks"
    token = [uuid.uuid4().hex[:12]]  # this job's conversion: names its failure report
    if dst[1] > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(token, src=0, group=group)  # quick: before the conversion starts
    if rank == 0:
        convert_in_subprocess(ckpt, tag, names, aliases, target, token[0], wait_s, what)
    wait_for(ckpt, tag, token[0], wait_s, what)
    if dst[0] == 0:
        load_tag(ckpt, tag)
    else:
        ds._config.load_universal_checkpoint = True  # for this one load only (it breaks later loads)
        try:
            load_tag(ckpt, tag)
        finally:
            ds._config.load_universal_checkpoint = False
        _restore_group_hparams(ds, ckpt / tag)
    _normalize_steps(ds, _uses_torch_optimizer(ds))


def wait_for(ckpt: Path, tag: str, token: str, wait_s: float, what: str, poll_s: float = 0.2) -> None:
    """Every rank: wait until `<ckpt>/<tag>/CONVERTED` exists, or rank 0 reports this conversion
    (`token`) failed, for at most `wait_s` seconds. No collective: nothing else bounds the wait."""
    failed = ckpt / f"{FAILED_PREFIX}{token}"
    deadline = time.monotonic() + wait_s
    while not (ckpt / tag / DONE).exists():
        if failed.exists():
            raise ResumeError(f"{what} failed on rank 0: {failed.read_text().strip()}")
        if time.monotonic() > deadline:
            raise ResumeError(
                f"{what}: no result after {wait_s / 60:.0f} min (checkpoint.convert_timeout_minutes); is "
                f"{ckpt} on a filesystem every rank sees? Raise the bound for a very large checkpoint"
            )
        time.sleep(poll_s)


def convert_in_subprocess(
    ckpt: Path,
    tag: str,
    names: list[list[str]],
    aliases: dict[str, str],
    target: dict[str, Any],
    token: str,
    wait_s: float,
    what: str,
) -> None:
    """Rank 0: run the conversion in its own process (dying with this one), log the outcome, and on
    failure leave the report the other ranks wait for."""
    from trainer.dist import cpu_cores

    if (ckpt / tag / DONE).exists():
        return
    spec = {"names": names, "aliases": aliases, "target": target, "tag": tag, "token": token,
            "workers": max(1, min(8, cpu_cores()))}  # fmt: skip
    spec_path = ckpt / f".convert-spec-{token}.json"
    log_path = ckpt / f".convert-{token}.log"
    error = None
    t0 = time.perf_counter()
    try:
        spec_path.write_text(json.dumps(spec, default=str))
        with open(log_path, "w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "trainer.checkpoint.reshard", str(ckpt), "--spec", str(spec_path)],
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
                # the package importable even where it is not installed (bin/train from a checkout)
                env={
                    **os.environ,
                    "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": os.pathsep.join(
                        filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")])
                    ),
                },
            )
            try:
                rc = proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
                error = f"the conversion took more than {wait_s / 60:.0f} min (checkpoint.convert_timeout_minutes)"
        if error is None and (rc != 0 or not (ckpt / tag / DONE).exists()):
            tail = log_path.read_text().strip().splitlines()[-12:]
            error = f"exit {rc}: " + "\n  ".join(tail or ["(no output)"])
    except OSError as e:  # e.g. a read-only checkpoint directory
        error = f"{type(e).__name__}: {e}"
    finally:
        spec_path.unlink(missing_ok=True)
    if error is not None:
        with contextlib.suppress(OSError):
            (ckpt / f"{FAILED_PREFIX}{token}").write_text(error + "\n")
        return  # wait_for() raises, on every rank alike
    log_path.unlink(missing_ok=True)
    log.info(f"{what}: done in {time.perf_counter() - t0:.1f} s ({spec['workers']} workers)")


def _die_with_parent() -> None:
    """In the conversion process: receive SIGKILL when the rank that started it dies (Linux), so a
    killed job leaves no conversion running; elsewhere nothing."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


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


# ----------------------------------------------------------------------------- the conversion process


def convert(ckpt: Path, spec: dict[str, Any]) -> None:
    """Make (once) `<ckpt>/universal/` and, for a stage-0 target, `<ckpt>/<tag>/`. Each is built in a
    hidden directory and renamed into place with its completion marker inside; leftovers of an
    interrupted conversion are removed first. One conversion at a time per checkpoint (a lock)."""
    from trainer.files import file_lock

    names, aliases, target, workers = spec["names"], spec["aliases"], spec["target"], int(spec["workers"])
    with file_lock(ckpt / LOCK):
        for d in ckpt.iterdir():
            if d.name.startswith((TMP_PREFIX, FAILED_PREFIX)):
                shutil.rmtree(d, ignore_errors=True) if d.is_dir() else d.unlink(missing_ok=True)
        uni = ckpt / UNIVERSAL

        def make_universal(out: Path) -> None:
            src_stage, _ = saved_layout(ckpt)
            if src_stage == 0:
                _stage0_to_universal(ckpt, out, names, workers)
            else:
                _ds_to_universal(ckpt, out, workers)
                _fix_for_any_target(out)

        _build(uni, make_universal)
        if target["stage0"]:
            _build(
                ckpt / spec["tag"],
                lambda out: _universal_to_stage0(uni, out, names, aliases, target, workers),
            )


def _build(final: Path, make: Callable[[Path], None]) -> None:
    if (final / DONE).exists():
        return
    shutil.rmtree(final, ignore_errors=True)  # an incomplete one (older versions wrote in place)
    tmp = final.with_name(f"{TMP_PREFIX}{final.name}")
    tmp.mkdir()
    make(tmp)
    Faults().conversion()  # tests: a conversion that fails, takes longer, or loses its rank here
    (tmp / DONE).touch()
    os.rename(tmp, final)


def _parallel(fn: Callable[[Any], Any], items: Iterable[Any], workers: int) -> list[Any]:
    """fn over items in threads (file reads and writes release the GIL)."""
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(fn, items))


def _ds_to_universal(ckpt: Path, out: Path, workers: int) -> None:
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    shards = len(glob.glob(str(ckpt / "*_optim_states.pt")))
    args = argparse.Namespace(
        input_folder=str(ckpt),
        output_folder=str(out),
        num_extract_workers=max(1, min(workers, shards)),
        num_merge_workers=max(1, workers // 2),  # merging holds whole parameters: fewer at once
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
            _link_or_copy(f, out / f"zero_pp_rank_0_mp_rank_{mp}_model_states.pt")
    if z3_files and not mp_files:  # ...and the ZeRO-1/2 loader for mp_rank_XX_model_states.pt
        for f in z3_files:
            if f.name.startswith("zero_pp_rank_0_"):
                mp = f.name.split("_mp_rank_")[1][:2]
                _link_or_copy(f, out / f"mp_rank_{mp}_model_states.pt")


def _stage0_to_universal(ckpt: Path, out: Path, names: list[list[str]], workers: int) -> None:
    """The universal layout from a stage-0 checkpoint (any of stage0's optimizer layouts): the fp32
    master weights, the optimizer's tensors and the step per parameter."""
    import deepspeed
    import torch
    from deepspeed.checkpoint.constants import CAT_DIM, DS_VERSION, OPTIMIZER_STATE_DICT, PARAM, PARAM_GROUPS

    zdir = out / "zero"
    zdir.mkdir(parents=True)
    sd = torch.load(ckpt / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    try:
        params, hparams = stage0.read(sd["optimizer"], sd["module"], names)
    except (ValueError, KeyError, IndexError) as e:
        raise RuntimeError(f"{ckpt}: cannot read its stage-0 optimizer state: {type(e).__name__}: {e}") from e

    def write(item: tuple[str, stage0.ParamState]) -> None:
        name, p = item
        pdir = zdir / name
        pdir.mkdir()
        for key, t in {"fp32": p.fp32, **p.state}.items():
            torch.save({PARAM: t, CAT_DIM: 0}, pdir / f"{key}.pt")
        torch.save(p.step, pdir / "step.pt")

    _parallel(write, params.items(), workers)
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
    ms = {k: v for k, v in sd.items() if k != "optimizer"}
    ms["optimizer"] = None
    torch.save(ms, out / "mp_rank_00_model_states.pt")
    _link_or_copy(out / "mp_rank_00_model_states.pt", out / "zero_pp_rank_0_mp_rank_00_model_states.pt")


def _universal_to_stage0(
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
    from deepspeed.checkpoint.constants import PARAM, PARAM_GROUPS

    zdir = uni / "zero"
    ms = torch.load(
        sorted(uni.glob("*mp_rank_00_model_states.pt"))[0], map_location="cpu", weights_only=False
    )
    hparams = [
        {k: v for k, v in g.items() if k != "params"}
        for g in torch.load(zdir / "optimizer_state.pt", weights_only=False)[PARAM_GROUPS]
    ]

    def read(name: str) -> tuple[str, stage0.ParamState]:
        parts = {f.stem: torch.load(f, weights_only=False) for f in sorted((zdir / name).glob("*.pt"))}
        step = int(parts.pop("step"))
        fp32 = parts.pop("fp32")[PARAM]
        return name, stage0.ParamState(fp32, {k: v[PARAM] for k, v in parts.items()}, step)

    params = dict(_parallel(read, [n for g in names for n in g], workers))
    osd = stage0.build(
        target["kind"], params, names, hparams, torch_states=target["torch_states"], fields=target["fields"]
    )
    full = dict(ms["module"])
    full.update({name: p.fp32 for name, p in params.items()})
    for alias, target_name in aliases.items():  # tied weights point at their parameter again
        if target_name in params:
            full[alias] = params[target_name].fp32
    ms["module"], ms["optimizer"], ms["param_shapes"] = full, osd, None
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


def main(argv: list[str] | None = None) -> int:
    """`python -m trainer.checkpoint.reshard CHECKPOINT --spec SPEC.json`: the conversion process rank 0 starts."""
    p = argparse.ArgumentParser(prog="python -m trainer.checkpoint.reshard", description=main.__doc__)
    p.add_argument("checkpoint")
    p.add_argument("--spec", required=True, help="JSON: names, aliases, target, tag, workers")
    args = p.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # a conversion needs no GPU
    convert(Path(args.checkpoint), json.loads(Path(args.spec).read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
