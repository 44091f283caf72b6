"""Resume mistakes exit 2 with a message that says what was wrong and where it looked."""

import pytest
from helpers import TINY, bin_train, train

pytestmark = pytest.mark.e2e

SMALL = {
    "train.max_steps": 2,
    "train.eval_every": 0,
    "model.config.n_layer": 1,
    "data.num_workers": 0,
    "checkpoint.save_final": True,
}


def run(*args):
    p = bin_train(*args)
    return p.returncode, p.stderr + p.stdout


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    return train(tmp_path_factory.mktemp("saved"), SMALL, debug=False)


def sets(run_dir, **kw):
    out = []
    for k, v in {**SMALL, "run_dir": run_dir, **kw}.items():
        out += ["--set", f"{k}={v}"]
    return out


def test_resume_with_nothing_to_resume(tmp_path):
    code, out = run(TINY, *sets(tmp_path / "empty"), "--resume")
    assert code == 2 and "nothing to resume" in out and "looked in" in out and "Traceback" not in out


def test_resume_from_a_path_that_is_not_a_checkpoint(tmp_path):
    code, out = run(TINY, *sets(tmp_path / "r"), "--resume", tmp_path)
    assert code == 2 and "not a checkpoint" in out


def test_resume_a_checkpoint_whose_model_differs(saved):
    code, out = run(
        TINY, *sets(saved.run_dir, **{"model.config.n_layer": 2, "train.max_steps": 4}), "--resume"
    )
    assert code == 2, out
    assert "model.config.n_layer: checkpoint has 1, the experiment now has 2" in out


def test_fresh_start_into_a_run_dir_with_checkpoints_is_refused(saved):
    code, out = run(TINY, *sets(saved.run_dir))
    assert code == 2 and "already holds checkpoints" in out and "--resume" in out


def test_resume_at_max_steps_has_nothing_to_do(saved):
    code, out = run(TINY, *sets(saved.run_dir), "--resume")
    assert code == 0 and "nothing to do" in out


def test_truncated_shard_falls_back_to_the_previous_checkpoint(tmp_path):
    r = train(
        tmp_path,
        {**SMALL, "train.max_steps": 4, "checkpoint.every_steps": 2, "train.log_every": 1},
        debug=False,
    )
    ckpts = r.run_dir / "checkpoints"
    shard = ckpts / "step_00000004" / "mp_rank_00_model_states.pt"
    shard.write_bytes(shard.read_bytes()[:1000])
    code, out = run(TINY, *sets(r.run_dir), "--resume", ckpts / "step_00000004")
    assert code == 2 and "damaged" in out and "has 1000 bytes" in out  # an explicit path does not fall back
    code, out = run(TINY, *sets(r.run_dir, **{"train.max_steps": 4, "checkpoint.every_steps": 2}), "--resume")
    assert code == 0, out
    assert "step_00000004 is damaged" in out and "mp_rank_00_model_states.pt has 1000 bytes" in out
    assert "resumed from" in out and "step_00000002 at step 2" in out
