"""SLURM for real: a one-machine cluster of its own (scripts/slurm_local.sh: munged, slurmctld and
slurmd on loopback, stopped by their pids), the sbatch script of docs/launching.md submitted with 2
tasks on tiny: rank and world from Slurm's environment, USR1 mid-run (a pre-emption: scancel
--signal=USR1), the save, the requeue, and the requeued run resuming to the end (Slurm holds a
requeued job for its credential lifetime, 120 s by default, and tests pending jobs every 60 s:
the cluster sets cred_expire=10 and sched_interval=2, 190 s -> 32 s; starting the requeued job
earlier with `scontrol update StartTime=now` instead made its batch step fail at once in 5 of 8
tries). Skipped, saying why, where Slurm is not installed or this is not root."""

import os
import re
import subprocess
import sys
import time

import pytest
from helpers import FAST, ROOT, TINY, data_cache, free_port, private_services

pytestmark = pytest.mark.dist
SCRIPT = ROOT / "scripts" / "slurm_local.sh"


@pytest.fixture
def cluster():
    yield from private_services(
        "slurm_local.sh",
        "slurm",
        ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged"),
        ("sbatch", "scontrol", "scancel"),
        "Slurm (slurmctld slurmd slurm-client munge)",
    )


def documented_script() -> str:
    """The sbatch script of docs/launching.md."""
    text = (ROOT / "docs" / "launching.md").read_text()
    return re.search(r"```bash\n(#!/bin/bash\n#SBATCH.*?)```", text, re.S).group(1)


def test_the_documented_sbatch_script_saves_on_usr1_requeues_and_resumes(tmp_path, cluster):
    run_dir = tmp_path / "run"
    sets = {**FAST, "train.max_steps": 60, "train.log_every": 1, "checkpoint.save_final": True,
            "run_dir": run_dir, "data.cache_dir": data_cache()}  # fmt: skip
    script = documented_script()
    # this machine's shape: one node, 2 tasks of one core, no GPU; tiny instead of the 7B
    script = script.replace(
        "--nodes=2 --ntasks-per-node=8 --gpus-per-node=8 --cpus-per-task=12",
        "--nodes=1 --ntasks-per-node=2 --cpus-per-task=1",
    )
    script = script.replace("--time=48:00:00 ", "").replace("MASTER_PORT=29500", f"MASTER_PORT={free_port()}")
    script = script.replace(".venv/bin/python", sys.executable)
    script = script.replace(
        "configs/experiments/llama7b.yaml", f"{TINY} " + " ".join(f"--set {k}={v}" for k, v in sets.items())
    )
    assert "scontrol requeue" in script and "--cpus-per-task=1" in script and str(TINY) in script
    (tmp_path / "job.sh").write_text(script)
    out = tmp_path / "job.out"
    env = {**os.environ, "SLURM_CONF": str(cluster / "slurm.conf")}
    job = subprocess.run(["sbatch", "--parsable", f"--chdir={ROOT}", f"--output={out}", str(tmp_path / "job.sh")],
                         env=env, capture_output=True, text=True, timeout=60, check=True).stdout.strip()  # fmt: skip

    def state() -> str:
        show = subprocess.run(
            ["scontrol", "show", "job", job], env=env, capture_output=True, text=True
        ).stdout
        return re.search(r"JobState=(\w+)", show).group(1) if "JobState=" in show else "GONE"

    deadline = time.monotonic() + 300
    while not (out.exists() and re.search(r"step +5/60", out.read_text())):
        assert time.monotonic() < deadline and state() in ("PENDING", "RUNNING", "CONFIGURING"), (
            state(),
            out.read_text() if out.exists() else "",
        )
        time.sleep(0.5)
    subprocess.run(["scancel", "--signal=USR1", job], env=env, check=True, timeout=30)
    ended = 0  # polls in a row that saw a final state other than COMPLETED
    while (now := state()) != "COMPLETED":
        # a final state stays (20 s: a requeue under a loaded slurmctld can show FAILED for seconds)
        ended = ended + 1 if now in ("FAILED", "CANCELLED", "TIMEOUT") else 0
        if not (time.monotonic() < deadline + 300 and ended < 20):
            show = subprocess.run(
                ["scontrol", "show", "job", job], env=env, capture_output=True, text=True
            ).stdout
            log = (
                (cluster / "slurmctld.log").read_text()[-3000:]
                if (cluster / "slurmctld.log").exists()
                else ""
            )
            raise AssertionError(f"{now}\n{show}\n{log}\n{out.read_text()[-4000:]}")
        time.sleep(1)
    text = out.read_text()
    assert text.count("world: 2 rank(s) on 1 node(s) via slurm") == 2, text[
        -4000:
    ]  # the first run, the requeued one
    saved = re.search(r"stopping at step (\d+) on request; checkpoint saved", text)
    assert saved, text[-4000:]
    at = int(saved.group(1))
    assert f"resumed from {run_dir}/checkpoints/step_{at:08d} at step {at}" in text, text[-4000:]
    assert "done: 60 steps" in text
    show = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    assert "Restarts=1" in show, show
    print(
        f"slurm: USR1 at step ~5 -> saved at step {at}, exit 85, requeued (Restarts=1), resumed at {at}, done at 60"
    )
