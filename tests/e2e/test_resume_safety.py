"""A resume is never silently wrong, and a run directory has one job (one process per job here; the
2-rank cases are in tests/dist/test_resume_agreement.py).

- Changed training data under the same config is refused with the differences named, unless
  `checkpoint.on_data_change: continue` says to go on (and the log says what that means); a data
  file that was only touched is no change.
- A resume with another train.max_steps keeps the LR schedule's horizon: the lr of every step is the
  uninterrupted run's; optim.schedule_steps re-plans it.
- A stop request that lands on an eval step saves and skips the eval.
- A run_dir that is a file is a config error.
"""

import json
import os
import time

import pytest
from helpers import FAST, ROOT, cli, train

pytestmark = pytest.mark.e2e

SMALL = {
    **FAST,
    "model.config.n_layer": 1,
    "train.max_steps": 8,
    "data.eval_fraction": 0,
    "checkpoint.every_steps": 4,
    "optim.warmup_steps": 2,
}
DOCS = (ROOT / "data" / "tiny" / "python_docs.jsonl").read_text().splitlines()


def run(tmp_path, sets, *extra, env=None):
    return cli({"run_dir": tmp_path / "run", **sets}, *extra, env=env)


@pytest.fixture
def data_copy(tmp_path, small_data_file):
    p = tmp_path / "data" / "train.jsonl"
    p.parent.mkdir()
    p.write_text(small_data_file.read_text())
    return p


@pytest.fixture(scope="module")
def small_data_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "docs.jsonl"
    p.write_text("\n".join(DOCS[: len(DOCS) // 2]) + "\n")
    return p


def test_changed_data_is_refused_at_resume_with_the_differences_named(tmp_path, data_copy):
    sets = {**SMALL, "data.train.files": data_copy, "train.max_steps": 4}
    code, out = run(tmp_path, sets)
    assert code == 0, out[-3000:]
    state = json.loads(
        (tmp_path / "run" / "checkpoints" / "step_00000004" / "trainer_state.json").read_text()
    )
    n = state["data"]["train_sequences"]
    size = data_copy.stat().st_size

    # Touched only (same bytes, new mtime): the same sequences, so no change.
    os.utime(data_copy, (time.time() + 5, time.time() + 5))
    code, out = run(tmp_path, {**sets, "train.max_steps": 5}, "--resume")
    assert code == 0 and "resumed from" in out and "training data changed" not in out, out[-3000:]

    # Grown: refused, naming the sequences and the file, and the key that goes on anyway.
    with open(data_copy, "a") as f:
        f.write("\n".join(DOCS[len(DOCS) // 2 :]) + "\n")
    code, out = run(tmp_path, {**sets, "train.max_steps": 6}, "--resume")
    assert code == 2 and "Traceback" not in out, out[-3000:]
    assert "the training data differs from the data" in out and "step_00000004" in out
    assert f"training sequences: {n} at the checkpoint," in out
    assert f"{data_copy.resolve()}: {size:,} bytes at the checkpoint, {data_copy.stat().st_size:,} now" in out
    assert "checkpoint.on_data_change: continue" in out

    code, out = run(
        tmp_path, {**sets, "train.max_steps": 6, "checkpoint.on_data_change": "continue"}, "--resume"
    )
    assert code == 0, out[-3000:]
    assert (
        "warning: the training data changed since step_00000004" in out
        and "of the new data's shuffled order" in out
    )


def lrs(run_dir):
    return {
        m["step"]: m["lr"]
        for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "lr" in m
    }


def test_a_longer_max_steps_on_resume_keeps_the_lr_schedule(tmp_path):
    """Trained to step 4 of an 8-step cosine schedule, resumed with max_steps 12: steps 5-8 get the
    uninterrupted run's lr exactly, 9-12 the floor (min_lr_ratio x lr); with optim.schedule_steps
    the schedule is re-planned from the resume on, and the log says so."""
    ref = train(tmp_path / "ref", SMALL, debug=False)
    at4 = str(ref.run_dir / "checkpoints" / "step_00000004")
    code, out = run(tmp_path, {**SMALL, "train.max_steps": 12}, "--resume", at4)
    assert code == 0, out[-3000:]
    assert "train.max_steps is 12; the LR schedule keeps its horizon of 8 steps" in out
    got, want = lrs(tmp_path / "run"), lrs(ref.run_dir)
    assert all(got[s] == want[s] for s in range(5, 9)), (got, want)
    floor = 2.0e-3 * 0.1
    assert all(got[s] == pytest.approx(floor) for s in range(9, 13))

    replan = tmp_path / "replan"
    code, out = run(replan, {**SMALL, "train.max_steps": 12, "optim.schedule_steps": 12}, "--resume", at4)
    assert code == 0 and "LR schedule re-planned (optim.schedule_steps): horizon 8 -> 12 steps" in out, out[
        -3000:
    ]
    assert lrs(replan / "run")[5] > want[5], "a longer horizon: a higher lr at the same step"


def test_a_stop_on_an_eval_step_saves_and_skips_the_eval(tmp_path):
    """SIGTERM arrives during step 4, which is also an eval step: the job saves step 4 and exits
    without spending the grace period on the eval."""
    sets = {**SMALL, "data.eval_fraction": 0.05, "train.eval_every": 4, "checkpoint.every_steps": 0}
    code, out = run(tmp_path, sets, env={"TRAINER_FAULT": "term@4"})
    assert code == 0, out[-3000:]
    assert "stopping at step 4 on request; checkpoint saved" in out
    assert (tmp_path / "run" / "checkpoints" / "step_00000004").is_dir()
    assert "eval  step      4" not in out


def test_a_run_dir_that_is_a_file_is_a_config_error(tmp_path):
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    for run_dir, what in ((f, "is a file"), (f / "sub", "lies under")):
        code, out = run(tmp_path, {**SMALL, "run_dir": run_dir})
        assert code == 2 and "Traceback" not in out, out[-3000:]
        assert f"run_dir: '{run_dir}' {what}" in out and "choose another run_dir (--set run_dir=...)" in out
    assert f.read_text() == "x"
