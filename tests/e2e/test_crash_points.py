"""Crash points of a save through the real CLI (issues 54 and 59): a run killed at a boundary of a save and
its publication is followed by a plain `--resume`, which must continue from the newest complete
checkpoint, move or delete nothing complete, remove the staging leftovers and log no rollback.

Every file-system operation of a save, a commit, a prune, a rollback and a conversion is killed (and
power-lost) in turn by tests/unit/test_lineage_crashes.py, on the real store code with a simulated file
system; here the boundaries that involve the training process itself: a rank's writer killed between its
files (synchronous and in the background), a kill during pruning, and two kills in a row between the
commit's rename and its journal record (issue 59, case 1: `latest` still named step 4 while 6 and 8 were
complete and newer, and the next plain resume rolled back to 4, moving 6 and 8 to abandoned/).

One trained run directory (steps 2 and 4) is shared by every case; each case copies it.
"""

import shutil

import pytest
from helpers import FAST, cli

pytestmark = pytest.mark.e2e

SMALL = {**FAST, "model.config.n_layer": 1, "data.eval_fraction": 0, "train.micro_batch_size": 2,
         "data.seq_len": 64, "checkpoint.every_steps": 2, "checkpoint.keep_last": 2, "checkpoint.save_final": True}  # fmt: skip

# (fault, the step the plain resume must continue from)
POINTS = {
    "after the rng file": ("killfile@6:n=1", 4),
    "during pruning": ("killprune@6", 6),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("crash") / "base"
    code, out = cli({**SMALL, "run_dir": run_dir, "train.max_steps": 4, "checkpoint.async": False})
    assert code == 0, out[-3000:]
    assert sorted(d.name for d in (run_dir / "checkpoints").iterdir() if d.name.startswith("step_")) == [
        "step_00000002", "step_00000004"]  # fmt: skip
    return run_dir


# the files are written by the training thread (sync) or a writer thread (async); pruning runs on the
# training thread in both modes
CASES = [("after the rng file", "sync"), ("after the rng file", "async"), ("during pruning", "sync")]


@pytest.mark.parametrize("point,mode", CASES)
def test_a_crash_at_every_point_of_a_save_resumes_from_the_newest_complete(trained, tmp_path, point, mode):
    fault, expected = POINTS[point]
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    root = run_dir / "checkpoints"
    sets = {**SMALL, "run_dir": run_dir, "checkpoint.async": mode == "async"}
    code, out = cli({**sets, "train.max_steps": 6}, "--resume", env={"TRAINER_FAULT": fault})
    assert code != 0 and f"injected {fault.split('@')[0]}" in out, out[-3000:]
    committed = {d.name for d in root.iterdir() if d.name.startswith("step_")}
    code, out = cli({**sets, "train.max_steps": 7, "checkpoint.keep_last": 0}, "--resume")  # no pruning here
    assert code == 0, out[-3000:]
    tag = f"step_{expected:08d}"
    assert f"resumed from {root / tag}" in out or f"resumed from {tag}" in out, out[-3000:]
    assert "rollback" not in out and not (root / "abandoned").exists(), out[-3000:]
    left = sorted(d.name for d in root.iterdir() if d.name.startswith((".tmp-", ".trash-")))
    assert left == [], f"leftovers of the crashed save not removed: {left}"
    names = {d.name for d in root.iterdir() if d.name.startswith("step_")}
    assert committed <= names, "a complete checkpoint was moved or deleted"
    assert "step_00000007" in names and (root / "latest").read_text().strip() == "step_00000007"
    print(f"{mode:5} {point:22} -> resumed from {tag}; kept {sorted(names)}")


def test_legacy_serialization_is_digested_and_resumes(tmp_path):
    """DeepSpeed's checkpoint.checkpoint_serialization: false (torch's legacy format, which writes tensor
    data straight to the file descriptor): every checkpoint was "damaged" and none could be resumed
    (issue 54, finding 1). Synchronous and background saves, then a plain resume from the newest."""
    import json

    template = tmp_path / "ds.json"
    template.write_text(json.dumps({"checkpoint": {"checkpoint_serialization": False}}))
    run_dir = tmp_path / "run"
    for mode, steps in (("sync", 2), ("async", 4)):
        code, out = cli({**SMALL, "run_dir": run_dir, "train.max_steps": steps, "strategy.deepspeed": template,
                         "checkpoint.async": mode == "async"}, *(["--resume"] if steps > 2 else []))  # fmt: skip
        assert code == 0, out[-3000:]
    code, out = cli(
        {**SMALL, "run_dir": run_dir, "train.max_steps": 5, "strategy.deepspeed": template}, "--resume"
    )
    assert code == 0 and "damaged" not in out, out[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000004'}" in out, out[-3000:]


@pytest.mark.parametrize("key", ["writer", "use_node_local_storage", "datastates", "nebula"])
def test_a_checkpoint_engine_the_project_would_replace_is_refused(tmp_path, key):
    import json

    from trainer.common.errors import UserError
    from trainer.strategy.ds_config import load_template

    data = {
        "writer": {"checkpoint": {"writer": {"type": "fast", "decoupled": True}}},
        "use_node_local_storage": {"checkpoint": {"use_node_local_storage": True}},
        "datastates": {"datastates_ckpt": {"enabled": True}},
        "nebula": {"nebula": {"enabled": True}},
    }[key]
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UserError) as e:
        load_template(path)
    assert "checkpoint engine this project does not use" in str(e.value) and "remove it" in e.value.render()


def test_two_kills_between_the_rename_and_its_record_lose_nothing(trained, tmp_path):
    """Issue 59, case 1: killrename at step 6, a plain resume, killrename again at step 8: steps 6 and 8 are
    committed (renamed into place) without their journal records; the next plain resume continues 8 (each
    names its parent and line in its manifest: adopted) and logs no rollback. A flipped byte in `latest`
    (a cache, never read when the journal is there) changes nothing."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    root = run_dir / "checkpoints"
    sets = {**SMALL, "run_dir": run_dir, "checkpoint.async": False, "checkpoint.keep_last": 0}
    for step in (6, 8):
        code, out = cli(
            {**sets, "train.max_steps": step}, "--resume", env={"TRAINER_FAULT": f"killrename@{step}"}
        )
        assert code != 0 and "injected killrename" in out, out[-3000:]
        assert (root / f"step_{step:08d}").is_dir()
    (root / "latest").write_text("step_00000002\n")  # what case 1's variant flipped it to
    code, out = cli({**sets, "train.max_steps": 9}, "--resume")
    assert code == 0, out[-3000:]
    assert f"resumed from {root / 'step_00000008'}" in out and "rollback" not in out, out[-3000:]
    assert not (root / "abandoned").exists()
    assert sorted(d.name for d in root.iterdir() if d.name.startswith("step_")) == [
        f"step_{s:08d}" for s in (2, 4, 6, 8, 9)]  # fmt: skip
