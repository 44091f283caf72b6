"""The lineage journal and its neighbours, case by case (the properties over sequences:
tests/unit/test_lineage_crashes.py): a torn last record, damage in the middle, a directory from before
journals, a full disk's error, set-aside names that never collide."""

import errno
import json
from pathlib import Path

import pytest

from trainer.checkpoint import journal, lineage, resolve
from trainer.checkpoint.aside import aside_dir
from trainer.checkpoint.directory import CheckpointDir
from trainer.checkpoint.disk import ABANDONED, STATE, Found
from trainer.common.errors import UserError


def commit(root: Path, step: int, cd: CheckpointDir) -> Found:
    stage = cd.prepare(f"step_{step:08d}")
    stage.mkdir(parents=True, exist_ok=True)
    (stage / "shard.pt").write_bytes(b"x" * step)
    state = cd.write_manifest(stage, {"step": step}, {}, "exp: 1\n")
    return Found(cd.commit(stage, f"step_{step:08d}", state), state)


def journal_copy(root: Path) -> dict[str, bytes]:
    """The journal and journal.last as a backup would take them."""
    return {n: (root / n).read_bytes() for n in (journal.JOURNAL, journal.LAST)}


def restore(root: Path, copy: dict[str, bytes]) -> None:
    for n, data in copy.items():
        (root / n).write_bytes(data)


def test_a_torn_last_record_is_ignored_and_cut_before_the_next(tmp_path):
    root = tmp_path / "checkpoints"
    cd = CheckpointDir(root)
    commit(root, 2, cd)
    path = root / journal.JOURNAL
    with open(path, "ab") as f:  # a crash in the middle of an append: half a record, no newline
        f.write(b'{"event":"commit","id":"abc')
    parsed = journal.read(root)
    assert parsed.torn and not parsed.damaged and [r.event for r in parsed.records] == ["commit"]
    assert resolve.latest(root)[0].step == 2
    commit(root, 4, cd)
    assert path.read_bytes().count(b"\n") == 2 and not journal.read(root).torn


def test_damage_before_the_current_line_is_read_around_after_it_refused(tmp_path):
    """A record damaged in place (a byte flipped) followed by a commit: the commit says which line is
    current, the resume goes on. Damage after the last commit could hide a rollback: a plain resume refuses
    (exit 2), naming the journal's line and the fix, and never guesses."""
    root = tmp_path / "checkpoints"
    cd = CheckpointDir(root)
    for step in (2, 4, 6):
        commit(root, step, cd)
    path = root / journal.JOURNAL
    lines = path.read_bytes().split(b"\n")
    lines[0] = lines[0].replace(b'"step":2', b'"step":3')  # the first commit's record, damaged
    path.write_bytes(b"\n".join(lines))
    assert journal.read(root).damaged == [1] and resolve.latest(root)[0].step == 6
    lines[2] = lines[2].replace(b'"step":6', b'"step":7')  # the last commit's, and a whole record after it
    path.write_bytes(b"\n".join(lines) + journal.encode("prune", {"items": []}))
    with pytest.raises(UserError, match=r"journal.jsonl: line 3 is damaged.*--resume PATH"):
        resolve.latest(root)


def test_a_directory_from_before_journals_is_read_as_then_and_gets_one(tmp_path):
    """No journal: `latest` names the checkpoint (the old rules), and the next start records the line as
    those rules read it (an `import` record), so that later decisions come from the journal."""
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        d = root / f"step_{step:08d}"
        d.mkdir(parents=True)
        (d / STATE).write_text(json.dumps({"step": step, "files": {}}))
    (root / "latest").write_text("step_00000004\n")
    found, warnings = resolve.latest(root)
    assert found.step == 4 and "older than step_00000006" in warnings[0]
    CheckpointDir(root).start(found, explicit=False)
    rec = next(r for r in journal.read(root).records if r.event == "import")
    assert [c["tag"] for c in rec.get("chain")] == ["step_00000002", "step_00000004"]
    assert [p.name for p in root.glob(f"{ABANDONED}/*/*")] == ["step_00000006"]  # another line: set aside
    assert resolve.latest(root)[0].step == 4


def test_a_full_disk_names_the_file_the_error_and_the_bytes():
    """A checkpoint file on a full disk (/dev/full: every write fails with ENOSPC): torch's zip writer
    reported `RuntimeError: ... unexpected pos`, losing the cause and the path."""
    torch = pytest.importorskip("torch")
    from trainer.checkpoint.writer import write_file

    with pytest.raises(OSError) as e:
        write_file(Path("/dev/full"), {"x": torch.zeros(100_000)})
    assert e.value.errno == errno.ENOSPC
    assert "/dev/full: No space left on device (ENOSPC)" in str(
        e.value
    ) and "bytes of it were written" in str(e.value)


def test_set_aside_names_never_collide_and_sort_in_order(tmp_path):
    cd = CheckpointDir(tmp_path)
    names = [aside_dir(cd, ABANDONED, "step_00000004").name for _ in range(50)]  # the same second
    assert len(set(names)) == 50
    for n in names:
        (tmp_path / ABANDONED / n).mkdir(parents=True)
    from trainer.checkpoint.aside import held

    assert held(cd, ABANDONED) == names


@pytest.mark.parametrize("how", ["cut", "flip"])
def test_a_damaged_last_record_never_undoes_a_rollback(tmp_path, how):
    """Review of issue 59, F1: a rollback killed before its first save leaves the fork as the journal's last
    record; that record cut short (a truncation reads like a torn append) or damaged in place (a whole line:
    not a torn append) must not make a plain resume continue the abandoned line (it had resumed step 6 from
    abandoned/, and the next append cut the fork away). It refuses (exit 2) or continues step 2."""
    root = tmp_path / "checkpoints"
    cd = CheckpointDir(root)
    two = commit(root, 2, cd)
    commit(root, 4, cd)
    commit(root, 6, cd)
    CheckpointDir(root).start(two, explicit=True)  # a rollback: 4 and 6 moved to abandoned/
    assert resolve.latest(root)[0].path == two.path
    path = root / journal.JOURNAL
    raw = bytearray(path.read_bytes())
    if how == "cut":
        raw = raw[:-10]
    else:
        i = raw.rfind(b'"line":"') + 9
        raw[i] = ord("0") if raw[i] != ord("0") else ord("1")
    path.write_bytes(bytes(raw))
    try:
        found, _ = resolve.latest(root)
    except UserError as e:
        assert "journal.jsonl" in str(e) and "--resume PATH" in str(e)
        return
    assert found is not None and "abandoned" not in str(found.path), found.path


def test_a_copy_of_a_run_directory_reads_its_own_checkpoints(tmp_path):
    """Review of issue 59, F4: a rollback to a checkpoint in abandoned/, killed before its first save, then
    the run directory copied: a plain resume in the copy took the original's checkpoint (the fork recorded
    its absolute path). A source inside the checkpoints directory is recorded relative to it."""
    import shutil

    root = tmp_path / "run" / "checkpoints"
    cd = CheckpointDir(root)
    two = commit(root, 2, cd)
    commit(root, 4, cd)
    CheckpointDir(root).start(two, explicit=True)  # 4 to abandoned/
    away = next(root.glob("abandoned/*/step_00000004"))
    state = json.loads((away / STATE).read_text())
    CheckpointDir(root).start(Found(away, state), explicit=True)  # back to the abandoned 4
    shutil.copytree(tmp_path / "run", tmp_path / "copy")
    found, _ = resolve.latest(tmp_path / "copy" / "checkpoints")
    assert found.path == tmp_path / "copy" / "checkpoints" / away.relative_to(root)


@pytest.mark.parametrize("cut", ["torn", "damaged"])
def test_a_journal_cut_to_no_whole_record_is_never_read_as_one_from_before_journals(tmp_path, cut):
    """Found by the sequence test in CI: the journal cut short twice (journal.last names a record it no longer
    has) to half a record, or damaged in place to no whole one. It had been read as a directory from before
    journals: the old rules resumed the newest step, and the start's next record (a damaged checkpoint set
    aside) made a journal with no commit in it, whole again by journal.last, so that the next plain resume
    found nothing to resume beside an intact step_2. A plain resume refuses (the line is unknown), and no
    prune removes anything."""
    root = tmp_path / "checkpoints"
    cd = CheckpointDir(root)
    for step in (2, 4, 6):
        commit(root, step, cd)
    path = root / journal.JOURNAL
    raw = path.read_bytes()
    path.write_bytes(
        raw[: raw.index(b"\n") // 2] if cut == "torn" else raw.replace(b'"tag":"step_', b'"tag":"STEP_')
    )
    view = lineage.View.read(root)
    assert not view.records and view.journaled
    with pytest.raises(UserError, match=r"journal.jsonl: .*--resume PATH"):
        resolve.latest(root)
    assert lineage.prune_plan(view, 1) == []
    assert not lineage.is_head(
        view, Found(root / "step_00000006", json.loads((root / "step_00000006" / STATE).read_text()))
    )


def test_the_newest_abandoned_line_is_the_journals_not_the_clocks(tmp_path, monkeypatch):
    """Issue 69, case 4: abandoned/ was ordered by the local time in its entries' names; a rollback under
    TZ=Asia/Tokyo, then one under TZ=UTC, named the second older, and keep_abandoned: 1 deleted the newer
    line. The journal's order decides; the names keep a time for people."""
    import time

    root = tmp_path / "checkpoints"
    cd = CheckpointDir(root, keep_abandoned=1)
    two = commit(root, 2, cd)
    cd.start(two, explicit=False)
    commit(root, 4, cd)
    for zone in ("Asia/Tokyo", "UTC"):
        monkeypatch.setenv("TZ", zone)
        time.tzset()
        cd.start(two, explicit=True)  # a rollback to step 2: the line's step 4 leaves for abandoned/
        commit(root, 4, cd)  # the new line's step 4
    monkeypatch.delenv("TZ")
    time.tzset()
    forks = [r for r in journal.read(root).records if r.event == "fork" and r.get("to")]
    assert [p.name for p in (root / ABANDONED).iterdir()] == [forks[-1].get("to").split("/", 1)[1]]


@pytest.mark.parametrize("last", ["kept", "deleted too"])
def test_a_deleted_journal_is_refused_as_an_emptied_one_is(tmp_path, last):
    """Issue 69, case 2: with journal.jsonl deleted after a rollback (journal.last kept), a resume read the
    directory by the rules from before journals and set aside, then deleted, the current line's ancestors.
    The journal's absence is evidence where journal.last, or a checkpoint whose manifest names its line, says
    there was one: a plain resume refuses (exit 2, naming what is missing and how to continue), nothing moves."""
    root = tmp_path / "checkpoints"
    cd = CheckpointDir(root)
    two = commit(root, 2, cd)
    cd.start(two, explicit=False)
    commit(root, 4, cd)
    commit(root, 6, cd)
    cd.start(two, explicit=True)  # a rollback: 4 and 6 leave for abandoned/
    commit(root, 4, cd)
    (root / journal.JOURNAL).unlink()
    if last != "kept":
        (root / journal.LAST).unlink()
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    with pytest.raises(UserError, match=r"journal.jsonl: it is missing .*--resume PATH"):
        resolve.latest(root)
    with pytest.raises(UserError, match="it is missing"):
        resolve.resolve(None, "auto", tmp_path)  # checkpoint.resume: auto too
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before
    found = resolve.resolve(str(root / "step_00000004"), "auto", tmp_path)[0].found  # named: a new line
    assert found.step == 4


def test_a_staging_directory_resumed_by_name_stays_resumable_and_latest_never_names_it(tmp_path):
    """Issue 69, case 7: `--resume .../.tmp-step_00000006` (a save killed after its manifest, complete) killed
    before its first save left `latest` naming `.tmp-step_00000006`, and a plain --resume said "nothing to
    resume" with step 6 (staging), 4 and 2 intact: the fork's source, named by path, was looked for as a step_*
    directory only. A plain resume continues it, the next start keeps it, and `latest` names committed
    checkpoints only."""
    root = tmp_path / "checkpoints"
    cd = CheckpointDir(root)
    two = commit(root, 2, cd)
    cd.start(two, explicit=False)
    commit(root, 4, cd)
    stage = cd.prepare("step_00000006")
    stage.mkdir(parents=True)
    (stage / "shard.pt").write_bytes(b"x" * 6)
    cd.write_manifest(stage, {"step": 6}, {}, "exp: 1\n")  # killed here: the manifest written, not renamed
    found = resolve.resolve(str(stage), "never", tmp_path)[0].found
    CheckpointDir(root).start(found, explicit=True)  # the resume by name, killed before its first save
    assert not (root / "latest").exists() or (root / "latest").read_text().strip() != stage.name
    again = resolve.resolve("latest", "never", tmp_path)[0].found  # a plain --resume
    assert again.path == stage
    cd = CheckpointDir(root)
    cd.start(again, explicit=False)
    assert stage.exists()  # kept by the start that resumes it
    seven = commit(root, 7, cd)
    assert resolve.latest(root)[0].path == seven.path and (root / "latest").read_text().strip() == seven.tag
    # review of issue 69: the save's preparation removed it ('left by an interrupted save'), and the next plain
    # resume, its line broken there, set step 2 and 4 aside as 'no part of the line'
    assert stage.exists()
    said = CheckpointDir(root).start(resolve.resolve("latest", "never", tmp_path)[0].found, explicit=False)
    assert not (root / "abandoned").exists() and (root / "step_00000002").exists(), said
    assert [e.tag for e in lineage.prune_plan(lineage.View.read(root), 2)] == [
        "step_00000004",
        "step_00000002",
    ]


def test_a_prune_still_deleting_is_no_interrupted_save(tmp_path, caplog):
    """Issue 69, messages: every save after a prune logged "removing .trash-step_N (left by an interrupted
    save)" (the prune's own deletion, still running in the background), though nothing was interrupted; and
    removed it under the thread deleting it. A crash's leftover is still said and removed."""
    import logging
    import threading

    from trainer.checkpoint.fs import LocalFS

    release = threading.Event()

    class Slow(LocalFS):
        def rmtree(self, path):
            if threading.current_thread().name == "prune":  # the prune's deletion in the background
                release.wait(10)
            super().rmtree(path)

    root = tmp_path / "checkpoints"
    cd = CheckpointDir(root, fs=Slow())
    for step in (2, 4):
        commit(root, step, cd)
    assert cd.prune(1) == ["step_00000002"]  # its deletion goes on in the background
    (root / ".tmp-step_00000003").mkdir()  # what a crashed save leaves
    with caplog.at_level(logging.INFO, logger="trainer"):
        cd.prepare("step_00000006")
    said = [r.message for r in caplog.records if "interrupted save" in r.message]
    assert said == [f"removing {root / '.tmp-step_00000003'} (left by an interrupted save)"], said
    release.set()
    cd.wait_deletes()
    assert not (root / ".trash-step_00000002").exists()


def test_a_head_removed_by_hand_and_a_latest_edited_by_hand_are_said(tmp_path):
    """Issue 69, messages: a plain resume past the line's newest, which someone deleted by hand, said nothing;
    a `latest` edited by hand (DeepSpeed's way to roll back) was ignored silently. Both are said: what is
    gone, and that the journal decides with how to roll back (--resume PATH)."""
    import shutil

    root = tmp_path / "checkpoints"
    cd = CheckpointDir(root)
    for step in (2, 4, 6, 8):
        commit(root, step, cd)
    (root / "latest").write_text("step_00000004\n")  # DeepSpeed's way to roll back, by hand
    found, said = resolve.latest(root)
    assert found.step == 8 and len(said) == 1, said
    assert (
        "names step_00000004, not step_00000008" in said[0]
        and f"--resume {root / 'step_00000004'}" in said[0]
    )
    shutil.rmtree(root / "step_00000008")  # the head, removed by hand
    (root / "latest").write_text("step_00000008\n")
    found, said = resolve.latest(root)
    assert found.step == 6 and said == [
        f"checkpoint step_00000008 of the current line is gone from {root} (no prune "
        "removed it: by hand, or another process); resuming past it"
    ], said


def test_a_checkpoint_a_live_reader_leases_is_kept_past_keep_last_until_it_is_done(tmp_path):
    """Issue 69, readers beside a writer: a read lease (bin/export, --resume PATH of another run directory)
    keeps its checkpoint from the writer's prune while the reader lives; released (or the reader gone), the
    next prune removes it. Another process holds the lease here: the pruner tells a live lease by its flock."""
    import subprocess
    import sys

    from trainer.checkpoint.lease import leased

    root = tmp_path / "checkpoints"
    cd = CheckpointDir(root, background_deletes=False)
    two = commit(root, 2, cd)
    cd.start(two, explicit=False)
    reader = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
from trainer.checkpoint.lease import Lease
lease = Lease(__import__("pathlib").Path({str(root / 'step_00000002')!r}), "bin/export")
print("leased", flush=True)
sys.stdin.readline()
lease.release()
print("released", flush=True)
"""], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert reader.stdout.readline().strip() == "leased"
    assert list(leased(root)) == ["step_00000002"]
    commit(root, 4, cd)
    assert cd.prune(1) == [] and (root / "step_00000002").is_dir()  # kept while it is read
    reader.stdin.write("\n")
    reader.stdin.flush()
    assert reader.stdout.readline().strip() == "released" and reader.wait() == 0
    assert leased(root) == {}
    assert cd.prune(1) == ["step_00000002"] and not (root / "step_00000002").exists()


def test_a_named_checkpoint_gone_is_said_as_gone(tmp_path):
    """Issue 69, case 5: `--resume` of a step directory another job's prune removed said "not a checkpoint (no
    trainer_state.json in it)"; it says the checkpoint is gone and what its checkpoints directory holds now."""
    root = tmp_path / "checkpoints"
    cd = CheckpointDir(root, background_deletes=False)
    for step in (2, 4):
        commit(root, step, cd)
    cd.prune(1)
    with pytest.raises(
        UserError, match=r"step_00000002: no such checkpoint \(.* holds step_00000004 now: a job"
    ):
        resolve.resolve(str(root / "step_00000002"), "never", tmp_path / "elsewhere")


def test_a_checkpoint_set_aside_here_is_not_called_outside_the_run_directory(tmp_path):
    """Issue 69, the messages: a resume of a checkpoint in this run directory's abandoned/ said 'a new line
    from .../abandoned/.../step_00000004 (outside this run directory)'. Set aside here is said as such; a
    checkpoint of another run directory is still outside it."""
    root = tmp_path / "run" / "checkpoints"
    cd = CheckpointDir(root)
    two = commit(root, 2, cd)
    commit(root, 4, cd)
    CheckpointDir(root).start(two, explicit=True)  # 4 to abandoned/
    away = next(root.glob("abandoned/*/step_00000004"))
    said = CheckpointDir(root).start(Found(away, json.loads((away / STATE).read_text())), explicit=True)
    assert any("(set aside in this run directory)" in s for s in said), said
    other = tmp_path / "other" / "checkpoints"
    elsewhere = commit(other, 2, CheckpointDir(other))
    fresh = tmp_path / "fresh" / "checkpoints"
    said = CheckpointDir(fresh).start(elsewhere, explicit=True)
    assert any("(outside this run directory)" in s for s in said), said


def test_a_journal_restored_from_an_older_copy_is_refused_naming_what_it_never_recorded(tmp_path):
    """Issue 69, the journal replaced by an older copy with its journal.last (a backup restored): it says the
    line is step 2 then step 4, while step 4 here is the rollback's (line 2, then the new 4). A plain resume
    took step 2 and set the newer step 4 aside; it refuses, naming it, and nothing moves."""
    root = tmp_path / "checkpoints"
    cd = CheckpointDir(root)
    two = commit(root, 2, cd)
    commit(root, 4, cd)
    copy = journal_copy(root)
    cd = CheckpointDir(root)
    cd.start(two, explicit=True)  # a rollback: 4 to abandoned/
    commit(root, 4, cd)
    restore(root, copy)
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    with pytest.raises(UserError, match=r"journal.jsonl: it is older than the checkpoints here \(it never recorded "
                                        r"step_00000004.*--resume PATH"):  # fmt: skip
        resolve.resolve("latest", "never", tmp_path)
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before


def test_a_journal_older_than_a_rollback_is_refused_naming_the_checkpoint_it_never_saw_set_aside(tmp_path):
    """Issue 69, found by the stateful test's random series: 2 and 4 saved, a rollback to 2 (4 to abandoned/),
    then the journal and journal.last restored from a copy taken before it. The copy says the line is 2 then 4;
    a plain resume said 4 was gone and took 2, though 4 is here, set aside by a rollback the copy never saw (and
    resumed since, perhaps). It refuses, naming it, and nothing moves."""
    root = tmp_path / "checkpoints"
    cd = CheckpointDir(root)
    two = commit(root, 2, cd)
    commit(root, 4, cd)
    copy = journal_copy(root)
    CheckpointDir(root).start(two, explicit=True)  # a rollback: 4 to abandoned/
    away = next(root.glob("abandoned/*/step_00000004"))
    CheckpointDir(root).start(Found(away, json.loads((away / STATE).read_text())), explicit=True)
    restore(root, copy)
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    with pytest.raises(UserError, match=r"journal.jsonl: it is older than the checkpoints here \(it never recorded "
                                        r"abandoned/step_\d+-[^/]+/step_00000004 set aside.*--resume PATH"):  # fmt: skip
        resolve.resolve("latest", "never", tmp_path)
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before


def test_a_line_cut_by_a_damaged_record_and_a_damaged_manifest_is_refused_not_called_empty(tmp_path):
    """Issue 69, found by the stateful test's random series: 2 and 4 saved, the journal's record of 4 damaged, a
    resume of 4 by path (a fork from it), then 4's trainer_state.json damaged. Its parent was in both, so the line
    below 4 cannot be told: a plain resume said 'nothing to resume: no complete checkpoint' with step 2 intact.
    It says why, and the way on (--resume PATH)."""
    root = tmp_path / "checkpoints"
    cd = CheckpointDir(root)
    commit(root, 2, cd)
    four = commit(root, 4, cd)
    lines = (root / journal.JOURNAL).read_bytes().splitlines(keepends=True)
    lines[1] = b"{" + b"x" * (len(lines[1]) - 2) + b"\n"
    (root / journal.JOURNAL).write_bytes(b"".join(lines))
    CheckpointDir(root).start(four, explicit=True)
    state = root / "step_00000004" / STATE
    state.write_bytes(b"\x8d" + state.read_bytes()[1:])
    # the fork records its source's parent (review of issue 69): the line goes on below 4
    assert resolve.resolve("latest", "never", tmp_path)[0].found.step == 2
    root = tmp_path / "cut" / "checkpoints"  # no fork: 6 over 4, 4's record and manifest damaged, 6's too
    cd = CheckpointDir(root)
    for step in (2, 4, 6):
        commit(root, step, cd)
    lines = (root / journal.JOURNAL).read_bytes().splitlines(keepends=True)
    lines[1] = b"{" + b"x" * (len(lines[1]) - 2) + b"\n"
    (root / journal.JOURNAL).write_bytes(b"".join(lines))
    for step in (4, 6):
        state = root / f"step_{step:08d}" / STATE
        state.write_bytes(b"\x8d" + state.read_bytes()[1:])
    with pytest.raises(UserError, match=r"journal.jsonl: line 2 is damaged .* so a plain resume cannot tell which "
                                        r"checkpoints are below .* on its line \(step_00000002 here may be\).*--resume PATH"):  # fmt: skip
        resolve.resolve("latest", "never", root.parent)


def test_a_power_loss_between_two_drops_never_keeps_the_older_line_set_aside():
    """Issue 69, found by the stateful test's random series: keep_abandoned deletes the oldest lines first, each
    drop recorded before its deletion; the deletion was not made durable before the next drop's record, so a
    power loss there kept the older directory (back after the loss) and deleted the newer one. Each deletion is
    now durable before the next record: after a loss at every operation of the eviction, every directory a
    later drop names is gone with the ones before it."""
    from simfs import Crash, SimFS

    from trainer.checkpoint.aside import evict, held

    root = Path("/run/checkpoints")
    names = [f"step_0000000{n}-20261129-1200{n}0-000000000abc" for n in (2, 4, 6)]

    def made() -> tuple[SimFS, CheckpointDir]:
        fs = SimFS()
        for d in (root / ABANDONED / n for n in names):
            fs.mkdir(d)
            fs.durable_write(d / "file", b"x")
        for d in (root / ABANDONED, root, root.parent, Path("/")):
            fs.fsync_dir(d)
        return fs, CheckpointDir(root, fs=fs, keep_abandoned=1)

    fs, cd = made()
    start = fs.ops
    assert evict(cd) == [f"{ABANDONED}/{n}" for n in names[:2]]
    ops = fs.ops - start
    for k in range(1, ops + 1):
        fs, cd = made()
        fs.crash_at = fs.ops + k
        with pytest.raises(Crash):
            evict(cd)
        fs.crash()
        dropped = [r.get("dir") for r in journal.read(root, fs).records if r.event == "drop"]
        left = [f"{ABANDONED}/{n}" for n in held(cd, ABANDONED)]
        assert len(left) + len(dropped) >= 3, (
            k,
            dropped,
            left,
        )  # the directories are there (the test can fail)
        for n, d in enumerate(dropped[:-1]):  # the last one's deletion may not have been made yet
            assert d not in left, (k, d, "kept after", dropped[n + 1 :], left)


def test_a_journal_older_than_a_prune_adopts_no_unrecorded_checkpoint(tmp_path):
    """Issue 69, found by the stateful test's random series: 2 and 4 saved and the journal copied; 6 saved, 2
    pruned, then a rollback to 4 recorded and the power lost before it moved 6 away; the copy restored. The copy
    says 2 then 4, and 6 (a child of 4 it never recorded) was adopted as a commit whose record a crash lost,
    though such a crash comes before the prune of 2, which is gone: the rollback's line resumed 6. A recorded
    checkpoint gone with no prune recorded beside an unrecorded one is a journal older than the disk: refused."""
    root = tmp_path / "checkpoints"
    cd = CheckpointDir(root)
    commit(root, 2, cd)
    commit(root, 4, cd)
    copy = journal_copy(root)
    commit(root, 6, cd)
    cd.prune(2)
    assert not (root / "step_00000002").exists()
    restore(root, copy)
    with pytest.raises(UserError, match=r"journal.jsonl: it is older than the checkpoints here \(it never recorded "
                                        r"step_00000006.*--resume PATH"):  # fmt: skip
        resolve.resolve("latest", "never", tmp_path)
    crash = tmp_path / "crash" / "checkpoints"  # what the adoption is for: 4's record lost, 2 still there
    cd = CheckpointDir(crash)
    commit(crash, 2, cd)
    copy = journal_copy(crash)
    commit(crash, 4, cd)
    restore(crash, copy)
    assert resolve.resolve("latest", "never", tmp_path / "crash")[0].found.step == 4


def test_a_line_cut_by_a_lost_record_and_a_pruned_manifest_is_refused_not_called_empty(tmp_path):
    """Issue 69, found by the stateful test's random series: a journal restored from before 6 (6 adopted), then 8
    and 10 saved, 4 and 6 pruned (2 kept: an export reads it), then 8 and 10 damaged. 8 names 6 as its parent; 6's
    record went with the journal and its manifest with the prune: a plain resume said 'nothing to resume: no
    complete checkpoint' with step 2 intact. A prune's record now names each one's parent, and 2 is resumed (a
    journal written before that is refused with the reason: doubt.refuse_a_cut_line)."""
    from trainer.checkpoint.lease import Lease

    root = tmp_path / "checkpoints"
    cd = CheckpointDir(root)
    two = commit(root, 2, cd)
    commit(root, 4, cd)
    copy = journal_copy(root)
    commit(root, 6, cd)
    restore(root, copy)
    with Lease(two.path, "an export"):
        for step in (8, 10):
            commit(root, step, cd)
            cd.prune(2)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000002", "step_00000008", "step_00000010"]
    for step in (8, 10):
        (root / f"step_{step:08d}" / "shard.pt").write_bytes(b"y")
    # a prune records each one's parent (review of issue 69): the line is followed below 6 to the intact 2
    assert resolve.resolve("latest", "never", tmp_path)[0].found.step == 2


def test_journal_last_lags_at_most_the_append_in_flight_so_a_cut_across_two_power_losses_is_seen():
    """Issue 69, found by the stateful test's random series: a power loss after an append and before journal.last
    was written leaves it naming the record before; a second such loss left it two behind, and a journal then cut
    short inside the record in between (a fork) read as whole: the rollback was lost and the abandoned step 4
    resumed. An append catches journal.last up first, so it lags by the append in flight at most."""
    from simfs import Crash, SimFS

    class LosingFS(SimFS):  # a power loss right after each journal append, before journal.last is written
        lose = False
        armed = False

        def append(self, path, data):
            super().append(path, data)
            self.armed = self.lose

        def durable_write(self, path, data, tmp_name=None):
            if Path(path).name == journal.LAST and self.armed:
                self.armed = False
                raise Crash("power lost before journal.last")
            super().durable_write(path, data, tmp_name)

    root = Path("/run/checkpoints")
    fs = LosingFS()
    fs.mkdir(root)
    for d in (root, root.parent, Path("/")):
        fs.fsync_dir(d)
    for n in (2, 4):
        journal.append(root, "commit", fs, id=f"c{n}", tag=f"step_{n:08d}", line="a", parent=None, step=n)
    fs.lose = True
    for event in ("fork", "aside"):
        with pytest.raises(Crash):
            journal.append(
                root, event, fs, line="b", source={"id": "c2"}, leaving=[{"id": "c4"}], to="abandoned/x"
            )
        fs.crash()
    assert [r.event for r in journal.read(root, fs).records] == ["commit", "commit", "fork", "aside"]
    fork = journal.read(root, fs).records[2]
    fs.durable_write(root / journal.JOURNAL, fs.read_bytes(root / journal.JOURNAL)[: fork.end - 10])
    assert journal.cut_short(journal.read(root, fs))


def _resumes(run_dir: Path) -> str:
    found = resolve.resolve("latest", "never", run_dir)[0].found
    return found.path.name if found else "nothing"


def test_the_way_out_of_a_refusal_clears_it_and_damage_before_the_line_is_read_around(tmp_path):
    """Review of issue 69 (this session's change), F1 and F2: after the journal was deleted (or restored from before
    a rollback), the refusal's way on, --resume PATH, was refused again at every start after it (a checkpoint of
    the old journal in abandoned/ descended from the new line's source, or no record named its directory), and
    nothing was pruned; a fork record damaged in place before the current line's commits was read as a journal
    older than the disk, where damage there is read around. A fork records the set-aside directories it saw."""
    for how in ("deleted", "restored"):
        root = tmp_path / how / "checkpoints"
        cd = CheckpointDir(root, background_deletes=False)
        commit(root, 2, cd)
        four = commit(root, 4, cd)
        commit(root, 6, cd)
        copy = journal_copy(root)
        CheckpointDir(root).start(four, explicit=True)  # 6 to abandoned/
        if how == "deleted":
            for n in copy:
                (root / n).unlink()
        else:
            restore(root, copy)
        with pytest.raises(UserError, match="--resume PATH"):
            resolve.resolve("latest", "never", root.parent)
        found = resolve.resolve(str(root / "step_00000004"), "never", root.parent)[0].found
        cd = CheckpointDir(root, background_deletes=False)
        cd.start(found, explicit=True)
        for step in (6, 8, 10):
            commit(root, step, cd)
            cd.prune(2)
        assert _resumes(root.parent) == "step_00000010", how
        assert sorted(p.name for p in root.glob("step_*")) == ["step_00000008", "step_00000010"], how
    root = tmp_path / "damaged" / "checkpoints"
    cd = CheckpointDir(root)
    two = commit(root, 2, cd)
    commit(root, 4, cd)
    commit(root, 6, cd)
    cd = CheckpointDir(root)
    cd.start(two, explicit=True)
    commit(root, 4, cd)
    commit(root, 6, cd)
    lines = (root / journal.JOURNAL).read_bytes().split(b"\n")
    assert b'"event":"fork"' in lines[3]
    lines[3] = lines[3].replace(b'"job":null', b'"job":nulL')
    (root / journal.JOURNAL).write_bytes(b"\n".join(lines))
    assert _resumes(root.parent) == "step_00000006"


def test_a_crash_after_a_damaged_head_was_set_aside_adopts_the_new_commit(tmp_path):
    """Review of issue 69, F3: a head whose trainer_state.json cannot be read is set aside as damaged by a resume,
    recorded by its tag alone (no id); the next save of that step killed between its rename and its record was
    not adopted (the line's head stayed the damaged one, not here) and a plain resume refused it as a journal
    older than the disk. The damaged head of that tag is passed over; the new step 6 is resumed."""
    root = tmp_path / "checkpoints"
    cd = CheckpointDir(root)
    for step in (2, 4, 6):
        commit(root, step, cd)
    (root / "step_00000006" / STATE).write_text("{garbage")
    d = resolve.resolve("latest", "never", tmp_path)[0]
    cd = CheckpointDir(root)
    cd.start(d.found, explicit=False, skipped=d.skipped)  # 6 to damaged/
    assert _resumes(tmp_path) == "step_00000004"

    class Killed(Exception):
        pass

    def killed():
        raise Killed

    stage = cd.prepare("step_00000006")
    stage.mkdir(parents=True, exist_ok=True)
    (stage / "shard.pt").write_bytes(b"y")
    with pytest.raises(Killed):
        cd.commit(
            stage, "step_00000006", cd.write_manifest(stage, {"step": 6}, {}, "exp: 1\n"), renamed=killed
        )
    assert _resumes(tmp_path) == "step_00000006"


def test_a_slurm_requeue_continues_its_job_and_a_second_command_in_the_allocation_is_a_new_one(
    tmp_path, monkeypatch
):
    """Review of issue 69, F2: the job was Slurm's job id alone, so bin/train typed twice in one salloc with the
    same --resume step_2 was one job: the second's restart (killed before its fork) took the first's commits
    for its own and resumed the newest, never doing the rollback it was typed for. A command's job is now
    `slurm-<id>.<restart count>/<its own>`; a requeue (the count one more) continues every command before it."""
    from trainer.checkpoint.restart import restart_resume
    from trainer.cluster import dist
    from trainer.run.supervisor import supervised_job

    monkeypatch.delenv("TRAINER_JOB", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    root = tmp_path / "checkpoints"
    cd = CheckpointDir(root)
    two = commit(root, 2, cd)
    commit(root, 4, cd)
    first, second = supervised_job(), supervised_job()
    assert first.startswith("slurm-777.0/") and first != second and dist.job() == "slurm-777.0/step-0"
    cd = CheckpointDir(root)
    cd.start(two, explicit=True, job=first)  # the first command's rollback to step 2, then its save
    commit(root, 4, cd)
    assert restart_resume(tmp_path, str(two.path), first) == "latest"  # its restart: its newest
    assert restart_resume(tmp_path, str(two.path), second) == str(
        two.path
    )  # the second command: what it named
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # the allocation requeued: the same command line again
    assert restart_resume(tmp_path, str(two.path), supervised_job()) == "latest"


def test_a_full_disk_at_the_run_directorys_lock_is_a_user_error(tmp_path, monkeypatch):
    """Review of issue 69, F3: the lock's holder details were written outside the lock's error handling: a run
    directory on a full disk (no .lock yet) ended in a traceback (exit 1, retried by a supervisor)."""
    import builtins

    from trainer.run import rundir

    class Full:
        def __init__(self, f):
            self.f = f

        def __getattr__(self, name):
            return getattr(self.f, name)

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / rundir.LOCK))

    monkeypatch.setattr(rundir, "open", lambda *a, **k: Full(builtins.open(*a, **k)), raising=False)  # noqa: SIM115
    with pytest.raises(UserError, match=r"run_dir .* cannot be written .*No space left|ENOSPC"):
        rundir.hold(tmp_path, 0, 1, 0.0)


def test_a_full_disk_at_a_prunes_record_is_said_and_training_goes_on(tmp_path, caplog):
    """Review of issue 69, F4: ENOSPC as the prune after a commit appended its record ended the run in a
    traceback (exit 1, retried). The checkpoint is committed and nothing was removed: a warning, and the
    next save prunes again."""
    from types import SimpleNamespace

    from trainer.checkpoint.cadence import _prune
    from trainer.checkpoint.fs import LocalFS

    class Full(LocalFS):
        def append(self, path, data):
            if b'"event":"prune"' in data:
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            super().append(path, data)

    root = tmp_path / "checkpoints"
    cd = CheckpointDir(root, fs=Full())
    for step in (2, 4, 6):
        commit(root, step, cd)
    store = SimpleNamespace(disk=cd, root=root, faults=SimpleNamespace(at=lambda *a: None))
    with caplog.at_level("WARNING", logger="trainer"):
        _prune(store, 1, 6)
    assert "checkpoint.keep_last" in caplog.text and "No space left" in caplog.text
    assert all((root / f"step_0000000{s}").exists() for s in (2, 4, 6))
    cd.fs = LocalFS()  # space freed: the next prune removes them
    assert cd.prune(1) == ["step_00000004", "step_00000002"]


@pytest.mark.parametrize("fails", ["latest", "journal"])
def test_a_full_disk_after_the_commits_record_is_no_failed_commit(tmp_path, caplog, fails):
    """Review of issue 69, F5: ENOSPC as `latest` was written (after the journal's record) ended the run with
    'the journal has no record of it yet'. Recorded, it is committed: a warning, training goes on (`latest` is
    a cache). The journal's own record failing is still the user error that says so."""
    from types import SimpleNamespace

    from trainer.checkpoint.fs import LocalFS
    from trainer.checkpoint.store import Pending, _commit_main

    class Full(LocalFS):
        def durable_write(self, path, data, tmp_name=None):
            if fails == "latest" and Path(path).name == "latest":
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            super().durable_write(path, data, tmp_name)

        def append(self, path, data):
            if fails == "journal" and b'"event":"commit"' in data:
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            super().append(path, data)

    root = tmp_path / "checkpoints"
    cd = CheckpointDir(root, fs=Full())
    stage = cd.prepare("step_00000002")
    stage.mkdir(parents=True, exist_ok=True)
    (stage / "shard.pt").write_bytes(b"x")
    nothing = SimpleNamespace(at=lambda *a: None, full=lambda *a: None)
    store = SimpleNamespace(disk=cd, root=root, faults=nothing, engine=SimpleNamespace(ds_config={}),
                            exp=SimpleNamespace(to_yaml=lambda: "exp: 1\n"))  # fmt: skip
    pending = Pending(step=2, tag="step_00000002", stage_dir=stage, meta={"step": 2}, started=0.0)
    if fails == "latest":
        with caplog.at_level("WARNING", logger="trainer"):
            _commit_main(store, pending, [])
        assert "committed (the journal records it)" in caplog.text
        assert resolve.latest(root)[0].tag == "step_00000002"
    else:
        with pytest.raises(UserError, match="in place, renamed before the error: the journal has no record"):
            _commit_main(store, pending, [])


def test_a_lease_is_seen_only_whole_and_held(tmp_path):
    """Review of issue 69 (a suspicion, closed): a lease file was visible before its reader had written it (a
    pruner then read no tag and pruned) or locked it (a pruner took the free lock and removed a live lease).
    It is written and locked as `.new-...`, then renamed; a `.new-` one whose reader died is removed."""
    import os
    import time

    from trainer.checkpoint.lease import PENDING, READERS, Lease, leased

    root = tmp_path / "checkpoints"
    two = commit(root, 2, CheckpointDir(root))
    with Lease(two.path, "bin/export"):
        names = os.listdir(root / READERS)
        assert len(names) == 1 and not names[0].startswith(PENDING)
        assert json.loads((root / READERS / names[0]).read_text())["tag"] == "step_00000002"
        assert list(leased(root)) == ["step_00000002"]
    dead = root / READERS / f"{PENDING}host-1-abc"
    dead.write_text("")
    assert leased(root) == {} and dead.exists()  # young: maybe a reader between its write and its rename
    os.utime(dead, (time.time() - 120, time.time() - 120))
    assert leased(root) == {} and not dead.exists()


def test_a_reader_beside_an_append_never_sees_the_journal_cut_short(tmp_path):
    """CI: `bin/export RUN_DIR` beside a training job once read the journal, then the job appended a record and
    wrote journal.last, then the export read journal.last: a record its copy of the journal did not hold, so it
    refused the journal as cut short (tests/e2e/test_between_processes.py, 1 run in many). journal.last is read
    first now: what it names was appended before, so the journal read after it holds it."""
    from trainer.checkpoint.fs import LocalFS

    root = tmp_path / "checkpoints"
    cd = CheckpointDir(root)
    commit(root, 2, cd)

    class Racing(LocalFS):
        """Another process appends (and writes journal.last) right after this reader reads the journal."""

        def read_bytes(self, path):
            data = super().read_bytes(path)
            if Path(path).name == journal.JOURNAL:
                journal.append(root, "drop", name="step_00000002", reason="the writer's next record")
            return data

    parsed = journal.read(root, Racing())
    assert not journal.cut_short(parsed), parsed.tail
    assert not journal.cut_short(journal.read(root))
