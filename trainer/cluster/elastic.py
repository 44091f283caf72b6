"""Elastic continuation (`--min-nodes N` with a hostfile): a job that loses a node goes on with the
nodes that answer, from the latest checkpoint, with the same global batch.

Before every attempt the supervisor asks each host of the hostfile whether it answers (`ssh -o
BatchMode=yes HOST true`, as the deepspeed runner's own check does, with a timeout). With all of
them answering the attempt runs on the hostfile as given. Otherwise, when at least `--min-nodes`
answer, it runs on those: a hostfile of the survivors in the run directory, and `train.grad_accum`
raised so that micro batch x ranks x accumulation, the global batch, stays what it was (the data
order and the learning-rate schedule depend on the step and the global batch only, and a checkpoint
resumes on another world size with the same math: docs/checkpoints.md). A global batch the survivors
cannot hold exactly (the ranks lost do not divide it) stops the job with the reason, as do fewer
nodes than --min-nodes. A node that answers again is taken back at the next restart.
"""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from trainer.common.errors import UserError

PROBE_TIMEOUT_S = 10


def answers(host: str, timeout: int = PROBE_TIMEOUT_S) -> bool:
    """Whether `host` runs a command over ssh (non-interactively, within `timeout` seconds)."""
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={timeout}", host, "true"]
    try:
        return subprocess.run(cmd, capture_output=True, timeout=timeout + 5).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def answering(hosts: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """The hosts (with their slots) that answer, asked all at once."""
    with ThreadPoolExecutor(max_workers=min(32, len(hosts) or 1)) as pool:
        alive = list(pool.map(lambda h: answers(h[0]), hosts))
    return [h for h, ok in zip(hosts, alive, strict=True) if ok]


def kept_accumulation(world: int, accum: int, survivors: int, micro: int) -> int:
    """train.grad_accum on `survivors` ranks that keeps the global batch micro x world x accum; a
    UserError with the reason when no whole number does."""
    total = world * accum
    if total % survivors:
        raise UserError(
            f"--min-nodes: the global batch ({micro} x {world} ranks x grad_accum {accum} = {micro * total} sequences) "
            f"cannot be kept on the {survivors} rank(s) that answer ({world} x {accum} is not a multiple of {survivors}); "
            "not continuing on a different batch. Bring the nodes back, or give a global batch their ranks divide"
        )
    return total // survivors


def survivors_hostfile(run_dir: Path, alive: list[tuple[str, int]], attempt: int) -> Path:
    """A hostfile of the hosts that answer, in the run directory."""
    path = run_dir / ".supervisor" / f"hostfile.attempt-{attempt}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{h} slots={n}\n" for h, n in alive))
    return path


def on_survivors(sup: Any, attempt: int, overrides: list[str]) -> list[str] | None:
    """The overrides of `sup`'s (the Supervisor's) next attempt on the nodes that answer; it then
    launches on `sup.survivors` (the survivors' hostfile, None: the hostfile as given). None: too few
    answer, or the global batch cannot be kept on them (said why)."""
    if sup.min_nodes is None or not sup.hostfile:
        return overrides
    hosts = sup.hosts()
    alive = answering(hosts)
    rest = [o for o in overrides if o != sup.kept_accum]
    if len(alive) == len(hosts):
        if sup.survivors is not None:
            sup.say(f"every node answers again ({len(hosts)}): back on {sup.hostfile}")
        sup.survivors = sup.kept_accum = None
        return rest
    lost = ", ".join(h for h, n in hosts if (h, n) not in alive)
    if len(alive) < sup.min_nodes:
        sup.say(
            f"{len(alive)} of {len(hosts)} nodes answer (lost: {lost}); --min-nodes {sup.min_nodes}: stopping"
        )
        return None
    from trainer import config

    t = config.load(sup.experiment, sup.overrides).train
    if t.global_batch_size is not None:  # each attempt splits the global batch over its own ranks
        survivors = sum(n for _, n in alive)
        if t.global_batch_size % survivors:
            sup.say(f"--min-nodes: train.global_batch_size {t.global_batch_size} cannot be kept on the {survivors} "
                    "rank(s) that answer (not a multiple); not continuing on a different batch")  # fmt: skip
            return None
        sup.survivors = str(survivors_hostfile(sup.run_dir, alive, attempt))
        sup.say(f"{len(alive)} of {len(hosts)} nodes answer (lost: {lost}); continuing on {sup.survivors}, the "
                f"global batch of {t.global_batch_size} kept by train.global_batch_size")  # fmt: skip
        return rest
    try:
        accum = kept_accumulation(
            sum(n for _, n in hosts), t.grad_accum, sum(n for _, n in alive), t.micro_batch_size
        )
    except UserError as e:
        sup.say(str(e))
        return None
    sup.survivors = str(survivors_hostfile(sup.run_dir, alive, attempt))
    sup.kept_accum = f"train.grad_accum={accum}"
    sup.say(f"{len(alive)} of {len(hosts)} nodes answer (lost: {lost}); continuing on {sup.survivors} with "
             f"{sup.kept_accum}, the global batch kept")  # fmt: skip
    return [*rest, sup.kept_accum]
