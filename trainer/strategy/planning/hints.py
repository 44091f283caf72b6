"""What would make a rung fit when nothing does, said beside the table (`fit_hint`): the tiled loss where the whole
logits cost a rung, or fewer completions a generate call where generation's key/value cache does (GRPO)."""

from __future__ import annotations

import dataclasses

from trainer.config import Experiment, chunked_loss_problem, format_size
from trainer.strategy.planning.activations import activations_for
from trainer.strategy.planning.candidates import LADDER, Candidate, ModelInfo
from trainer.strategy.planning.estimate import Estimate
from trainer.strategy.planning.generation import generation_hint
from trainer.strategy.planning.levers import Levers


def fit_hint(
    exp: Experiment, info: ModelInfo, by: dict[Candidate, Estimate], levers: Levers, budget: int, lp: int,
    device: str = "cuda",
) -> str:  # fmt: skip
    """The tiled loss's hint, else generation's (empty when neither would make a rung fit)."""
    return chunked_loss_hint(exp, info, by, levers, budget, lp, device) or generation_hint(
        exp, info, by, budget, lp
    )


def chunked_loss_hint(
    exp: Experiment, info: ModelInfo, by: dict[Candidate, Estimate], levers: Levers, budget: int, lp: int,
    device: str = "cuda",
) -> str:  # fmt: skip
    """When nothing fits and the whole logits cost a rung of the ladder (or every rung): what
    model.chunked_loss would save per rank, and the rung that would then fit. Empty when it would
    change nothing."""
    if (
        levers.chunked_loss
        or levers.tp > 1  # the tiled loss needs the LM head whole (levers.py's TP_TILED)
        or levers.pp > 1  # and the logits where the pipeline's loss sees them (refused under stages)
        or exp.model.factory is not None
        or info.chunked_problem
        or chunked_loss_problem(info.model_type)
    ):
        return ""
    import dataclasses as dc

    saved = activations_for(exp, info, lp, levers, device) - activations_for(
        exp, info, lp, dc.replace(levers, chunked_loss=True), device
    )
    if saved <= 0:
        return ""
    ladder = [by[c] for c in LADDER]
    for e in ladder:
        if e.fits or e.candidate.offload == "nvme":
            return ""  # the rungs below the chosen one would not fit even without the logits
        if e.refused:  # refused whatever its size (8bit at ZeRO-3, the static generation cache)
            continue
        if e.fits_host and dataclasses.replace(e, activations=e.activations - saved).total <= budget:
            return (
                f"set model.chunked_loss: true (no whole logits: {format_size(saved)} less per rank) "
                f"and {e.candidate.name} fits"
            )
    return ""
