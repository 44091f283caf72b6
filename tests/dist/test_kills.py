"""Kills during a checkpoint save and a SIGTERM to one rank, on 2 ranks: `latest` keeps naming the
previous complete checkpoint, the job that was signalled saves and exits 0, and a run resumed from
either ends exactly like the uninterrupted run A of test_stages.py (ZeRO-2; conftest.runs makes it
once per test session, under torchrun). The faults strike jobs of the deepspeed launcher and of
torchrun; the resumed runs are torchrun jobs."""

import pytest
from helpers import K, assert_same_continuation, sigterm_rank_1, train
from helpers import resume_sets as sets

pytestmark = pytest.mark.dist


def test_kills_during_a_save_leave_the_previous_checkpoint(tmp_path, small_data, runs):
    """Synchronous saves (checkpoint.async: false). One run killed three times in a row, each time
    during its save at step 12, and resumed from step 6 after each: rank 1 killed while writing
    (rank 0 has finished its shards); every rank killed while writing; rank 0 killed after all
    shards are written but before `latest` is replaced. After each kill `latest` still names step 6
    and the interrupted save's leftovers stay; each resume starts from step 6 and saves over the
    previous attempt's leftovers; the last resume completes, cleans up and ends exactly like run A.
    (The launchers alternate: the kills are the same under both.)"""
    a = runs("zero2")
    ckpts = tmp_path / "run" / "checkpoints"
    s = sets(small_data, 2, **{"checkpoint.async": False})
    kills = [("killsave@12:rank=1", "deepspeed"), ("killsave@12", "torchrun"), ("killcommit@12:rank=0", "torchrun")]
    for i, (fault, launcher) in enumerate(kills):
        b = train(tmp_path, s, launcher=launcher, env={"TRAINER_FAULT": fault},
                   extra_args=["--resume"] if i else [], check=False)
        assert b.returncode != 0, f"{fault}: the job should have died\n{b.output[-3000:]}"
        if i:
            assert f"resumed from {ckpts / 'step_00000006'} at step 6" in b.output, (fault, b.output[-3000:])
        assert max(b.losses) == 12, fault  # it trained to step 12 and died in that step's save
        assert (ckpts / "latest").read_text().strip() == "step_00000006", fault
        assert not (ckpts / "step_00000012").exists(), fault
        assert (ckpts / ".tmp-step_00000012").exists(), f"{fault}: the interrupted save's leftovers stay until the next save"
    done = train(tmp_path, s, launcher="torchrun", extra_args=["--resume"])
    assert f"resumed from {ckpts / 'step_00000006'} at step 6" in done.output
    assert "written synchronously" in done.output
    assert (ckpts / "latest").read_text().strip() == "step_00000012"
    assert not (ckpts / ".tmp-step_00000012").exists(), "leftovers are cleaned by the next save"
    assert_same_continuation(a, done)


def test_sigterm_to_one_rank_saves_and_exits_0(tmp_path, small_data, runs):
    """A real SIGTERM from outside to rank 1 under the deepspeed launcher: the job saves and exits 0;
    the resumed run ends exactly like run A (rank 1 is slowed by 400 ms a step, which changes no
    number, so that the signal lands well before the end)."""
    a = runs("zero2")
    s = sets(small_data, 2)
    rc, out, took, stopped_at = sigterm_rank_1(tmp_path, s, "slow@1:rank=1:ms=400", after_lines=2)
    assert rc == 0, out[-3000:]
    print(f"SIGTERM to rank 1 -> checkpoint saved, job exited 0 after {took:.1f} s")
    assert took < 30, f"took {took:.1f} s"
    ckpts = tmp_path / "run" / "checkpoints"
    tag = f"step_{stopped_at:08d}"
    assert 2 <= stopped_at < 2 * K and "received SIGTERM" in out and f"stopping at step {stopped_at} on request" in out
    b2 = train(tmp_path, s, launcher="torchrun", extra_args=["--resume"])
    assert f"resumed from {ckpts / tag} at step {stopped_at}" in b2.output
    assert_same_continuation(a, b2, k=stopped_at)
