"""The model: `create.py` makes it (from a transformers config, a local path or hub id, or a factory; `spec.py`: the config and attention a section specifies)
and counts it for the planner without allocating weights; `loss.py` is `model.chunked_loss` (imported
on its own: it needs torch, which planning does not import)."""

from trainer.model.create import build, count, disable_dropout, info, loss_of, param_groups
from trainer.model.spec import attention, check_seq_len, hf_config, positions, resolved

__all__ = [
    "attention",
    "build",
    "check_seq_len",
    "count",
    "disable_dropout",
    "hf_config",
    "info",
    "loss_of",
    "param_groups",
    "positions",
    "resolved",
]
