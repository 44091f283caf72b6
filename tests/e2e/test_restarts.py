"""The supervisor (`bin/train --launcher ... --max-restarts N`) restarts what a restart can fix and
nothing else, keeps what the job was started from, and stops when asked to, also between attempts.

Jobs of one process (`--launcher none`) unless the launcher matters: torchrun reports its own exit
code (1) for any failed rank, so the not-retried conversion failure runs under it."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from helpers import FAST, ROOT, TINY, TRAIN, cli, data_cache, env_for, train, yaml_value

pytestmark = pytest.mark.e2e

SMALL = {**FAST, "model.config.n_layer": 1, "train.max_steps": 10, "data.eval_fraction": 0}


def supervise(tmp_path, sets, *, launcher="none", restarts=2, fault="", extra=()):
    args = [
        "--launcher",
        launcher,
        "--max-restarts",
        restarts,
        *(["--nproc-per-node", 2] if launcher != "none" else []),
    ]
    code, out = cli({"run_dir": tmp_path / "run", **sets}, *args, *extra, env={"TRAINER_FAULT": fault})
    return code, out, attempts(tmp_path / "run")


def attempts(run_dir):
    path = run_dir / "attempts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_resume_that_cannot_succeed_is_not_retried(tmp_path):
    """A checkpoint that fails to convert for another stage (injected in the conversion process) ends
    the job at once with exit 2 and what failed, every rank told by rank 0's report, instead of
    spending every restart on the same failure. torchrun itself exits 1: the supervisor knows from
    the rank's record."""
    src = train(tmp_path / "src", {**SMALL, "checkpoint.every_steps": 5}, debug=False)
    ckpt = src.run_dir / "checkpoints" / "step_00000005"
    code, out, tries = supervise(
        tmp_path, {**SMALL, "strategy.zero_stage": 2}, launcher="torchrun", fault="convertfail",
        extra=["--resume", str(ckpt)],
    )  # fmt: skip
    assert code == 2, out[-3000:]
    assert len(tries) == 1 and tries[0]["exit"] == 1 and tries[0]["failure"]["exit"] == 2
    assert "injected conversion failure" in tries[0]["failure"]["message"]
    assert "failed with a configuration or input error (exit 2)" in out
    assert "not restarting: another attempt would fail the same way" in out
    assert "[supervisor] attempt 1" not in out


def test_a_non_finite_loss_is_not_retried(tmp_path):
    code, out, tries = supervise(tmp_path, SMALL, fault="nan@3")
    assert code == 4 and len(tries) == 1, out[-3000:]
    assert "failed with a non-finite loss" in out and "[supervisor] attempt 1" not in out


def test_a_crash_before_the_first_checkpoint_restarts_from_the_resume_path(tmp_path):
    """Started with --resume PATH (another run's checkpoint), the job crashes before its own first
    checkpoint: the restart resumes from PATH again, not from scratch."""
    src = train(tmp_path / "src", {**SMALL, "checkpoint.every_steps": 5}, debug=False)
    ckpt = src.run_dir / "checkpoints" / "step_00000005"
    code, out, tries = supervise(
        tmp_path,
        {**SMALL, "checkpoint.every_steps": 0},
        fault="raise@8:attempt=0",
        extra=["--resume", str(ckpt)],
    )
    assert code == 0, out[-3000:]
    assert [t["exit"] != 0 for t in tries] == [True, False]
    assert f"restarting in 2 s from {ckpt}" in out
    assert out.count(f"resumed from {ckpt} at step 5") == 2
    steps = [
        json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert min(steps) == 6, "no attempt started from scratch"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_the_back_off_stops_the_supervisor(tmp_path, sig):
    """The first attempt fails; while the supervisor waits to restart, a signal stops it: no further
    attempt starts, and it exits 128 + the signal within a second."""
    args = [sys.executable, str(TRAIN), str(TINY), "--launcher", "none", "--max-restarts", "3"]
    for k, v in {**SMALL, "run_dir": tmp_path / "run", "data.cache_dir": data_cache()}.items():
        args += ["--set", f"{k}={yaml_value(v)}"]
    p = subprocess.Popen(args, cwd=ROOT, env=env_for(1, {"TRAINER_FAULT": "raise@2:attempt=0"}),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    killer = threading.Timer(240, p.kill)
    killer.start()
    lines, signalled = [], None
    try:
        for line in p.stdout:
            lines.append(line)
            if signalled is None and "[supervisor] attempt 0 failed" in line and "restarting in" in line:
                os.kill(p.pid, sig)
                signalled = time.time()
        p.wait()
    finally:
        killer.cancel()
    out = "".join(lines)
    assert signalled is not None, out[-3000:]
    took = time.time() - signalled
    print(f"{sig.name} during the back-off: supervisor exited {p.returncode} after {took:.2f} s")
    assert p.returncode == 128 + sig and took < 1.5, out[-3000:]
    assert f"[supervisor] {sig.name} during the back-off: stopping" in out
    assert "[supervisor] attempt 1" not in out and len(attempts(tmp_path / "run")) == 1
