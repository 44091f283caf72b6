"""Checkpoints you can trust.

- `store.py`: the layout on disk, finding and verifying checkpoints, saving one atomically, loading;
- `cadence.py`: when to save (`Checkpointer`, which the loop offers every step), the commit of a
  save written in the background, then pruning;
- `writer.py`: asynchronous saves (`checkpoint.async`): the host copy and the writer thread;
- `policy.py`: what a resume may change and what it refuses (`Resume`);
- `reshard.py`: resuming on another ZeRO stage or world size (the universal conversion);
- `stage0.py`: the optimizer-state layouts of stage-0 checkpoints (fp32, bf16/fp16 wrappers);
- `export.py`: a checkpoint of any stage -> a Hugging Face model directory (`bin/export`).
"""

from trainer.checkpoint.cadence import Checkpointer, CheckpointWriteError
from trainer.checkpoint.policy import HARMLESS, Resume, check_compatible, differences
from trainer.checkpoint.store import (
    LATEST,
    STAGING_PREFIX,
    STATE,
    Found,
    Store,
    before,
    checkpoints_dir,
    complete,
    latest,
    read_state,
    resolve_resume,
    tag_for,
    verify,
)

__all__ = [
    "HARMLESS",
    "LATEST",
    "STAGING_PREFIX",
    "STATE",
    "CheckpointWriteError",
    "Checkpointer",
    "Found",
    "Resume",
    "Store",
    "before",
    "check_compatible",
    "checkpoints_dir",
    "complete",
    "differences",
    "latest",
    "read_state",
    "resolve_resume",
    "tag_for",
    "verify",
]
