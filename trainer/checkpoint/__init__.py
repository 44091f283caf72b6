"""Checkpoints you can trust.

- `disk.py`: the layout on disk, reading and verifying one checkpoint (its manifest and digests);
- `fs.py`: the file-system operations, in one object (the crash test simulates it);
- `journal.py`: the lineage journal, one fsynced record per commit, fork, set-aside, prune, conversion;
- `lineage.py`: which checkpoint a resume, a restart and pruning take (pure: journal + scan);
- `resolve.py`: what `--resume`, `checkpoint.resume` and `bin/export` name, on lineage's decision;
- `directory.py`: what changes the directory (the manifest, the commit, pruning, setting aside), and
  `begin.py`: the start of a run there (leftovers, a rollback's fork, damaged ones set aside);
- `store.py`: saving one atomically (`Store`: staging, the writers, the barrier, the commit);
- `restore.py`: loading one into the Store's engine (`restore.load`);
- `cadence.py`: when to save (`Checkpointer`, which the loop offers every step; `Cadence`), the
  commit of a save written in the background, then pruning;
- `writer.py`: asynchronous saves (`checkpoint.async`): the host copy and the writer thread;
- `policy.py`: what a resume may change and what it refuses (`Resume`);
- `reshard.py`: resuming on another ZeRO stage or world size (the universal conversion);
- `stage0.py`: the optimizer-state layouts of stage-0 checkpoints (fp32, bf16/fp16 wrappers);
- `frozen.py`: LoRA checkpoints without the frozen base, and the frozen weights' digest;
- `export.py`: a checkpoint of any stage -> a Hugging Face model directory (`bin/export`).
"""

from trainer.checkpoint.cadence import Checkpointer, CheckpointWriteError
from trainer.checkpoint.disk import (
    LATEST,
    STAGING_PREFIX,
    STATE,
    Found,
    before,
    checkpoints_dir,
    complete,
    read_state,
    tag_for,
    verify,
)
from trainer.checkpoint.policy import HARMLESS, Resume, check_compatible, differences
from trainer.checkpoint.resolve import latest, resolve_resume
from trainer.checkpoint.store import Store

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
