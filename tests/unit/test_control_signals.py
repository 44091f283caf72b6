"""A rank that has saved on a stop request ends with the stop's exit code even when a SIGTERM reaches it
while it exits (srun --kill-on-bad-exit sends one once the first rank has exited with that code)."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LATE_SIGTERM = textwrap.dedent(
    """
    import os, signal, sys, time
    sys.path.insert(0, {root!r})
    from trainer.cluster.control import ignore_sigterm_after_save
    ignore_sigterm_after_save()

    class Late:  # torn down while the interpreter finalizes, after it has restored default signal actions
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)

    late = Late()
    {when}
    sys.exit(85)
    """
)


def run(when: str) -> int:
    code = LATE_SIGTERM.format(root=str(ROOT), when=when)
    return subprocess.run([sys.executable, "-c", code], timeout=60).returncode


def test_a_sigterm_while_the_interpreter_finalizes_keeps_the_stops_exit_code():
    # a Python handler (the previous fix) exits 143 here: finalization restores SIGTERM's default action
    assert run("") == 85


def test_a_sigterm_while_the_rank_still_runs_python_keeps_the_stops_exit_code():
    assert run("os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.2)") == 85
