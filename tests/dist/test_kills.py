"""Kills during a checkpoint save and a SIGTERM to one rank, on 2 ranks through the deepspeed
launcher: `latest` keeps naming the previous complete checkpoint, the job that was signalled saves
and exits 0, and a run resumed from either ends exactly like the uninterrupted run A of
test_stages.py (ZeRO-2; conftest.runs makes it once per test session)."""

import os
import signal
import subprocess
import time

import psutil
import pytest
from helpers import K, ROOT, TINY, assert_same_continuation, command, data_cache, env_for
from helpers import resume_sets as sets
from helpers import train as _train

pytestmark = pytest.mark.dist


def train(*args, **kwargs):
    return _train(*args, launcher="deepspeed", **kwargs)


@pytest.mark.parametrize("fault", ["killsave@12:rank=1", "killsave@12", "killcommit@12:rank=0"])
def test_a_kill_during_a_save_leaves_the_previous_checkpoint(tmp_path, small_data, runs, fault):
    """Rank 1 killed while writing (rank 0 has finished its shards), every rank killed while
    writing, rank 0 killed after all shards are written but before `latest` is replaced."""
    a = runs("zero2")
    b1 = train(tmp_path, sets(small_data, 2), env={"TRAINER_FAULT": fault}, check=False)
    assert b1.returncode != 0
    ckpts = b1.run_dir / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000006"
    assert not (ckpts / "step_00000012").exists()
    assert (ckpts / ".tmp-step_00000012").exists(), "the interrupted save's leftovers stay until the next save"
    b2 = train(tmp_path, sets(small_data, 2), extra_args=["--resume"])
    assert "resumed from" in b2.output and "step_00000006" in b2.output
    assert not (ckpts / ".tmp-step_00000012").exists(), "leftovers are cleaned by the next save"
    assert_same_continuation(a, b2)


def test_sigterm_to_one_rank_saves_and_exits_0(tmp_path, small_data, runs):
    """A real SIGTERM from outside to rank 1 under the deepspeed launcher: the job saves and exits 0;
    the resumed run ends exactly like run A (rank 1 is slowed by 400 ms a step, which changes no
    number, so that the signal lands well before the end)."""
    a = runs("zero2")
    s = sets(small_data, 2)
    args = [str(TINY)]
    for k, v in {**s, "run_dir": str(tmp_path / "run"), "data.cache_dir": str(data_cache())}.items():
        args += ["--set", f"{k}={v}"]
    env = env_for(2, {"TRAINER_DEBUG_DIR": str(tmp_path / "debug"), "TRAINER_FAULT": "slow@1:rank=1:ms=400"})
    proc = subprocess.Popen(
        command("deepspeed", 2, args), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        time.sleep(0.1)
    rank1 = [
        p for p in psutil.Process(proc.pid).children(recursive=True) if "--local_rank=1" in " ".join(p.cmdline())
    ]
    assert rank1, "rank 1 not found"
    t0 = time.time()
    os.kill(rank1[0].pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    took = time.time() - t0
    assert proc.returncode == 0, out[-3000:]
    print(f"SIGTERM to rank 1 -> checkpoint saved, job exited 0 after {took:.1f} s")
    assert took < 30, f"took {took:.1f} s"
    ckpts = tmp_path / "run" / "checkpoints"
    tag = (ckpts / "latest").read_text().strip()
    stopped_at = int(tag.split("_")[1])
    assert 2 <= stopped_at < 2 * K and "received SIGTERM" in out and f"stopping at step {stopped_at} on request" in out
    b2 = train(tmp_path, s, extra_args=["--resume"])
    assert f"resumed from {ckpts / tag} at step {stopped_at}" in b2.output
    assert_same_continuation(a, b2, k=stopped_at)
