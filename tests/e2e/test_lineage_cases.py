"""The ten ways the checkpoint lineage lost or mixed lines (issue 59), each as bin/train (and the
supervisor, and bin/export) runs it. The store's own logic is proven over every sequence and every
file-system operation by tests/unit/test_lineage_crashes.py; these hold the cases end to end, through the
real CLI, loop, error paths and DeepSpeed. Case 1 (two kills between the commit's rename and its record)
is in tests/e2e/test_crash_points.py.

One trained run directory (steps 2, 4 and 6, synchronous saves) is shared; each case copies it.
"""

import json
import shutil
import subprocess

import pytest
from helpers import FAST, cli

pytestmark = pytest.mark.e2e

SMALL = {**FAST, "model.config.n_layer": 1, "data.eval_fraction": 0, "train.micro_batch_size": 2,
         "data.seq_len": 64, "checkpoint.every_steps": 2, "checkpoint.keep_last": 0, "checkpoint.save_final": True,
         "checkpoint.async": False}  # fmt: skip


def tag(step):
    return f"step_{step:08d}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lineage") / "base"
    code, out = cli({**SMALL, "run_dir": run_dir, "train.max_steps": 6})
    assert code == 0, out[-3000:]
    return run_dir


def copy(trained, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    return run_dir, run_dir / "checkpoints"


def head(root):
    """The journal's newest commit or fork source: the checkpoint a plain resume continues."""
    from trainer.checkpoint.resolve import latest

    found, _ = latest(root)
    return found.tag if found is not None else None


def damage(path):
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 16] = bytes(255 - b for b in data[mid : mid + 16])
    path.write_bytes(bytes(data))


# ----------------------------------------------------------------------------- case 2
@pytest.mark.parametrize("fault,exit_code,sets", [
    ("raise@5", 1, {}),
    ("nan@5", 4, {}),
    ("oom@5", 3, {"strategy.on_oom": "escalate"}),
])  # fmt: skip
def test_a_background_save_written_before_a_failed_step_is_committed(tmp_path, fault, exit_code, sets):
    """Case 2: a background save of step 4 written, step 5 fails (an exception, a non-finite loss, an
    out-of-memory). The error path commits it (every rank's report in the staging directory) and exits
    with the failure's own code (docs/launching.md: 3 for an OOM, 4 for a NaN; 1 otherwise); before, the
    save was dropped (`latest` stayed at 2) and the OOM exited 134 (the writer thread alive at exit)."""
    run_dir = tmp_path / "run"
    code, out = cli({**SMALL, **sets, "run_dir": run_dir, "train.max_steps": 8, "checkpoint.every_steps": 4,
                     "checkpoint.async": True}, env={"TRAINER_FAULT": fault})  # fmt: skip
    assert code == exit_code, out[-3000:]
    root = run_dir / "checkpoints"
    assert "committed on the way out" in out, out[-3000:]
    assert head(root) == tag(4) and (root / "latest").read_text().strip() == tag(4)
    assert not list(root.glob(".tmp-*")), "the finished save was left as staging"
    print(f"{fault}: exit {code}, step 4 committed on the way out")


# ----------------------------------------------------------------------------- case 3
def test_damaged_universal_files_are_made_again_from_the_checkpoint(trained, tmp_path):
    """Case 3: a resume on another stage converts the checkpoint into `universal/`, sealed (every file's
    digest in its marker). 4 KiB zeroed in one of its files: the next resume finds it (every rank checks a
    share), makes the directory again from the verified checkpoint, and trains on with the same loss;
    before, the marker was trusted and the damaged file loaded (the step-7 loss moved)."""
    run_dir, root = copy(trained, tmp_path)
    stage2 = {**SMALL, "run_dir": run_dir, "train.max_steps": 7, "strategy.zero_stage": 2, "checkpoint.every_steps": 0,
              "checkpoint.save_final": False, "strategy.justification": "the test converts"}  # fmt: skip
    code, first = cli(stage2, "--resume")
    assert code == 0 and "converting" in first, first[-3000:]
    uni = root / tag(6) / "universal"
    marker = json.loads((uni / "CONVERTED").read_text())
    assert marker["files"], "the marker holds no digests"
    victim = max((uni / rel for rel in marker["files"]), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 4096] = bytes(4096)
    victim.write_bytes(bytes(data))
    code, second = cli(stage2, "--resume")
    assert code == 0, second[-3000:]
    assert f"{uni} is damaged" in second and "making it again" in second, second[-3000:]

    def loss(out):
        return [line for line in out.splitlines() if "step      7/7" in line][0].split("loss ")[1].split()[0]

    assert loss(first) == loss(second), (loss(first), loss(second))
    recs = [json.loads(x) for x in (root / "journal.jsonl").read_text().splitlines()]
    assert sum(r["event"] == "convert" for r in recs) == 2  # made, then made again


# ----------------------------------------------------------------------------- case 4
def test_export_reads_verified_bytes_only(trained, tmp_path):
    """Case 4: bin/export checks every file's digest: a damaged step directory is refused naming the file
    (exit 2); given the run directory, it exports the newest intact checkpoint of the line and says so.
    Before, the damaged shard was exported with exit 0 and 1,024 wrong values."""
    from trainer.checkpoint.export import main

    run_dir, root = copy(trained, tmp_path)
    damage(root / tag(6) / "mp_rank_00_model_states.pt")
    assert main([str(root / tag(6)), str(tmp_path / "out1")]) == 2
    assert not (tmp_path / "out1" / "config.json").exists()
    assert main([str(run_dir), str(tmp_path / "out2")]) == 0
    exported = json.loads((tmp_path / "out2" / "training" / "trainer_state.json").read_text())
    assert exported["step"] == 4


def test_export_refusal_names_the_file(trained, tmp_path, capsys):
    from trainer.checkpoint.export import main

    run_dir, root = copy(trained, tmp_path)
    damage(root / tag(6) / "mp_rank_00_model_states.pt")
    main([str(root / tag(6)), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert "mp_rank_00_model_states.pt holds other bytes than were written" in err and "Traceback" not in err


# ----------------------------------------------------------------------------- case 5
def test_a_damaged_final_checkpoint_is_not_called_done(trained, tmp_path):
    """Case 5: `--resume` at train.max_steps over a final checkpoint damaged in place: its bytes are checked
    before "nothing to do" is said; the resume falls back to step 4 and trains to 6 again, naming the file
    once. Before: "nothing to do", exit 0. `--resume PATH` of it stops (exit 2)."""
    run_dir, root = copy(trained, tmp_path)
    damage(root / tag(6) / "mp_rank_00_model_states.pt")
    sets = {**SMALL, "run_dir": run_dir, "train.max_steps": 6}
    code, out = cli(sets, "--resume", root / tag(6))
    assert code == 2 and "mp_rank_00_model_states.pt holds other bytes" in out, out[-3000:]
    code, out = cli(sets, "--resume")
    assert code == 0 and "nothing to do" not in out, out[-3000:]
    assert f"resumed from {root / tag(4)}" in out, out[-3000:]
    said = [line for line in out.splitlines() if "holds other bytes" in line]
    assert len(said) == 1, f"the damaged checkpoint named {len(said)} times: {said}"  # case 10: once
    assert [p.name for p in (root / "damaged").glob("*/*")] == [tag(6)]
    assert head(root) == tag(6) and (root / tag(6) / "trainer_state.json").exists()  # trained again


# ----------------------------------------------------------------------------- cases 6, 7
def test_a_restart_continues_the_line_it_was_started_on(trained, tmp_path):
    """Case 6: a job started with `--resume PATH` of a checkpoint outside its checkpoints directory (one in
    abandoned/) dies before its first save: the supervisor's restart resumes PATH again. Before, it resumed
    `latest` (the other line) with no rollback note and trained on."""
    run_dir, root = copy(trained, tmp_path)
    sets = {**SMALL, "run_dir": run_dir, "train.max_steps": 5}
    code, out = cli(sets, "--resume", root / tag(2))  # a rollback: 4 and 6 to abandoned/, 4 saved again
    assert code == 0 and "rollback" in out, out[-3000:]
    away = next(root.glob(f"abandoned/*/{tag(6)}"))
    code, out = cli({**sets, "train.max_steps": 9}, "--resume", away, "--launcher", "none", "--max-restarts", 1,
                    env={"TRAINER_FAULT": "kill@7:attempt=0"})  # fmt: skip
    assert code == 0, out[-4000:]
    assert f"restarting in 2 s from {away}" in out, out[-4000:]
    assert out.count(f"resumed from {away} at step 6") == 2, out[-4000:]
    state = json.loads((root / tag(9) / "trainer_state.json").read_text())
    assert state["resumed_from"] == str(away.resolve())


def test_a_rollback_killed_during_start_up_is_done_again_by_the_restart(trained, tmp_path):
    """Case 7: `--max-restarts 1 --resume .../step_00000002`, the first attempt killed during start-up,
    before the rollback's fork was recorded: the restart resumes step 2 again and forks. Before, it
    continued the line the user rolled back from (`latest`: step 6)."""
    run_dir, root = copy(trained, tmp_path)
    sets = {**SMALL, "run_dir": run_dir, "train.max_steps": 3}
    code, out = cli(sets, "--resume", root / tag(2), "--launcher", "none", "--max-restarts", 1,
                    env={"TRAINER_FAULT": "killstart@0:attempt=0"})  # fmt: skip
    assert code == 0, out[-4000:]
    assert "injected killstart" in out and "nothing to do" not in out, out[-4000:]
    assert "rollback: resumed from step_00000002" in out, out[-4000:]
    assert sorted(p.name for p in root.glob("abandoned/*/step_*")) == [tag(4), tag(6)]
    assert head(root) == tag(3)


# ----------------------------------------------------------------------------- case 8
def test_a_kill_inside_a_fork_is_finished_by_the_next_start(trained, tmp_path):
    """Case 8: a rollback to step 2 killed after its first move to abandoned/ (step 4 moved, step 6 not):
    the next plain `--resume` continues step 2 (the fork is in the journal) and moves step 6 after step 4.
    Before, it continued the abandoned step 6 and step 4 stayed stranded."""
    run_dir, root = copy(trained, tmp_path)
    sets = {**SMALL, "run_dir": run_dir, "train.max_steps": 3}
    code, out = cli(sets, "--resume", root / tag(2), env={"TRAINER_FAULT": "killfork@0"})
    assert code != 0 and "injected killfork" in out, out[-3000:]
    code, out = cli(sets, "--resume")
    assert code == 0 and f"resumed from {root / tag(2)}" in out, out[-3000:]
    aside = sorted(p.relative_to(root / "abandoned").parts[1] for p in root.glob("abandoned/*/step_*"))
    assert aside == [tag(4), tag(6)] and len(list((root / "abandoned").iterdir())) == 1, aside
    assert head(root) == tag(3)


# ----------------------------------------------------------------------------- cases 9, 10
def test_a_fresh_start_over_unreadable_checkpoints_is_refused(trained, tmp_path):
    """Case 9: every trainer_state.json truncated (the shards intact): a start without --resume is refused,
    naming them; before, it was allowed (only readable checkpoints counted) and replaced them."""
    run_dir, root = copy(trained, tmp_path)
    for step in (2, 4, 6):
        f = root / tag(step) / "trainer_state.json"
        f.write_bytes(f.read_bytes()[:100])
    code, out = cli({**SMALL, "run_dir": run_dir, "train.max_steps": 2})
    assert code == 2 and "already holds checkpoints" in out and "3 of them unreadable" in out, out[-3000:]
    assert "Traceback" not in out and all((root / tag(s)).exists() for s in (2, 4, 6))


def test_a_read_only_run_dir_is_an_input_error_never_retried(trained, tmp_path):
    """Case 10: a run directory that cannot be written exits 2 before training, naming it and the fix, and
    the supervisor does not retry it; before, a traceback and exit 1, retried."""
    run_dir, _ = copy(trained, tmp_path)
    if subprocess.run(["chattr", "-R", "+i", str(run_dir)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not supported here (and root ignores permissions)")
    try:
        sets = {**SMALL, "run_dir": run_dir, "train.max_steps": 8}
        code, out = cli(sets, "--resume")  # a rank: its lock file
        code_sup, out_sup = cli(
            sets, "--resume", "--launcher", "none", "--max-restarts", 2
        )  # the supervisor's check
    finally:
        subprocess.run(["chattr", "-R", "-i", str(run_dir)], check=True)
    for c, o in ((code, out), (code_sup, out_sup)):
        assert c == 2 and f"run_dir {run_dir} cannot be written" in o and "Traceback" not in o, o[-3000:]
    assert "[supervisor] attempt" not in out_sup, out_sup[-3000:]


# ----------------------------------------------------------------------------- the review's findings
def test_a_hung_background_write_does_not_take_a_failures_exit_code(tmp_path):
    """Review of issue 59, F2: step 5 runs out of memory while step 4's background write hangs (a hung
    mount): the failure is recorded first (the supervisor escalates) and the salvage gives up once nothing
    is written for 10 s; the run exits 3. Before, the salvage waited for the watchdog and exited 1 (no
    out-of-memory record: no escalation; a NaN's 4 became a retried 1)."""
    run_dir = tmp_path / "run"
    code, out = cli({**SMALL, "run_dir": run_dir, "train.max_steps": 8, "checkpoint.every_steps": 4, "checkpoint.async": True,
                     "strategy.on_oom": "escalate", "dist.watchdog_s": 120}, env={"TRAINER_FAULT": "hangwrite@4,oom@5"})  # fmt: skip
    assert code == 3, out[-3000:]
    assert (run_dir / "escalation.json").exists() and "committed on the way out" not in out


def test_a_read_only_checkpoints_directory_is_found_before_training(trained, tmp_path):
    """Review of issue 59, F3: `checkpoints/` immutable while the run directory is not: every attempt
    trained, failed at its first save with a traceback (exit 1) and was retried. Now exit 2 before training."""
    run_dir, root = copy(trained, tmp_path)
    if subprocess.run(["chattr", "+i", str(root)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not supported here")
    try:
        sets = {**SMALL, "run_dir": run_dir, "train.max_steps": 8}
        code, out = cli(sets, "--resume")
        code_sup, out_sup = cli(sets, "--resume", "--launcher", "none", "--max-restarts", 2)
    finally:
        subprocess.run(["chattr", "-i", str(root)], check=True)
    for c, o in ((code, out), (code_sup, out_sup)):
        assert c == 2 and "Traceback" not in o and "step      7" not in o, o[-3000:]
        assert str(root) in o and "choose a writable run_dir" in o, o[-3000:]
    assert "[supervisor] attempt" not in out_sup


def test_a_dry_run_moves_nothing(trained, tmp_path):
    """Review of issue 59, F5: `--dry-run --resume .../step_00000002` carried out the rollback (moved or,
    with on_rollback: remove, deleted steps 4 and 6); the one-off modes leave the checkpoints directory as
    it is."""
    run_dir, root = copy(trained, tmp_path)
    code, out = cli({**SMALL, "run_dir": run_dir, "train.max_steps": 8, "checkpoint.on_rollback": "remove"},
                    "--dry-run", "--resume", root / tag(2))  # fmt: skip
    assert code == 0, out[-3000:]
    assert all((root / tag(s)).is_dir() for s in (2, 4, 6)) and not (root / "abandoned").exists()
    assert head(root) == tag(6)


def test_converting_a_read_only_checkpoint_fails_at_once(trained, tmp_path):
    """Review of issue 59, F6: a checkpoint whose directory cannot be written, resumed on another stage:
    the conversion cannot write beside it and could not report it either, and every rank waited for
    checkpoint.convert_timeout_minutes (120) in silence. Now exit 2 at once, naming it and the fix."""
    src, root = copy(trained, tmp_path)
    if subprocess.run(["chattr", "-R", "+i", str(root / tag(6))], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not supported here")
    try:
        code, out = cli({**SMALL, "run_dir": tmp_path / "other", "train.max_steps": 8, "strategy.zero_stage": 2,
                         "strategy.justification": "the test converts"}, "--resume", root / tag(6), timeout=120)  # fmt: skip
    finally:
        subprocess.run(["chattr", "-R", "-i", str(root / tag(6))], check=True)
    assert code == 2 and "copy the checkpoint somewhere writable" in out and "Traceback" not in out, out[
        -3000:
    ]
