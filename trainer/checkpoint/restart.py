"""What a supervisor's restart resumes (trainer/run/supervisor.py), from the lineage's journal and the manifests'
job ids: the `--resume PATH` the job was started with until the job commits a checkpoint of its own, then the
line's newest; where the journal is damaged, the job's own newest checkpoint by path (a new line)."""

from __future__ import annotations

from pathlib import Path

from trainer.checkpoint.disk import checkpoints_dir
from trainer.checkpoint.fs import LOCAL, LocalFS
from trainer.checkpoint.lineage import View, plain
from trainer.common.errors import UserError


def restart_resume(
    run_dir: Path, started_with: str | None, job: str | None, fs: LocalFS = LOCAL
) -> str | None:
    """What a supervisor's restart resumes: the `--resume PATH` the job was started with until this job
    committed a checkpoint of its own (a rollback killed before it forked, or before its first save, is
    done again), then the line's newest (`latest`); nothing resumable: as started. Where a plain resume
    refuses (the journal damaged), the job's own newest checkpoint here, by path: its manifest names the
    job (a restart had resumed the path it started with, which a prune may have removed since)."""
    view = View.read(checkpoints_dir(run_dir), fs)
    own = [e for e in view.disk if job and e.state is not None and same_job(e.lineage("job"), job)]
    mine = any(same_job(r.get("job"), job) for r in view.events("commit")) or bool(own)
    if started_with not in (None, "latest") and not (job and mine):
        return started_with
    try:
        if plain(view).found is not None:
            return "latest"
    except UserError:
        if own:
            return str(max(own, key=lambda e: e.step).path)
        return "latest" if job and mine else started_with  # refused again, with the journal's reason
    return started_with


def same_job(recorded: str | None, job: str | None) -> bool:
    """A commit's job is this job's: the same id, or a Slurm job's allocation before this one (a requeue:
    `slurm-<id>.<restart count>/...`, cluster/dist.slurm_job), whose every command's commits it continues."""
    if recorded is None or job is None:
        return False
    if recorded == job:
        return True
    was, now = (
        j.split("/", 1)[0].rpartition(".") if j.startswith("slurm-") else ("", "", "")
        for j in (recorded, job)
    )
    return (
        bool(was[0])
        and was[0] == now[0]
        and was[2].isdigit()
        and now[2].isdigit()
        and int(was[2]) < int(now[2])
    )
