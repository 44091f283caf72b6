"""Checkpoints of pipeline stages (trainer/model/stages.py): DeepSpeed's pipeline engine writes each item's weights
as a layer file (layer_NN-model_states.pt, by the item's index in the whole model: the same whatever the stage
count) and a model-states file a stage (mp_rank_SS: at ZeRO-0 with the stage's optimizer state; at ZeRO-1 beside
its optimizer partitions). trainer_state.json's plan records the cut (`parts`) and each layer file's names as the
model has them (`names`: {item index: {the item's name: the model's}}).

A resume in another layout goes through the universal directory reshard.py makes, keyed by the model's names
whatever the layout: `to_universal` makes it from a checkpoint of stages (each stage's fp32 weights and optimizer
tensors, renamed from the pipeline's names, '3.layer.mlp.up_proj.weight', to the model's), and `from_universal`
makes, for a run in stages, a checkpoint its engine loads (the layer files, a model-states file a stage, and at
ZeRO-1 the universal files under the pipeline's names; at ZeRO-0 each stage's optimizer state in its layout).
bin/export reads the layer files by the model's names (`whole_weights`)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.checkpoint import stage0, universal
from trainer.common.errors import ResumeError

Names = dict[str, dict[str, str]]  # {item index: {the item's parameter name: the model's}}


def recorded(ckpt: Path) -> dict[str, Any]:
    """The pipeline record of a checkpoint's plan ({} without stages)."""
    try:
        plan = json.loads((Path(ckpt) / "trainer_state.json").read_text()).get("plan") or {}
    except (OSError, ValueError):
        return {}
    return (plan.get("pipeline") or {}) if int(plan.get("pipeline_stages", 1) or 1) > 1 else {}


def saved_stages(ckpt: Path) -> int:
    """The pipeline stages a checkpoint was written with (1: none)."""
    parts = recorded(ckpt).get("parts")
    return len(parts) - 1 if parts else 1


def changed(ckpt: Path, engine: Any) -> bool:
    """Whether a checkpoint loads into `engine` only through a conversion for the stages: saved with another stage
    count (1: none) than the engine runs. A ResumeError where a checkpoint of stages lacks the record of its cut."""
    rec, pipe = recorded(ckpt), getattr(engine, "pipe", None)
    saved = len(rec["parts"]) - 1 if rec.get("parts") else 1
    now = int(engine.ds.num_stages) if pipe is not None else 1
    if saved != now and saved > 1 and not rec.get("names"):
        raise ResumeError(f"checkpoint.resume: {ckpt} was saved with pipeline stages, and its trainer_state.json "
                          "holds no record of their names; resume it at the saved layout")  # fmt: skip
    return saved != now


def stage_names(names: Names, parts: list[int], stage: int) -> list[str]:
    """A stage's parameter names in its PipelineModule's order: a tied embedding's first (the tied_modules, which
    DeepSpeed builds before the items: on the first and the last stage), then its items' in order."""
    last = parts[-1] - 1
    tied = str(last) not in names  # a tied head has no names of its own
    lo, hi = parts[stage], parts[stage + 1]
    out = [f"tied_modules.embed.{n}" for n in names["0"]] if tied and (lo == 0 or hi - 1 == last) else []
    for i in range(lo, hi):
        if not (tied and i in (0, last)):
            out += [f"{i}.{n}" for n in names[str(i)]]
    return out


def model_order(names: Names) -> list[str]:
    """The model's parameter names in its own order (its items' in sequence: the order of named_parameters)."""
    return [m for i in sorted(names, key=int) for m in names[i].values()]


def by_shape(order: list[str], shape: Callable[[str], Any]) -> list[list[str]]:
    """Names per optimizer group as trainer/model/create.py's param_groups makes them: the matrices (decayed),
    then the rest."""
    decay = [n for n in order if len(shape(n)) >= 2]
    rest = [n for n in order if len(shape(n)) < 2]
    return [decay, rest] if rest else [decay]


def check_target(engine: Any, names: list[list[str]]) -> None:
    """Every rank of a run in stages, before a conversion for it: the names its stage's optimizer groups have are
    those from_universal gives them (the order the conversion writes a ZeRO-0 stage's state in)."""
    module = engine.ds.module
    stage = int(engine.ds.stage_id)
    shapes = {n: p.shape for n, p in module.named_parameters()}
    made = by_shape(stage_names(module.names, module.parts, stage), shapes.__getitem__)
    if made != names:
        raise RuntimeError(f"stage {stage}: its optimizer's names {names} are not {made}")


def _prefixes(names: Names) -> dict[str, tuple[str, str]]:
    """Each item's own prefix and the model's for it ('layer.', 'model.layers.3.'): its buffers' names."""
    out = {}
    for i, item in names.items():
        for local, model in item.items():
            rest = local.partition(".")[2]
            out[i] = (local[: len(local) - len(rest)], model[: len(model) - len(rest)])
            break
    return out


def _item_state(names: Names, i: str, state: dict[str, Any]) -> dict[str, Any]:
    """A layer file's content from the model's tensors by name (its parameters, and its buffers by prefix)."""
    own, model = _prefixes(names).get(i, ("", None))
    out = {local: state[m] for local, m in names[i].items()}
    if model is not None:
        params = set(names[i].values())
        out.update(
            {own + k[len(model) :]: v for k, v in state.items() if k.startswith(model) and k not in params}
        )
    return out


def whole_weights(ckpt: Path, names: Names, info: dict[str, Any] | None = None) -> dict[str, Any]:
    """The model's weights and buffers from a checkpoint of pipeline stages, by the model's names (a tied head: the
    embedding, which the model ties again), as the layer files hold them (the training precision)."""
    import torch

    from trainer.checkpoint.universal import joined

    prefixes, info = _prefixes(names), tensor_parallel_info(ckpt) if info is None else info
    out = {}
    for index, item in names.items():
        # one file a tensor-parallel rank in a stage (layer_NN-model_TT-model_states.pt: 3D), else one
        found = sorted(Path(ckpt).glob(f"layer_{int(index):02d}-*model_states.pt"))
        if not found:
            raise FileNotFoundError(f"{ckpt}: no layer file for pipeline item {index}")
        own, model = prefixes[index]
        shards = [torch.load(f, map_location="cpu", weights_only=True) for f in found]
        for name in shards[0]:
            tensor = joined([s[name] for s in shards], f"{index}.{name}", info)
            out[item[name] if name in item else model + name[len(own) :]] = tensor
    return out


def tensor_parallel_info(ckpt: Path) -> dict[str, Any]:
    """The universal-checkpoint metadata AutoTP attached to each stage's model states (3D: which of the stage's
    parameters are replicated, which divided by rows, each one's shards), merged over the stages, a tied
    embedding's patterns also under its layer file's name ({} without tensor parallelism: its model-states files,
    which at ZeRO-0 hold the optimizer's state, are not read)."""
    import torch

    merged: dict[str, Any] = {}
    # (stages: ZeRO 0-1, a model-states file a stage's tensor rank)
    for f in sorted(Path(ckpt).glob("mp_rank_*_model_states.pt")) if saved_tp(ckpt) > 1 else ():
        info = torch.load(f, map_location="cpu", weights_only=False).get("universal_checkpoint_info") or {}
        for key, value in info.items():
            if isinstance(value, list):
                tied = [p.replace(TIED, "^0\\.") for p in value if isinstance(p, str) and p.startswith(TIED)]
                have = merged.setdefault(key, [])
                have.extend(v for v in [*value, *tied] if v not in have)
            elif key == "affine_map":
                merged.setdefault(key, {**value, "params": {}})["params"].update(value.get("params", {}))
            else:
                merged.setdefault(key, value)
    return merged


# a tied embedding's pipeline name (trainer/model/stages.py's TiedLayerSpec)
TIED = "^tied_modules\\.embed\\."


def saved_tp(ckpt: Path) -> int:
    """The tensor-parallel degree inside a checkpoint's stages (a model-states file a stage's tensor rank)."""
    return max(1, len(list(Path(ckpt).glob("mp_rank_*_model_states.pt"))) // saved_stages(ckpt))


def tensor_shards(ds: Any) -> dict[str, Any]:
    """Every rank of a run in stages with tensor parallelism (3D), before a conversion for it: each stage's tensor
    ranks' parameter shapes ({"tp": T, "shards": [{pipeline name: shape}, by model-parallel rank: stage x T +
    tensor rank]}, the data-parallel rank 0's), which `from_universal` cuts the layer files to: AutoTP's own
    division, uneven where a size does not divide ({} without it)."""
    import torch.distributed as dist

    tp = int(ds.autotp_size())
    if tp <= 1:
        return {}
    mine = (ds.grid.get_data_parallel_rank(), ds.grid.get_model_parallel_rank(),
            {n: list(p.shape) for n, p in ds.module.named_parameters()})  # fmt: skip
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {"tp": tp, "shards": [shapes for _, _, shapes in sorted(e for e in every if e[0] == 0)]}


def _cut(tensor: Any, name: str, shards: list[dict[str, Any]], stage: int, rank: int, tp: int) -> Any:
    """Tensor rank `rank`'s part of a stage's parameter (whole where its shape is the whole's: replicated)."""
    shapes = [shards[stage * tp + r].get(name) for r in range(tp)]
    if shapes[rank] is None or list(tensor.shape) == shapes[rank]:
        return tensor
    dim = next(d for d, (a, b) in enumerate(zip(tensor.shape, shapes[rank], strict=True)) if a != b)
    return tensor.narrow(dim, sum(s[dim] for s in shapes[:rank]), shapes[rank][dim]).clone()


# ----------------------------------------------------------------------------- the conversions (reshard.py's process


def to_universal(ckpt: Path, out: Path, zero: int, aliases: dict[str, str], workers: int) -> None:
    """The universal directory, by the model's names, from a checkpoint of stages at ZeRO stage `zero` (0: each
    stage's optimizer state in its model states; 1: DeepSpeed's ds_to_universal over the stages' partitions, which
    names them the pipeline's way); its model states a whole model's (`aliases`: the model's tied names)."""
    import torch

    from trainer.model.stages import model_name

    rec = recorded(ckpt)
    names, parts = rec["names"], rec["parts"]
    aliases = rec.get("aliases") or aliases
    info = tensor_parallel_info(ckpt)  # (3D: read once, for the layer files and DeepSpeed's conversion)
    weights = whole_weights(ckpt, names, info)
    if zero == 0:  # (fp32 only: torch's optimizer layout, the weights the layer files')
        params: dict[str, stage0.ParamState] = {}
        for s in range(len(parts) - 1):
            sd = torch.load(ckpt / f"mp_rank_{s:02d}_model_states.pt", map_location="cpu", weights_only=False)
            module = {n: weights[model_name(names, n)] for n in stage_names(names, parts, s)}
            read, hparams = stage0.read(
                sd["optimizer"], module, by_shape(list(module), lambda n: weights[model_name(names, n)].shape)
            )
            params.update({model_name(names, n): p for n, p in read.items()})
        universal.write_params(out, params, hparams, workers)
    else:
        universal.ds_to_universal(
            ckpt, out, workers, info or None
        )  # (3D: every stage's metadata in each file)
        for d in sorted((out / "zero").iterdir()):
            if d.is_dir():  # a tied weight: both ends' copies, the same after every step
                dst = out / "zero" / model_name(names, d.name)
                shutil.rmtree(d) if dst.exists() else d.rename(dst)
    ms = torch.load(ckpt / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    groups = by_shape(model_order(names), lambda n: weights[n].shape)
    ms.update(module={**weights, **{a: weights[t] for a, t in aliases.items() if t in weights}}, optimizer=None,
              param_shapes=[{n: weights[n].shape for n in g} for g in groups], shared_params={}, mp_world_size=1)  # fmt: skip
    ms.pop(
        "universal_checkpoint_info", None
    )  # (3D: the first stage's shards; the universal weights are whole)
    for f in out.glob("*model_states.pt"):
        f.unlink()
    torch.save(ms, out / "mp_rank_00_model_states.pt")
    if zero == 0:
        universal.link_or_copy(
            out / "mp_rank_00_model_states.pt", out / "zero_pp_rank_0_mp_rank_00_model_states.pt"
        )
    else:
        universal.fix_for_any_target(out)


def from_universal(uni: Path, out: Path, target: dict[str, Any], workers: int) -> None:
    """A checkpoint of stages its engine loads (`target`: reshard.target_of's, with the run's cut and names) from a
    universal directory by the model's names: the layer files (the fp32 weights in the module's precision, its
    buffers), a model-states file a stage and, at ZeRO-1, the universal files under the pipeline's names (which
    the engine loads as universal); at ZeRO-0 each stage's optimizer state in its engine's layout."""
    import torch

    from trainer.model.stages import model_name

    names, parts = target["pipeline"]["names"], target["pipeline"]["parts"]
    ms = torch.load(
        sorted(uni.glob("*mp_rank_00_model_states.pt"))[0], map_location="cpu", weights_only=False
    )
    params = dict(
        universal.parallel(lambda n: universal.read_param(uni / "zero", n), model_order(names), workers)
    )
    state = {**ms["module"], **{n: p.fp32.to(ms["module"][n].dtype) for n, p in params.items()}}
    tp, shards = target["pipeline"].get("tp", 1), target["pipeline"].get("shards")
    for i in names:
        item = _item_state(names, i, state)
        if tp == 1:
            torch.save(item, out / f"layer_{int(i):02d}-model_states.pt")
            continue
        s = max(k for k in range(len(parts) - 1) if parts[k] <= int(i))  # (3D: a file a tensor rank, cut)
        for r in range(tp):
            cut = {k: _cut(v, f"{i}.{k}", shards, s, r, tp) for k, v in item.items()}
            torch.save(cut, out / f"layer_{int(i):02d}-model_{r:02d}-model_states.pt")
    hparams = universal.hparams(uni)
    for s, r in ((s, r) for s in range(len(parts) - 1) for r in range(tp)):
        groups = by_shape(stage_names(names, parts, s), lambda n: params[model_name(names, n)].fp32.shape)
        osd = None
        if target["stage0"]:
            mine = {n: params[model_name(names, n)] for g in groups for n in g}
            osd = stage0.build(target["kind"], mine, groups, hparams, torch_states=target["torch_states"],
                               fields=target["fields"])  # fmt: skip
        else:
            for n in (n for g in groups for n in g):
                (out / "zero" / n).mkdir(parents=True, exist_ok=True)
                for f in (uni / "zero" / model_name(names, n)).glob("*.pt"):
                    if not (out / "zero" / n / f.name).exists():  # (a tied weight: on two stages)
                        universal.link_or_copy(f, out / "zero" / n / f.name)
        whole = {n: params[model_name(names, n)].fp32.shape for g in groups for n in g}
        shapes = [{n: shards[s * tp + r].get(n, whole[n]) if shards else whole[n] for n in g} for g in groups]
        torch.save({**ms, "module": None, "optimizer": osd, "param_shapes": shapes, "shared_params": {},
                    "mp_world_size": (len(parts) - 1) * tp}, out / f"mp_rank_{s * tp + r:02d}_model_states.pt")  # fmt: skip
    if not target["stage0"]:
        universal.link_or_copy(uni / "zero" / "optimizer_state.pt", out / "zero" / "optimizer_state.pt")
