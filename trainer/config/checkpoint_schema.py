"""checkpoint: when and how checkpoints are written, resumed and kept (docs/checkpoints.md)."""

from __future__ import annotations

from pydantic import Field

from trainer.config.fields import AutoBool, Section, auto_or, choice

FLEET_MTBF_NODE_HOURS = 6335.0


class CheckpointSection(Section):
    """When and how checkpoints are written and resumed (see docs/checkpoints.md)."""

    every_steps: int = Field(0, ge=0, description="save every N steps (0 = off)")
    every_minutes: auto_or(float, "a number of minutes") = Field(
        0.0,
        description="save every N minutes (0 = off); auto = the Young/Daly interval from the measured cost of a "
        "save and mtbf_hours (docs/checkpoints.md)",
    )
    mtbf_hours: float = Field(
        FLEET_MTBF_NODE_HOURS,
        gt=0.0,
        description="with every_minutes: auto, each node's mean time between failures; default from the Llama 3 "
        "paper's fleet: 419 interruptions in 54 days on 2,048 nodes of 8 H100s",
    )
    keep_last: int = Field(3, ge=0, description="keep the newest N complete checkpoints (0 = all)")
    on_rollback: choice("keep", "remove") = Field(
        "keep",
        description="resuming from a checkpoint older than the run directory's newest (a rollback): keep = the "
        "newer checkpoints of the abandoned line are moved to checkpoints/abandoned/, remove = deleted; either way "
        "they are never resumed or pruned by mistake (see docs/checkpoints.md)",
    )
    keep_abandoned: int = Field(
        2,
        ge=0,
        description="how many lines left by rollbacks checkpoints/abandoned/ keeps (the newest; older ones are "
        "deleted at a start, each recorded in the journal)",
    )
    keep_damaged: int = Field(
        2,
        ge=0,
        description="how many checkpoints passed over as damaged checkpoints/damaged/ keeps for a look (the newest)",
    )
    save_final: bool = Field(True, description="save at the end of training")
    save_on_signal: bool = Field(True, description="on SIGTERM/SIGUSR1: finish the step, save, exit")
    signal_exit_code: int = Field(0, ge=0, le=255, description="exit status after a save on a signal")
    resume: choice("never", "auto") = Field(
        "never", description="auto = resume from the latest complete checkpoint if there is one"
    )
    on_data_change: choice("error", "continue") = Field(
        "error",
        description="on resume, when the training data differs from the checkpoint's: error, or continue "
        "at the saved position in the new data (see docs/checkpoints.md)",
    )
    async_: AutoBool = Field(
        "auto",
        alias="async",
        description="write checkpoints in the background: a save copies the state to host memory at a step "
        "boundary and training goes on while it is written; true, false (every rank waits until its files are "
        "written), or auto = true unless the copy does not fit in host memory (the plan's host/node column)",
    )
    lock_wait_s: float | None = Field(
        None,
        ge=0,
        description="how long a job waits for another that still holds its run directory (a requeued job "
        "overlapping the dying one, which saves on SIGTERM) before it stops naming the holder; 0 = stop at once; "
        "unset: 300 s, or half of dist.timeout_s where that is less. Below dist.timeout_s: the other ranks wait "
        "for it in a collective",
    )
    convert_timeout_minutes: float = Field(
        120.0,
        gt=0,
        description="how long every rank waits for a checkpoint's conversion to another stage or world size",
    )
