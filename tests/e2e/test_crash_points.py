"""Every crash point of a save (issue 54): a run killed at each boundary of a save and its publication, in
synchronous and asynchronous mode, is followed by a plain `--resume`, which must continue from the newest
complete checkpoint, move or delete nothing complete, remove the staging leftovers and log a rollback
only for a real one.

The boundaries (trainer/faults.py): before this rank's first file, after the RNG file, after the last
shard, before the manifest (killcommit), after it (killmanifest), after the rename (killrename: the newest
checkpoint complete but `latest` still naming the one before), after `latest` (killlatest), and during
pruning (killprune: an old checkpoint renamed to its trash name, not yet deleted).

One trained run directory (steps 2 and 4) is shared by every case; each case copies it, resumes it to the
save at step 6 and is killed there, then resumes plainly to step 7.
"""

import shutil

import pytest
from helpers import FAST, cli

pytestmark = pytest.mark.e2e

SMALL = {**FAST, "model.config.n_layer": 1, "data.eval_fraction": 0, "train.micro_batch_size": 2,
         "data.seq_len": 64, "checkpoint.every_steps": 2, "checkpoint.keep_last": 2, "checkpoint.save_final": True}  # fmt: skip

# (fault, the step the plain resume must continue from)
POINTS = {
    "before the first file": ("killfile@6:n=0", 4),
    "after the rng file": ("killfile@6:n=1", 4),
    "after the last shard": ("killfile@6:n=2", 4),
    "before the manifest": ("killcommit@6", 4),
    "after the manifest": ("killmanifest@6", 4),
    "after the rename": ("killrename@6", 6),
    "after latest": ("killlatest@6", 6),
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


# the files are written by the training thread (sync) or a writer thread (async); the commit (manifest,
# rename, `latest`, pruning) runs on the training thread in both modes, so its points are killed once
CASES = [
    (p, m)
    for p in POINTS
    for m in ("sync", "async")
    if m == "sync" or POINTS[p][0].startswith(("killfile", "killcommit"))
]


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

    from trainer.errors import UserError
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
