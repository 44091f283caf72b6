"""Checkpoints on 2 ranks through the deepspeed launcher: exact resume, atomic `latest`, preemption.

Run A trains 2K steps straight (checkpoints every K). Run B, a new process, resumes from A's
checkpoint at K for K more steps: its per-step losses equal A's bit for bit (fp32 on CPU is
deterministic, dropout on) and the final weights are equal. Kills during a save and a SIGTERM to
one rank stop a run that is then resumed the same way. The data is small so that an epoch ends
inside the resumed part.
"""

import json
import os
import signal
import subprocess
import time

import psutil
import pytest
import yaml
from helpers import K, ROOT, TINY, command, env_for, resume_sets as sets, steps_after
from helpers import train as _train

pytestmark = pytest.mark.dist



def train(*args, **kwargs):
    return _train(*args, launcher="deepspeed", **kwargs)


@pytest.fixture(scope="session")
def straight(tmp_path_factory, small_data):
    """Run A per (stage, accum), shared by the tests of this module."""
    cache = {}

    def get(stage, accum=1):
        if (stage, accum) not in cache:
            cache[(stage, accum)] = train(tmp_path_factory.mktemp(f"A{stage}_{accum}"), sets(small_data, stage, accum))
        return cache[(stage, accum)]

    return get


def assert_same_continuation(a, b, k=K):
    assert sorted(steps_after(b, k)) == list(range(k + 1, 2 * K + 1)), b.losses
    assert steps_after(b, k) == steps_after(a, k)  # bit for bit
    assert b.rank_reports()[0]["param_digest"] == a.rank_reports()[0]["param_digest"]


@pytest.mark.parametrize(("stage", "accum"), [(0, 1), (1, 2), (2, 1), (3, 2)])
def test_stop_and_resume_is_exact(tmp_path, small_data, straight, stage, accum):
    """Run B resumes in a new process from run A's own checkpoint at step K (stopping at K on a
    signal, then resuming, is test_sigterm_to_one_rank_saves_and_exits_0)."""
    a = straight(stage, accum)

    # The checkpoint carries the exact DeepSpeed JSON, the resolved experiment and the state.
    d = a.run_dir / "checkpoints" / "step_00000006"
    ds_saved = json.loads((d / "ds_config.json").read_text())
    assert ds_saved == a.rank_reports()[0]["ds_config"]
    assert ds_saved["zero_optimization"]["stage"] == stage and ds_saved["gradient_accumulation_steps"] == accum
    assert yaml.safe_load((d / "experiment.yaml").read_text())["strategy"]["zero_stage"] == stage
    st = json.loads((d / "trainer_state.json").read_text())
    assert st["step"] == K and st["world_size"] == 2 and st["zero_stage"] == stage
    assert st["samples"] == K * 8 * accum and st["tokens"] == st["samples"] * 128
    assert st["data_position"]["sample"] > 0, "the checkpoint should fall in the middle of an epoch"
    assert {"torch", "deepspeed", "transformers"} <= set(st["versions"]) and st["plan"]["stage"] == stage
    assert all((d / f).stat().st_size == n for f, n in st["files"].items())

    b = train(tmp_path, sets(small_data, stage, accum), extra_args=["--resume", str(d)])
    assert f"resumed from {d} at step 6" in b.output
    final = json.loads((b.run_dir / "checkpoints" / "step_00000012" / "trainer_state.json").read_text())
    assert final["data_position"]["epoch"] > st["data_position"]["epoch"], "an epoch should end after the resume"
    assert_same_continuation(a, b)


@pytest.mark.parametrize("fault", ["killsave@12:rank=1", "killsave@12", "killcommit@12:rank=0"])
def test_a_kill_during_a_save_leaves_the_previous_checkpoint(tmp_path, small_data, straight, fault):
    """Rank 1 killed while writing (rank 0 has finished its shards), every rank killed while
    writing, rank 0 killed after all shards are written but before `latest` is replaced."""
    a = straight(2)
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
def test_sigterm_to_one_rank_saves_and_exits_0(tmp_path, small_data, straight):
    """A real SIGTERM from outside to rank 1 under the deepspeed launcher: the job saves and exits 0."""
    s = sets(small_data, 2, **{"train.max_steps": 400})
    args = [str(TINY)]
    for k, v in {**s, "run_dir": str(tmp_path / "run"), "data.cache_dir": str(ROOT / ".cache" / "test-data")}.items():
        args += ["--set", f"{k}={v}"]
    env = env_for(2, {"TRAINER_DEBUG_DIR": str(tmp_path / "debug")})
    proc = subprocess.Popen(command("deepspeed", 2, args), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.2)
    rank1 = [p for p in psutil.Process(proc.pid).children(recursive=True) if "--local_rank=1" in " ".join(p.cmdline())]
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
    assert 3 <= stopped_at < 400 and "received SIGTERM" in out
    b2 = train(tmp_path, s, extra_args=["--resume"] , env={"TRAINER_FAULT": f"term@{stopped_at + 2}"})
    assert f"resumed from {ckpts / tag} at step {stopped_at}" in b2.output
    ref = train(tmp_path / "ref", {**s, "train.max_steps": 400}, env={"TRAINER_FAULT": f"term@{stopped_at + 2}"})
    after = {k: v for k, v in b2.losses.items() if k > stopped_at}
    assert sorted(after) == [stopped_at + 1, stopped_at + 2]
    assert after == {k: v for k, v in ref.losses.items() if k > stopped_at}
