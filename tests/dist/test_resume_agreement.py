"""Two jobs on one run directory, ranks that disagree about what to resume, and resumes whose
checkpoint conversion is slow or interrupted, through real processes (2 ranks under torchrun).

- A second job on a run directory a live job holds waits checkpoint.lock_wait_s for it (saying so), then stops
  naming the holder; the first job goes on untouched; once the holder is killed (SIGKILL: no clean-up), its
  lock does not block.
- Ranks that found different checkpoints (a node-local run_dir or a stale network filesystem,
  injected here: rank 1 sees the checkpoint before the latest) stop before building anything,
  naming the ranks and what each found.
- The conversion of a checkpoint for another stage or world size runs outside any collective: one
  that takes longer than dist.timeout_s succeeds. One whose rank is killed midway leaves only a
  hidden directory, and the next resume converts again from scratch and continues as the
  uninterrupted run does.
"""

import os
import re
import shutil
import signal
import subprocess
import threading
import time

import psutil
import pytest
from helpers import FAST, NODROP, ROOT, TINY, K, command, data_cache, env_for, steps_after, train, yaml_value
from helpers import resume_sets as sets

from trainer.checkpoint import latest

pytestmark = pytest.mark.dist


def args_for(sets_: dict) -> list[str]:
    out = [str(TINY)]
    for k, v in sets_.items():
        out += ["--set", f"{k}={yaml_value(v)}"]
    return out


def test_a_second_job_on_a_held_run_dir_waits_then_stops_naming_the_holder(tmp_path):
    run_dir = tmp_path / "run"
    base = {**FAST, "model.config.n_layer": 1, "run_dir": run_dir, "data.cache_dir": data_cache(),
            "checkpoint.every_steps": 2, "data.eval_fraction": 0}  # fmt: skip
    first = subprocess.Popen(
        command("none", 1, args_for({**base, "train.max_steps": 400})),
        cwd=ROOT, env=env_for(1, {"TRAINER_FAULT": "slow@1:ms=150"}), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    killer = threading.Timer(300, first.kill)
    killer.start()
    try:
        for line in first.stdout:
            if "step      2/400" in line:
                break
        # The same job again (a double launch, a requeued job): it waits checkpoint.lock_wait_s for the run dir,
        # saying whom it waits for, then stops naming the holder
        second = train(tmp_path / "second", {**base, "train.max_steps": 400, "checkpoint.lock_wait_s": 3},
                       launcher="torchrun", extra_args=["--resume"], check=False)  # fmt: skip
        assert second.returncode != 0 and first.poll() is None, second.output[-3000:]
        assert f"is in use by another job: pid {first.pid} on " in second.output, second.output[-3000:]
        assert "after waiting 3 s for it to end (checkpoint.lock_wait_s)" in second.output
        assert second.output.count("waiting up to 3 s") == 1, "said once, by rank 0"
        assert second.output.count("in use by another job") == 1, "said once, by rank 0"
        assert "step      1/" not in second.output and "[rank0]: Traceback" not in second.output
        found, warnings = latest(run_dir / "checkpoints")
        assert found is not None and not warnings, "the first job's checkpoints are intact"
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
        killer.cancel()
    held = latest(run_dir / "checkpoints")[0].step  # the killed job's lock must not block the next one
    third = train(tmp_path / "third", {**base, "train.max_steps": held + 2}, launcher="none", extra_args=["--resume"])
    assert "resumed from" in third.output and third.returncode == 0


def test_ranks_that_found_different_checkpoints_refuse_to_start(tmp_path):
    base = {**FAST, "model.config.n_layer": 1, "checkpoint.every_steps": 4, "train.max_steps": 8,
            "data.eval_fraction": 0, "optim.warmup_steps": 2}  # fmt: skip
    train(tmp_path, base, launcher="none", debug=False)
    r = train(tmp_path, {**base, "train.max_steps": 12, "train.micro_batch_size": 2}, launcher="torchrun",
              extra_args=["--resume"], env={"TRAINER_FAULT": "staleresume@0:rank=1"}, check=False)  # fmt: skip
    out = r.output
    assert r.returncode != 0 and "[rank0]: Traceback" not in out and "[rank1]: Traceback" not in out, out[-3000:]
    assert "the ranks found different checkpoints to resume from (rank 0: step_00000008 saved" in out
    assert "; rank 1: step_00000004 saved" in out and "a filesystem every node shares" in out
    assert out.count("found different checkpoints") == 1, "said once, by rank 0"
    assert "preflight" not in out, "stopped before building the model"


@pytest.fixture(scope="module")
def one_rank_run(tmp_path_factory, small_data):
    """1 process, stage 0, micro 8: the global batch of 2 ranks x 4; no dropout."""
    s = sets(small_data, 0, 1, **NODROP, **{"train.micro_batch_size": 8})
    return train(tmp_path_factory.mktemp("one_rank"), s, launcher="none")


def fresh_copy(run, tmp_path):
    """Run A's checkpoint at K, copied: each test converts its own."""
    ckpt = tmp_path / "ckpt" / f"step_{K:08d}"
    shutil.copytree(run.run_dir / "checkpoints" / f"step_{K:08d}", ckpt)
    return ckpt


def resumed_on_two_ranks(tmp_path, small_data, ckpt, fault="", **extra):
    s = {**sets(small_data, 2, 1, **NODROP), **extra}
    return train(tmp_path, s, launcher="torchrun", extra_args=["--resume", str(ckpt)], env={"TRAINER_FAULT": fault},
                 check=not fault.startswith("convertkill"))  # fmt: skip


def assert_continues(a, b) -> None:
    """Every step after the resume as in the uninterrupted 1-process run (fp32: to 1e-5, the same
    sums over 2 ranks instead of 1)."""
    after = steps_after(b, K)
    assert sorted(after) == list(range(K + 1, 2 * K + 1))
    for step, loss in after.items():
        assert loss == pytest.approx(a.losses[step], rel=1e-5), step


def test_a_conversion_longer_than_the_collective_timeout_succeeds(tmp_path, small_data, one_rank_run):
    """dist.timeout_s 15 bounds every collective; the conversion takes 20 s longer than it would
    (injected): the other rank waits for its completion marker, not in a collective."""
    ckpt = fresh_copy(one_rank_run, tmp_path)
    b = resumed_on_two_ranks(
        tmp_path, small_data, ckpt, fault="convertslow:ms=20000", **{"dist.timeout_s": 15}
    )
    took = re.search(r"for stage 2 on 2 ranks: done in ([0-9.]+) s", b.output)
    assert took and float(took.group(1)) > 20, b.output[-3000:]
    print(f"a conversion of {took.group(1)} s under dist.timeout_s 15: the resume went on")
    assert_continues(one_rank_run, b)


def test_an_interrupted_conversion_is_done_again_from_scratch(tmp_path, small_data, one_rank_run):
    """Rank 0 is killed while its conversion process writes (injected): the conversion process dies
    with it and leaves only its hidden directory; the next resume removes it, converts again and
    continues as the uninterrupted run does."""
    ckpt = fresh_copy(one_rank_run, tmp_path)
    killed = resumed_on_two_ranks(tmp_path / "killed", small_data, ckpt, fault="convertkill")
    assert killed.returncode != 0
    time.sleep(1)  # the conversion process ends with its rank (PR_SET_PDEATHSIG)
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(ckpt) in " ".join(p.info["cmdline"] or [])]
    leftovers = sorted(p.name for p in ckpt.iterdir() if p.name.startswith(".convert-tmp-"))
    assert leftovers == [".convert-tmp-universal"] and not (ckpt / "universal").exists(), sorted(
        os.listdir(ckpt)
    )
    b = resumed_on_two_ranks(tmp_path / "again", small_data, ckpt)
    assert (ckpt / "universal" / "CONVERTED").exists()
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".convert-tmp-")], "leftovers removed"
    assert_continues(one_rank_run, b)
