"""A conversion's worker processes die with it (trainer/checkpoint/reshard.py `workers_die_with_it`): DeepSpeed's
ds_to_universal forks a pool whose workers inherit the checkpoint's conversion lock; a rank killed mid-pool left
them holding it, and every later conversion of that checkpoint waited out checkpoint.convert_timeout_minutes (review
of issue 71, reproduced with a 2-stage checkpoint)."""

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FORKS = """
import os, sys, time
from trainer.checkpoint import reshard
if sys.argv[1] == "on":
    reshard.workers_die_with_it()
pid = os.fork()
if pid == 0:
    time.sleep(60)
    os._exit(0)
print(pid, flush=True)
time.sleep(60)
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def worker_after_kill(mode: str) -> bool:
    """Whether a forked worker still runs 3 s after its parent was killed."""
    p = subprocess.Popen([sys.executable, "-c", FORKS, mode], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    child = int(p.stdout.readline())
    p.kill()
    p.wait()
    deadline = time.monotonic() + 3
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = alive(child)
    if left:
        os.kill(child, 9)
    return left


def test_a_conversions_forked_workers_die_with_it():
    assert not worker_after_kill("on")
    assert worker_after_kill("off")  # (without it the worker outlives its parent: what the test would miss)
