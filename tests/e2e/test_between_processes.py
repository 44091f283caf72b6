"""Checkpoints between processes, as a cluster makes them (issue 69):

- a requeued job started while the dying one still trains, then saves on SIGTERM and prunes. The new job had
  decided what to resume about 5 s before it took the run directory's lock, so it resumed the checkpoint the
  dying job's prune removed and set its last save aside (keep_last 1: exit 2, nothing left;
  checkpoint.resume: auto then started from step 1); with keep_last 2 it resumed the older one and moved the
  newest to abandoned/. Now rank 0 takes the lock first, waiting for the dying job (checkpoint.lock_wait_s),
  and every decision is made after it;
- torchrun's own restarts (--max-restarts) rerun the command line, `--resume PATH` included: a rollback was
  done again after the job had committed on its new line. A restart of the same job (torchrun's agent, a
  Slurm job id) now resumes the line's newest once the job committed, as the supervisor's restarts do."""

import queue
import signal
import subprocess
import threading
import time

import pytest
from helpers import BIN, FAST, ROOT, TINY, TRAIN, command, data_cache, env_for, free_port, train, yaml_value

from trainer.checkpoint import latest

pytestmark = pytest.mark.e2e


def start(sets: dict, extra: list[str], fault: str = "") -> tuple[subprocess.Popen, queue.Queue]:
    args = [str(TINY)]
    for k, v in sets.items():
        args += ["--set", f"{k}={yaml_value(v)}"]
    p = subprocess.Popen(command("none", 1, args + extra), cwd=ROOT, env=env_for(1, {"TRAINER_FAULT": fault}),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in p.stdout], daemon=True).start()
    return p, lines


def wait_for(lines: queue.Queue, text: str, seen: list[str], timeout: float = 180) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        seen.append(line)
        if text in line:
            return line
    raise AssertionError(f"never said {text!r}:\n{''.join(seen)[-4000:]}")


@pytest.mark.parametrize("keep_last,how", [(1, "--resume"), (2, "--resume"), (1, "auto"), (2, "auto")])
def test_a_requeued_job_overlapping_the_dying_one_resumes_its_last_save(tmp_path, keep_last, how):
    run_dir = tmp_path / "run"
    base = {**FAST, "model.config.n_layer": 1, "data.seq_len": 64, "run_dir": run_dir, "data.cache_dir": data_cache(),
            "checkpoint.every_steps": 2, "checkpoint.keep_last": keep_last, "data.eval_fraction": 0,
            "train.max_steps": 10_000}  # fmt: skip
    first, first_lines = start(base, [], fault="slow@1:ms=100")
    second = None
    try:
        while (found := latest(run_dir / "checkpoints")[0]) is None or found.step < 4:
            assert first.poll() is None, "the first job ended early"
            time.sleep(0.2)
        extra = ["--resume"] if how == "--resume" else ["--set", "checkpoint.resume=auto"]
        second, second_lines = start(base, extra)
        said: list[str] = []
        wait_for(second_lines, "waiting up to", said)  # the first job holds the run directory
        first.send_signal(signal.SIGTERM)  # the dying job saves on SIGTERM, prunes, exits
        assert first.wait(timeout=120) == 0
        # The dying job's last save, from its own words: `latest` read now may already be the second job's
        # next save (it resumes and trains as soon as the lock is free; CI failed once that way, step 46
        # against the 45 it resumed).
        stopped = wait_for(first_lines, "stopping at step", [])
        tag = f"step_{int(stopped.split('stopping at step ')[1].split()[0]):08d}"
        line = wait_for(second_lines, "resumed from", said)
        assert f"resumed from {tag}" in line or f"{run_dir / 'checkpoints' / tag} " in line, line
        assert not (run_dir / "checkpoints" / "abandoned").exists(), "nothing set aside"
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=120) == 0, "".join(said)[-3000:]
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def test_torchruns_own_restart_does_not_roll_back_again(tmp_path):
    """Issue 69, case 3: `torchrun --max-restarts 1 ... --resume .../step_00000008` rolls back a line that
    went on to step 12; the job commits steps 9 and 10 on its new line and fails at step 11. torchrun reruns the
    same command line: it resumed step 8 again ("rollback: resumed from step_00000008"), set the job's own line
    aside and trained from 9 again. The restart resumes the job's newest, step 10, and the journal holds the
    one rollback."""
    run_dir = tmp_path / "run"
    base = {**FAST, "model.config.n_layer": 1, "data.seq_len": 64, "run_dir": run_dir, "data.cache_dir": data_cache(),
            "checkpoint.every_steps": 2, "checkpoint.keep_last": 10, "data.eval_fraction": 0}  # fmt: skip
    train(tmp_path / "first", {**base, "train.max_steps": 12})
    args = [str(BIN / "torchrun"), "--nproc_per_node", "1", "--max-restarts", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(TRAIN), str(TINY)]  # fmt: skip
    for k, v in {**base, "train.max_steps": 14, "checkpoint.every_steps": 1}.items():
        args += ["--set", f"{k}={yaml_value(v)}"]
    args += ["--resume", str(run_dir / "checkpoints" / "step_00000008")]
    env = env_for(1, {"TRAINER_FAULT": "raise@11:attempt=0", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    p = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert out.count("rollback: resumed from step_00000008") == 1, out[-4000:]
    assert "step_00000010 at step 10" in out, out[-4000:]  # the restart continued the job's own line
    from trainer.checkpoint import journal

    records = journal.read(run_dir / "checkpoints").records
    assert [r.event for r in records].count("fork") == 1
    assert latest(run_dir / "checkpoints")[0].step == 14


@pytest.mark.parametrize("point", ["fullmanifest", "fulljournal"])
def test_a_full_disk_at_the_commit_is_a_user_error_and_the_next_resume_is_right(tmp_path, point):
    """Issue 69, case 6: a full disk during rank 0's commit was a raw traceback (ENOSPC from the manifest's
    write, or from the journal's append after the rename, once with no file named). It is exit 2 with the
    file, ENOSPC and what is kept: before the manifest, the save is not committed and `latest` keeps the one
    before; after the rename, the checkpoint is in place and the next start adopts it. The resume after
    freeing the space continues from there."""
    base = {**FAST, "model.config.n_layer": 1, "data.seq_len": 64, "checkpoint.every_steps": 2,
            "data.eval_fraction": 0, "train.max_steps": 6}  # fmt: skip
    r = train(tmp_path, base, env={"TRAINER_FAULT": f"{point}@4"}, check=False)
    out = r.output
    assert r.returncode == 2 and "Traceback" not in out, out[-3000:]
    assert "error: checkpoint step_00000004: " in out and "(ENOSPC) committing it" in out, out[-3000:]
    named = "trainer_state.json" if point == "fullmanifest" else "journal.jsonl"
    assert f"{named}: No space left on device" in out, out[-3000:]
    if point == "fullmanifest":
        assert "step_00000004 was not committed: step_00000002 stays the newest, intact" in out, out[-3000:]
    else:
        assert "step_00000004 is in place, renamed before the error" in out and "adopts it" in out, out[
            -3000:
        ]
    again = train(tmp_path, base, extra_args=["--resume"])
    resumed = 2 if point == "fullmanifest" else 4
    assert f"step_{resumed:08d} at step {resumed}" in again.output, again.output[-3000:]


def test_readers_beside_a_pruning_writer_read_what_they_chose(tmp_path):
    """Issue 69, case 5: `bin/export RUN_DIR` while the job trains with keep_last 1 ended in a traceback 4 of 4
    times (FileNotFoundError: the checkpoint checked, then pruned by the running job, then read); `--resume PATH`
    of a checkpoint another job prunes said "no DeepSpeed model states" without saying it vanished. Each reader
    holds a read lease on what it chose, which the writer's prune keeps until the reader is done: the exports
    succeed, and a second run loads the newest of the writer's run directory while the writer goes on pruning."""
    run_dir = tmp_path / "run"
    base = {**FAST, "model.config.n_layer": 1, "data.seq_len": 64, "run_dir": run_dir, "data.cache_dir": data_cache(),
            "checkpoint.every_steps": 5, "checkpoint.keep_last": 1, "data.eval_fraction": 0,
            "train.max_steps": 100_000}  # fmt: skip
    writer, _ = start(base, [], fault="slow@1:ms=50")
    try:
        while latest(run_dir / "checkpoints")[0] is None:
            assert writer.poll() is None, "the job ended early"
            time.sleep(0.2)
        for n in range(2):
            p = subprocess.run([str(ROOT / "bin" / "export"), str(run_dir), str(tmp_path / f"hf{n}")], cwd=ROOT,
                               env=env_for(1), capture_output=True, text=True, timeout=300)  # fmt: skip
            out = p.stdout + p.stderr
            assert p.returncode == 0 and "Traceback" not in out, out[-3000:]
            assert (tmp_path / f"hf{n}" / "config.json").exists()
        # a second run resumes the writer's newest (--resume RUN_DIR), leased from the moment it chose it
        other = {**base, "run_dir": tmp_path / "other"}
        second, lines = start(other, ["--resume", str(run_dir), "--dry-run"])
        said: list[str] = []
        line = wait_for(lines, "resumed from", said)
        assert str(run_dir / "checkpoints") in line and second.wait(timeout=120) == 0, "".join(said)[-3000:]
    finally:
        writer.kill()
        writer.wait()
