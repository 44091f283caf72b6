"""Asynchronous checkpoints (checkpoint.async) on 2 ranks, with the write in flight while training
goes on: kills leave the previous checkpoint as `latest` and a resume from it ends exactly like the
uninterrupted run A (ZeRO-2, conftest.runs); SIGTERM waits for the write in flight and then saves
the step it stopped at; a failed write stops every rank at the next step. (Bitwise resume from a
checkpoint written in the background, at every stage in fp32 and bf16: test_stages.py and
test_bf16_stages.py, whose runs A write theirs so.) A checkpoint every 3 steps gives a committed
one (step 6) before the one the faults strike (step 9)."""

import pytest
from helpers import ROOT, assert_same_continuation, saves, sigterm_rank_1, train
from helpers import resume_sets as sets

pytestmark = pytest.mark.dist

ASYNC = {"checkpoint.every_steps": 3, "checkpoint.async": True}


def test_kills_with_a_background_write_in_flight_leave_the_previous_checkpoint(tmp_path, small_data, runs):
    """One run killed three times while step 9's checkpoint is written in the background and
    training goes on, resumed from step 6 after each: rank 1 killed after the first of its files,
    rank 0's already done (the window between two ranks' ends); every rank killed once its files are
    written; rank 0 killed when, every rank done, it commits. `latest` names step 6 after each; the last
    resume ends exactly like run A. (Taking references instead of the copy makes the last resume differ
    from run A; committing before every rank is done leaves `latest` at step 9. Rank 1 killed once all
    its files are written and reported may leave a complete step 9, which rank 0 then commits on its way
    out, tests/e2e/test_lineage_cases.py: not this test's window.)"""
    a = runs("zero2")
    ckpts = tmp_path / "run" / "checkpoints"
    s = sets(small_data, 2, **ASYNC)
    # The first attempt also writes step 6 1.5 s late, while steps 7-9 change the live state: the
    # final resume from it then proves the files hold the copy taken at step 6.
    kills = [("killfile@9:n=1:rank=1,slowsave@9:rank=1:ms=1500,slowsave@6:ms=1500", "deepspeed"), ("killsave@9", "torchrun"),
             ("killcommit@9:rank=0", "torchrun")]  # fmt: skip
    for i, (fault, launcher) in enumerate(kills):
        b = train(tmp_path, s, launcher=launcher, env={"TRAINER_FAULT": fault},
                  extra_args=["--resume"] if i else [], check=False)  # fmt: skip
        assert b.returncode != 0, f"{fault}: the job should have died\n{b.output[-3000:]}"
        if i:
            assert f"resumed from {ckpts / 'step_00000006'} at step 6" in b.output, (fault, b.output[-3000:])
        assert max(b.losses) > 9, f"{fault}: training should go on while step 9 is written: {b.losses}"
        assert (ckpts / "latest").read_text().strip() == "step_00000006", fault
        assert not (ckpts / "step_00000009").exists(), fault
        assert (ckpts / ".tmp-step_00000009").exists(), fault
        if i == 0:
            assert "step_00000006 saved: training blocked" in b.output, "saved in the background"
    done = train(tmp_path, s, launcher="torchrun", extra_args=["--resume"])
    assert f"resumed from {ckpts / 'step_00000006'} at step 6" in done.output
    assert (ckpts / "latest").read_text().strip() == "step_00000012"
    assert not (ckpts / ".tmp-step_00000009").exists(), "leftovers are cleaned by the next save"
    assert_same_continuation(a, done)


def test_sigterm_with_a_background_write_in_flight_waits_for_it_then_saves(tmp_path, small_data, runs):
    """SIGTERM to rank 1 while step 3's checkpoint is still being written (rank 1's write takes 4 s
    more, rank 1 is 400 ms a step slower, which changes no number): the job waits for that write,
    commits step 3, saves the step it stopped at and exits 0 within the grace period; the resumed
    run ends exactly like run A."""
    a = runs("zero2")
    s = sets(small_data, 2, **ASYNC)
    fault = "slow@1:rank=1:ms=400,slowsave@3:rank=1:ms=4000"
    rc, out, took, stopped_at = sigterm_rank_1(tmp_path, s, fault, after_lines=4)
    assert rc == 0, out[-3000:]
    print(f"SIGTERM with a write in flight -> waited, saved, exited 0 after {took:.1f} s")
    assert took < 30, f"took {took:.1f} s"
    ckpts = tmp_path / "run" / "checkpoints"
    tag = f"step_{stopped_at:08d}"
    assert 4 <= stopped_at < 12 and f"stopping at step {stopped_at} on request" in out, out[-3000:]
    rec = saves(tmp_path / "run")
    assert rec["step_00000003"]["step"] == stopped_at, f"step 3 was still being written at the stop: {rec}"
    assert rec["step_00000003"]["write_s"] >= 4.0, rec
    assert (ckpts / "step_00000003" / "trainer_state.json").exists()
    assert out.index("checkpoints/step_00000003 saved") < out.index(f"checkpoints/{tag} saved")
    b2 = train(tmp_path, s, launcher="torchrun", extra_args=["--resume"])
    assert f"resumed from {ckpts / tag} at step {stopped_at}" in b2.output
    assert_same_continuation(a, b2, k=stopped_at)


def test_a_failed_background_write_stops_every_rank_at_the_next_step(tmp_path, small_data):
    """Rank 1's write of step 9 fails as on a full disk: at step 10's collective every rank stops
    with the error (rank 1 with the OSError itself), no traceback; `latest` stays at step 6."""
    s = sets(small_data, 2, **ASYNC)
    b = train(tmp_path, s, launcher="torchrun", env={"TRAINER_FAULT": "failsave@9:rank=1"}, check=False)
    assert b.returncode != 0
    assert max(b.losses) == 10, f"noticed at the next step: {b.losses}"
    said = "error: checkpoint step_00000009: writing it failed on rank(s) 1"
    assert f"[rank 0] {said}. It was not committed" in b.output, b.output[-3000:]
    assert f"[rank 1] {said} here: OSError: [Errno 28] No space left on device" in b.output, b.output[-3000:]
    assert 'File "' + str(ROOT / "trainer") not in b.output, "no traceback from a rank: " + b.output[-3000:]
    ckpts = tmp_path / "run" / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000006"
    assert not (ckpts / "step_00000009").exists()
