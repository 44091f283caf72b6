"""The benchmark harness's CPU mode (bench/bench.py compare): bin/train and the hand-written
DeepSpeed loop run the same model, data order and DeepSpeed JSON under the deepspeed launcher, so
their final weights are bitwise equal. Timings are reported, not asserted (see BENCHMARKS.md)."""

import json
import subprocess
import sys

import pytest
from helpers import ROOT, data_cache, env_for

pytestmark = pytest.mark.dist


def test_compare_runs_both_loops_and_their_weights_are_bitwise_equal(tmp_path):
    out = tmp_path / "compare.json"
    cmd = [sys.executable, str(ROOT / "bench" / "bench.py"), "compare", "--cpu", "--stages", "3", "--rounds", "1",
           "--steps", "6", "--warmup", "2", "--log-every", "2", "--set", "model.config.n_layer=2",
           "--cache-dir", str(data_cache()), "--json", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, env=env_for(2), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["device"] == "cpu" and res["nproc"] == 2
    (row,) = res["compare"]
    assert row["stage"] == 3 and row["bitwise_equal"], row
    assert row["ours_step_ms"] > 0 and row["raw_step_ms"] > 0 and row["ratio"] > 0
    assert "| 3 |" in p.stdout and "| yes |" in p.stdout
