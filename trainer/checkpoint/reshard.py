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
  `universal.restore_group_hparams` puts the saved per-group values back.

The conversion runs in a separate process that rank 0 starts (`python -m trainer.checkpoint.reshard`), with several
worker processes, writing into a hidden directory renamed into place when complete. It is not inside a
collective, so `dist.timeout_s` does not bound it: every rank waits for the completion marker (or rank 0's
failure report) for up to `checkpoint.convert_timeout_minutes`. An interrupted conversion leaves only a hidden
directory, which the next one removes before starting again. Needs a filesystem that every rank sees.
A converted directory is sealed (seal.py: every file fsynced and digested before its `CONVERTED` marker)
and checked by every rank (a share of its files each) before it loads; a damaged one is rebuilt once from
the checkpoint, whose bytes were verified before (policy.undamaged), and the conversion is recorded in the
run's journal.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.checkpoint import seal, stage0, stages, universal
from trainer.common.errors import ResumeError
from trainer.common.faults import Faults

log = logging.getLogger("trainer")

DONE = seal.MARKER
UNIVERSAL = "universal"
TMP_PREFIX = ".convert-tmp-"
FAILED_PREFIX = ".convert-failed-"
LOCK = ".convert.lock"
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the checkout that holds trainer/ (for a subprocess)


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


def model_state_files(ckpt: Path) -> list[str]:
    """The model states of data-parallel rank 0, a file a tensor-parallel rank (ZeRO-3's: zero_pp_rank_0_...)."""
    return sorted(glob.glob(str(ckpt / "mp_rank_*_model_states.pt"))) or sorted(
        glob.glob(str(ckpt / "zero_pp_rank_0_mp_rank_*_model_states.pt"))
    )


def saved_layout(ckpt: Path) -> tuple[int, int]:
    """(ZeRO stage, data-parallel size) a checkpoint was written with; no tensor read (mmap, but legacy)."""
    import torch

    files = model_state_files(ckpt)
    if not files:
        raise FileNotFoundError(f"no DeepSpeed model states in {ckpt}")
    sd = torch.load(files[0], map_location="cpu", weights_only=False, mmap=zipfile.is_zipfile(files[0]))
    return int(sd["ds_config"].get("zero_optimization", {}).get("stage", 0)), int(sd["dp_world_size"])


def saved_axes(ckpt: Path) -> tuple[int, int]:
    """(tensor parallel, expert parallel) a checkpoint was written with: its model-states files (one a tensor-
    parallel rank) and its DeepSpeed JSON's expert_parallel."""
    from trainer.strategy.planning.axes import parallel_degrees

    ep = 1
    with contextlib.suppress(OSError, ValueError):
        ep = parallel_degrees(json.loads((ckpt / "ds_config.json").read_text()))[1]
    return max(
        1, len(model_state_files(ckpt)) // stages.saved_stages(ckpt)
    ), ep  # (pipeline stages: a file a stage)


def axes_change(
    ckpt: Path, src: tuple[int, int], dst: tuple[int, int], stages: tuple[int, int], convert: bool
) -> str:
    """The log line for a resume whose tensor- or expert-parallel degree changes ('' when neither does). A
    ResumeError where the checkpoint cannot be converted for this run (`convert`: the stage or the data-parallel
    size asks for a conversion too): another expert-parallel degree; a conversion with a sharded side at ZeRO
    stage 0 (the stage-0 conversion, stage0.py, knows no shards) or 3 (DeepSpeed 0.19.8's ds_to_universal stops
    on a ZeRO-3 tensor-parallel checkpoint: "start (0) + length (16448) exceeds dimension size (8224)", measured)."""
    if src == dst and not convert:
        return ""
    said = f"tensor parallel {src[0]} -> {dst[0]}, expert parallel {src[1]} -> {dst[1]}"
    if src[1] != dst[1]:
        raise ResumeError(
            f"checkpoint.resume: {ckpt} was saved at expert parallel {src[1]}, and this run is at {dst[1]}: AutoEP's "
            "layers hold a mixture's experts under their own names (mlp.experts.w1/w2/w3, mlp.router.gate) where "
            "transformers' hold them fused (gate_up_proj, down_proj) and a universal checkpoint maps neither to "
            f"the other. Resume at strategy.expert_parallel: {src[1]} (any data-parallel size or ZeRO stage 1-2), "
            "or export the weights (bin/export) and start from them"
        )
    sharded = src != (1, 1) or dst != (1, 1)
    if sharded and set(stages) & {0, 3}:
        raise ResumeError(
            f"checkpoint.resume: {ckpt} was saved at tensor parallel {src[0]}, expert parallel {src[1]} and ZeRO "
            f"stage {stages[0]}; this run is at tensor parallel {dst[0]}, expert parallel {dst[1]}, stage "
            f"{stages[1]}: the checkpoint would be converted (another degree, stage or data-parallel size), and a "
            "sharded checkpoint converts only between ZeRO stages 1 and 2 (the stage-0 conversion knows no shards; "
            "DeepSpeed 0.19.8's universal conversion stops on a ZeRO-3 tensor-parallel checkpoint). Resume at the "
            "saved degrees, stage and data-parallel size, or with both sides at ZeRO stage 1 or 2; bin/export "
            "writes its weights whole at any stage"
        )
    if src == dst:
        return ""
    return f"resume: the model-parallel degrees change ({said}): the checkpoint is converted (universal)"


def needs_conversion(src: tuple[int, int], dst: tuple[int, int]) -> bool:
    (s_stage, s_dp), (d_stage, d_dp) = src, dst
    if s_stage == d_stage == 0:
        return False  # stage 0 holds full states: any world size loads it
    return not (s_dp == d_dp and (s_stage == d_stage or {s_stage, d_stage} == {1, 2}))


def target_of(ds: Any) -> dict[str, Any]:
    """What a converted checkpoint must look like for this engine to load it (in stages: their cut and names)."""
    staged = getattr(ds.module, "names", None)
    layout = {"parts": list(ds.module.parts), "names": staged, **stages.tensor_shards(ds)} if staged else None
    pipeline = {"pipeline": layout} if layout else {}
    if ds.zero_optimization_stage() != 0:
        return {"stage0": False, **pipeline}
    return {
        "stage0": True,
        "kind": stage0.live_kind(ds.optimizer),
        "fields": stage0.wrapper_fields(ds.optimizer),
        "torch_states": universal.uses_torch_optimizer(ds),
        **pipeline,
    }


def target_tag(target: dict[str, Any]) -> str:
    """The directory (inside the checkpoint) the engine loads: `universal`, or a stage-0 checkpoint
    per optimizer layout and loss-scaler settings (bf16 and fp16 engines need different ones)."""
    if not target["stage0"] and not target.get("pipeline"):
        return UNIVERSAL
    digest = hashlib.sha256(json.dumps(target, sort_keys=True, default=str).encode()).hexdigest()[:8]
    kind = target["kind"] if target["stage0"] else "zero"
    pipeline = target.get("pipeline")
    return f"stages{len(pipeline['parts']) - 1}-{kind}-{digest}" if pipeline else f"stage0-{kind}-{digest}"


def load(
    engine: Any,
    ckpt: Path,
    names: list[list[str]],
    aliases: dict[str, str],
    rank: int,
    group: Any = None,
    wait_s: float = 7200.0,
    custom_load_fn: Callable[..., None] | None = None,
    journal_root: Path | None = None,
) -> None:
    """Load `ckpt` (a step directory) into `engine`, converting when stage or world size differ.
    `custom_load_fn`: DeepSpeed's, for the module's state (frozen.strict_but_frozen: a checkpoint
    without the frozen weights, which the engine keeps as built). `journal_root`: the run's checkpoints
    directory, whose journal records a conversion."""
    ds = engine.ds
    src, dst = saved_layout(ckpt), (ds.zero_optimization_stage(), ds.dp_world_size)
    moved = stages.changed(ckpt, engine)  # another pipeline stage count (1: none): converted
    from trainer.strategy.planning.axes import parallel_degrees

    axes = parallel_degrees(engine.ds_config)
    change = axes_change(ckpt, saved_axes(ckpt), axes, (src[0], dst[0]), needs_conversion(src, dst) or moved)
    if change and rank == 0:
        log.info(change)

    def load_tag(root: Path, tag: str) -> Any:
        return ds.load_checkpoint(
            str(root), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True,
            custom_load_fn=custom_load_fn,
        )  # fmt: skip

    if not change and not moved and not needs_conversion(src, dst):
        path, _ = load_tag(ckpt.parent, ckpt.name)
        if path is None:
            raise ResumeError(f"DeepSpeed found no checkpoint in {ckpt}")
        return
    if getattr(engine, "pipe", None) is not None:
        stages.check_target(engine, names)
    target = target_of(ds)
    tag = target_tag(target)
    pp = (stages.saved_stages(ckpt), len(target["pipeline"]["parts"]) - 1 if "pipeline" in target else 1)
    what = f"converting {ckpt} (stage {src[0]}, {src[1]} ranks) for stage {dst[0]} on {dst[1]} ranks" + (
        f" (pipeline stages {pp[0]} -> {pp[1]})" if moved else ""
    )
    token = [uuid.uuid4().hex[:12]]  # this job's conversion: names its failure report
    import torch.distributed as dist

    if (
        dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    ):  # (stages: dp 1, world 2)
        dist.broadcast_object_list(token, src=0, group=group)  # quick: before the conversion starts
    converted(ckpt, tag, (names, aliases, target), token[0], rank, group, wait_s, what, journal_root)
    if dst[0] == 0:
        load_tag(ckpt, tag)
    else:
        ds._config.load_universal_checkpoint = True  # for this one load only (it breaks later loads)
        try:
            load_tag(ckpt, tag)
        finally:
            ds._config.load_universal_checkpoint = False
        universal.restore_group_hparams(ds, ckpt / tag)
    universal.normalize_steps(ds, universal.uses_torch_optimizer(ds))


def converted(
    ckpt: Path, tag: str, spec: tuple[Any, Any, Any], token: str, rank: int, group: Any, wait_s: float, what: str,
    journal_root: Path | None,
) -> None:  # fmt: skip
    """Every rank: `<ckpt>/<tag>` made (rank 0 converts, the others wait), then its files checked against
    its marker (each rank a share); a damaged one is removed by rank 0 and made again, once."""
    import torch.distributed as dist

    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    for again in (False, True):
        made = rank == 0 and convert_in_subprocess(ckpt, tag, *spec, token, wait_s, what, rebuild=again)
        wait_for(ckpt, tag, token, wait_s, what)
        mine = seal.problems(ckpt / tag, rank, world)
        bad: list[Any] = [None] * world
        if world > 1:
            dist.all_gather_object(bad, mine, group=group)
        else:
            bad = [mine]
        bad = sum(bad, [])
        if made and journal_root is not None and not bad:
            seal.record(journal_root, ckpt, tag)
        if not bad:
            return
        if again:
            raise ResumeError(
                f"{what}: made again from the checkpoint, and still damaged: {'; '.join(bad[:3])}"
            )
        if rank == 0:
            log.warning(
                f"warning: {ckpt / tag} is damaged ({'; '.join(bad[:3])}); making it again from {ckpt}"
            )
            shutil.rmtree(ckpt / tag, ignore_errors=True)
        if world > 1:
            dist.barrier(group=group)  # the damaged one is gone before any rank waits for the new one


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
    rebuild: bool = False,
) -> bool:
    """Rank 0: run the conversion in its own process (dying with this one), log the outcome, and on
    failure leave the report the other ranks wait for. Returns whether it converted (`rebuild`: the
    directory there was damaged)."""
    from trainer.cluster.dist import cpu_cores

    if not rebuild and seal.marker(ckpt / tag)[0] is not None:
        return False  # made before: its files are checked against the marker by every rank
    spec = {"names": names, "aliases": aliases, "target": target, "tag": tag, "token": token,
            "workers": max(1, min(8, cpu_cores())), "rebuild": rebuild}  # fmt: skip
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
    except OSError as e:  # e.g. a read-only checkpoint directory: converted files could not go beside it
        from trainer.checkpoint.fs import describe

        error = describe(e, e.filename or ckpt, "converting in place; copy the checkpoint somewhere writable and "
                         "resume the copy")  # fmt: skip
    finally:
        with contextlib.suppress(OSError):
            spec_path.unlink(missing_ok=True)
    if error is not None:
        try:
            (ckpt / f"{FAILED_PREFIX}{token}").write_text(error + "\n")
        except OSError:  # the other ranks cannot be told through the directory: this rank ends the job
            raise ResumeError(f"{what} failed on rank 0: {error}") from None
        return False  # wait_for() raises, on every rank alike
    log_path.unlink(missing_ok=True)
    log.info(f"{what}: done in {time.perf_counter() - t0:.1f} s ({spec['workers']} workers)")
    return True


def _die_with_parent(parent: int | None = None) -> None:
    """In the conversion process, and in each worker it forks (DeepSpeed's pools: `workers_die_with_it`): receive
    SIGKILL when the process that started it dies (Linux), so a killed job leaves no conversion running, nor a worker
    holding the checkpoint's conversion lock (review of issue 71); elsewhere nothing. `parent`: the forking process,
    gone already if this one's parent is another."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def workers_die_with_it() -> None:
    """Every process this one forks from now on dies with it."""
    forker = [0]
    os.register_at_fork(before=lambda: forker.__setitem__(0, os.getpid()),
                        after_in_child=lambda: _die_with_parent(forker[0]))  # fmt: skip


def convert(ckpt: Path, spec: dict[str, Any]) -> None:
    """Make (once) `<ckpt>/universal/` and, for a stage-0 target, `<ckpt>/<tag>/`. Each is built in a
    hidden directory and renamed into place with its completion marker inside; leftovers of an
    interrupted conversion are removed first. One conversion at a time per checkpoint (a lock)."""
    from trainer.common.files import file_lock

    names, aliases, target, workers = spec["names"], spec["aliases"], spec["target"], int(spec["workers"])
    with file_lock(ckpt / LOCK):
        for d in ckpt.iterdir():
            if d.name.startswith((TMP_PREFIX, FAILED_PREFIX)):
                shutil.rmtree(d, ignore_errors=True) if d.is_dir() else d.unlink(missing_ok=True)
        uni, rebuild = ckpt / UNIVERSAL, bool(spec.get("rebuild"))

        def make_universal(out: Path) -> None:  # by the model's names, whatever the layout saved or loading
            src_stage, _ = saved_layout(ckpt)
            pipeline = target.get("pipeline")
            if stages.saved_stages(ckpt) > 1:
                stages.to_universal(ckpt, out, src_stage, aliases, workers)
            elif src_stage == 0:  # (a run in stages: the model's groups from the saved weights)
                by = (lambda m: stages.by_shape(stages.model_order(pipeline["names"]), lambda n: m[n].shape)) if pipeline else names  # fmt: skip
                universal.stage0_to_universal(ckpt, out, by, workers)
            else:
                universal.ds_to_universal(ckpt, out, workers)
                universal.fix_for_any_target(out)

        if not target["stage0"] and not target.get("pipeline"):
            _build(uni, make_universal, force=rebuild)
            return
        final = ckpt / spec["tag"]
        if (
            rebuild or seal.marker(final)[0] is None
        ):  # the stage-0 one is made from universal/: verified first
            _build(uni, make_universal, force=bool(seal.problems(uni)))
        if target.get("pipeline"):
            _build(final, lambda out: stages.from_universal(uni, out, target, workers), force=rebuild)
            return
        _build(
            final,
            lambda out: universal.universal_to_stage0(uni, out, names, aliases, target, workers),
            force=rebuild,
        )


def _build(final: Path, make: Callable[[Path], None], force: bool = False) -> None:
    """`final` made by `make`, sealed and renamed into place (seal.build_sealed); kept where its marker
    vouches for it, unless `force`."""
    seal.build_sealed(final, make, force, before_seal=Faults().conversion)  # tests: fail, slow or kill here


def main(argv: list[str] | None = None) -> int:
    """`python -m trainer.checkpoint.reshard CHECKPOINT --spec SPEC.json`: the conversion process rank 0 starts."""
    p = argparse.ArgumentParser(prog="python -m trainer.checkpoint.reshard", description=main.__doc__)
    p.add_argument("checkpoint")
    p.add_argument("--spec", required=True, help="JSON: names, aliases, target, tag, workers")
    args = p.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # a conversion needs no GPU
    workers_die_with_it()
    # one thread: a parallel region here (3D's shards joined by torch.cat) before DeepSpeed forks its workers left
    # them in libgomp's barrier for ever (review of issue 71); the workers, processes, are the conversion's parallelism
    __import__("torch").set_num_threads(1)
    convert(Path(args.checkpoint), json.loads(Path(args.spec).read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
