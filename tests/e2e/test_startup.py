"""A rank's start: the garbage collector's full passes do not walk the libraries it imports
(trainer/common/startup.py), and the first logged step counts the step, not the set-up before it."""

import re
import subprocess
import sys

import pytest
from helpers import ROOT, TINY, TRAIN, data_cache, env_for, train

pytestmark = pytest.mark.e2e

PREFS = ROOT / "data" / "tiny" / "python_prefs.jsonl"

# bin/train under a counter of the collector's full passes (generation 2), from the first import on.
COUNTED = """
import gc, runpy, sys
full = []
gc.callbacks.append(lambda phase, info: full.append(1) if phase == "stop" and info["generation"] == 2 else None)
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    print("full collections:", len(full))
"""


def test_a_rank_start_runs_the_loops_full_collection_not_one_per_quarter_of_growth(tmp_path):
    """A one-step tiny run: the full pass when the loop starts, over what the run built (torch's and
    transformers' objects are frozen), and at most one more (DeepSpeed's import). Without
    trainer/common/startup.py it ran 7 (the loop's among them), each over everything imported so far:
    0.85 s of a rank's ~5 s of CPU."""
    args = [TINY, "--set", f"run_dir={tmp_path / 'run'}", "--set", f"data.cache_dir={data_cache()}",
            "--set", "train.max_steps=1", "--set", "train.eval_every=0", "--set", "checkpoint.save_final=false"]  # fmt: skip
    # the data cached first: a run that tokenizes imports `datasets` after the libraries are frozen,
    # with passes of its own (over datasets' objects only)
    prepared = subprocess.run([sys.executable, str(TRAIN), *map(str, args), "--prepare-data"], cwd=ROOT,
                              env=env_for(1), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert prepared.returncode == 0, prepared.stdout[-3000:] + prepared.stderr[-3000:]
    p = subprocess.run([sys.executable, "-c", COUNTED, str(TRAIN), *map(str, args)], cwd=ROOT, env=env_for(1),
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    full = int(p.stdout.rsplit("full collections:", 1)[1])
    assert full <= 2, p.stdout[-2000:]
    print(f"full collections in a one-step rank: {full}")


def test_the_first_logged_step_counts_the_step_not_the_set_up_before_it(tmp_path):
    """DPO on tiny with all 237 pairs and a data cache of its own: the reference's log-probs are
    computed after the metrics are built and before the loop starts. The first record's step time
    counts the step only: the seconds since the metrics were built (elapsed_s) less the step time
    are at least the reference's. It used to count everything since the metrics were built (the
    reference, a resume's load): a DPO run's first tokens/s and MFU, over a large dataset, minutes
    off."""
    sets = {"data.train.files": str(PREFS), "data.train.kind": "preference", "train.objective": "dpo",
            "data.eval_fraction": 0, "train.max_steps": 2, "train.log_every": 1, "train.eval_every": 0,
            "train.eval_prompts": [], "checkpoint.save_final": False}  # fmt: skip
    r = train(tmp_path, sets, debug=False, cache=tmp_path / "cache")
    seconds = float(re.search(r"reference log-probs: computed for 237 pairs in ([\d.]+) s", r.output)[1])
    first = next(m for m in r.metrics if m.get("step") == 1 and "step_time_s" in m)
    assert seconds >= 0.1, r.output[-2000:]  # the check below means something
    assert first["elapsed_s"] - first["step_time_s"] >= seconds - 0.05, (first, seconds)
    print(f"first step {first['step_time_s']:.3f} s; before the loop, since the metrics: "
          f"{first['elapsed_s'] - first['step_time_s']:.2f} s (the reference {seconds} s)")  # fmt: skip
