"""Two jobs on one run directory, as a cluster makes them (issue 69): a requeued job started while the dying
one still trains, then saves on SIGTERM and prunes. The new job decided what to resume about 5 s before it
took the run directory's lock, so it resumed the checkpoint the dying job's prune removed and set its last
save aside (keep_last 1: exit 2, nothing left; checkpoint.resume: auto then started from step 1); with
keep_last 2 it resumed the older one and moved the newest to abandoned/. Now rank 0 takes the lock first,
waiting for the dying job (checkpoint.lock_wait_s), and every decision is made after it."""

import queue
import signal
import subprocess
import threading
import time

import pytest
from helpers import FAST, ROOT, TINY, command, data_cache, env_for, yaml_value

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
        last = latest(run_dir / "checkpoints")[0]
        line = wait_for(second_lines, "resumed from", said)
        assert f"resumed from {last.tag}" in line or str(last.path) in line, line
        assert not (run_dir / "checkpoints" / "abandoned").exists(), "nothing set aside"
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=120) == 0, "".join(said)[-3000:]
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
