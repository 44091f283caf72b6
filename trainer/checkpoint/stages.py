"""Checkpoints of pipeline stages (trainer/model/stages.py): DeepSpeed's pipeline engine writes each item's weights
as a layer file (layer_NN-model_states.pt, by the item's index in the whole model: the same whatever the stage
count) and a model-states and optimizer file a stage (mp_rank_SS). What reads them: a resume at the same stages,
world size and ZeRO stage (`check_resume`), and bin/export (`whole_weights`: the layer files by the model's names,
which trainer_state.json's plan records)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.common.errors import ResumeError


def saved_stages(ckpt: Path) -> int:
    """The pipeline stages a checkpoint was written with (1: none)."""
    try:
        plan = json.loads((Path(ckpt) / "trainer_state.json").read_text()).get("plan") or {}
    except (OSError, ValueError):
        return 1
    return int(plan.get("pipeline_stages", 1) or 1)


def check_resume(ckpt: Path, engine: Any, src: tuple[int, int], dst: tuple[int, int]) -> None:
    """A ResumeError where a checkpoint of pipeline stages would load into another layout, or one without stages
    into stages: `src`, `dst`: (ZeRO stage, data-parallel size) saved and now. The layer files would load at any
    stage count, but the optimizer's partitions are a stage's and DeepSpeed 0.19.8's universal conversion names
    the parameters by their place in the pipeline, not the model's: not converted here yet."""
    saved = saved_stages(ckpt)
    now = int(engine.ds.num_stages) if getattr(engine, "pipe", None) is not None else 1
    if saved == now == 1 or (saved == now and src == dst):
        return
    raise ResumeError(
        f"checkpoint.resume: {ckpt} was saved with {saved} pipeline stage(s) at ZeRO stage {src[0]} on {src[1]} "
        f"data-parallel rank(s); this run has {now} at stage {dst[0]} on {dst[1]}. A checkpoint with pipeline stages "
        "resumes with the same stages, ZeRO stage and data-parallel size (its optimizer states are each stage's, and "
        "the universal conversion does not map the stages' names to the model's yet). Resume with "
        f"strategy.pipeline_stages: {saved} on the saved world size, or write its weights with bin/export and start "
        "a run from them (model.pretrained)"
    )


def whole_weights(ckpt: Path, names: dict[str, dict[str, str]]) -> dict[str, Any]:
    """The model's weights from a checkpoint of pipeline stages, by the model's names (`names`: each layer file's,
    as trainer_state.json's plan records them; a tied head: the embedding, which the model ties again), as the layer
    files hold them (the training precision)."""
    import torch

    out = {}
    for index, item in names.items():
        found = sorted(Path(ckpt).glob(f"layer_{int(index):02d}-*model_states.pt"))
        if not found:
            raise FileNotFoundError(f"{ckpt}: no layer file for pipeline item {index}")
        state = torch.load(found[0], map_location="cpu", weights_only=True)
        for name, model_name in item.items():
            out[model_name] = state[name]
    return out
