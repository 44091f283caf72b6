"""Rollbacks: a run resumed from an explicit older checkpoint is a new line of checkpoints. The newer
checkpoints of the abandoned line are moved aside (checkpoint.on_rollback: keep) or deleted, `latest`
names the checkpoint resumed from, and neither a restart's plain `--resume` nor pruning ever takes
the abandoned line for the new one (it resumed the abandoned step_00000030: "nothing to do")."""

import json

import pytest
from helpers import FAST, cli

pytestmark = pytest.mark.e2e

SMALL = {**FAST, "model.config.n_layer": 1, "data.eval_fraction": 0, "checkpoint.every_steps": 5,
         "checkpoint.async": False}  # fmt: skip


def test_a_rollback_is_a_new_line_a_restart_resumes(tmp_path, on_rollback="keep"):
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    code, out = cli({**SMALL, "run_dir": run_dir, "train.max_steps": 30, "checkpoint.keep_last": 0})
    assert code == 0, out[-3000:]
    # back to step 10, killed at step 12 before its first save; the supervisor restarts with --resume
    sets = {**SMALL, "run_dir": run_dir, "train.max_steps": 20, "checkpoint.keep_last": 3,
            "checkpoint.on_rollback": on_rollback}  # fmt: skip
    code, out = cli(sets, "--resume", root / "step_00000010", "--launcher", "none", "--max-restarts", 1,
                    env={"TRAINER_FAULT": "kill@12:attempt=0"})  # fmt: skip
    assert code == 0, out[-4000:]
    assert "rollback: resumed from step_00000010" in out, out[-4000:]
    assert out.count("resumed from") >= 2 and "nothing to do" not in out
    kept = sorted(d.name for d in root.iterdir() if d.name.startswith("step_"))
    print(f"on_rollback {on_rollback}: {kept}; abandoned: "
          f"{sorted(p.name for p in root.glob('abandoned/*/*'))}")  # fmt: skip
    assert kept == ["step_00000010", "step_00000015", "step_00000020"]
    assert (root / "latest").read_text().strip() == "step_00000020"
    abandoned = sorted(p.name for p in root.glob("abandoned/*/step_*"))
    assert abandoned == (["step_00000015", "step_00000020", "step_00000025", "step_00000030"] if on_rollback == "keep"
                         else [])  # fmt: skip
    state = json.loads((root / "step_00000020" / "trainer_state.json").read_text())
    assert state["resumed_from"].endswith("step_00000010") and state["step"] == 20
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m][
        -1
    ] == 20  # the new line trained on to 20 (the file appends)


def test_a_rollback_can_delete_the_abandoned_line(tmp_path):
    """checkpoint.on_rollback: remove (the start of a run, trainer/checkpoint/begin.py, after a `--resume
    PATH` of an older checkpoint): the fork is recorded in the journal, the newer checkpoints of the
    abandoned line are deleted, `latest` names the checkpoint resumed from; a staging leftover is no part
    of any line (a crashed save: removed at the start, tests/e2e/test_crash_points.py)."""
    from trainer.checkpoint.directory import CheckpointDir
    from trainer.checkpoint.disk import Found, complete
    from trainer.checkpoint.journal import read

    root = tmp_path / "checkpoints"
    for step in (10, 20, 30):
        d = root / f"step_{step:08d}"
        d.mkdir(parents=True)
        (d / "trainer_state.json").write_text(json.dumps({"step": step, "files": {}}))
    (root / ".tmp-step_00000040").mkdir()
    (root / "latest").write_text("step_00000030\n")
    found = Found(root / "step_00000010", {"step": 10, "files": {}})
    said = " ".join(CheckpointDir(root).start(found, explicit=True, on_rollback="remove"))
    assert "step_00000020, step_00000030" in said and "removed" in said and ".tmp-" not in said
    assert [f.tag for f in complete(root)] == ["step_00000010"]
    assert (root / "latest").read_text().strip() == "step_00000010" and not (root / "abandoned").exists()
    fork = [r for r in read(root).records if r.event == "fork"]
    assert len(fork) == 1 and fork[0].get("to") == "removed" and not (root / ".tmp-step_00000040").exists()
