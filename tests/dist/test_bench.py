"""The benchmark harness's CPU mode (bench/bench.py compare, peer, preference): compare's bin/train
and hand-written DeepSpeed loop run the same model, data order and DeepSpeed JSON under the
deepspeed launcher, so their final weights are bitwise equal; peer and preference run both their
sides. Timings are reported, not asserted (see BENCHMARKS.md)."""

import json
import subprocess
import sys

import pytest
from helpers import ROOT, data_cache, env_for

pytestmark = pytest.mark.dist


def run_bench(tmp_path, what, nproc, *args):
    """bench/bench.py WHAT in its CPU mode on a 2-layer tiny, one round of 6 steps on NPROC ranks:
    (the finished process, the results it wrote with --json)."""
    out = tmp_path / f"{what}.json"
    cmd = [sys.executable, str(ROOT / "bench" / "bench.py"), what, "--cpu", "--nproc", str(nproc), *args,
           "--rounds", "1", "--steps", "6", "--warmup", "2", "--log-every", "2", "--set", "model.config.n_layer=2",
           "--cache-dir", str(data_cache()), "--json", str(out)]  # fmt: skip
    p = subprocess.run(cmd, cwd=ROOT, env=env_for(nproc), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p, json.loads(out.read_text())


def test_compare_runs_both_loops_and_their_weights_are_bitwise_equal(tmp_path):
    p, res = run_bench(tmp_path, "compare", 2, "--stages", "3")
    assert res["device"] == "cpu" and res["nproc"] == 2
    (row,) = res["compare"]
    assert row["stage"] == 3 and row["bitwise_equal"], row
    assert row["ours_step_ms"] > 0 and row["raw_step_ms"] > 0 and row["ratio"] > 0
    assert "| 3 |" in p.stdout and "| yes |" in p.stdout


def test_peer_runs_bin_train_and_the_hf_trainer_on_the_same_job(tmp_path):
    """bench/bench.py peer's CPU mode on the smallest shape, a few steps, one rank a side (the 2-rank
    launch path is the compare test's): both sides train (their first logged losses agree: the same
    model, data and optimizer) and the table is printed."""
    p, res = run_bench(tmp_path, "peer", 1, "--stages", "0", "--shapes", "tiny")
    (row,) = res["peer"]
    assert (row["shape"], row["stage"], res["peer_config"]) == ("tiny", 0, "minimal")
    assert row["ours_step_ms"] > 0 and row["hf_step_ms"] > 0 and row["ratio"] > 0
    ours, hf = row["losses"]["ours"], row["losses"]["hf"]
    assert len(ours) == len(hf) == 3, row["losses"]
    assert abs(ours[0] - hf[0]) < 0.1 and ours[-1] < ours[0] and hf[-1] < hf[0], row["losses"]
    assert row["paired"] == pytest.approx(row["ratio"]) and row["ours_faster"] == (row["ratio"] >= 1), row
    assert "| tiny | 0 |" in p.stdout and "of 1) |" in p.stdout


def test_preference_times_a_dpo_step_against_an_sft_step_on_the_same_pairs(tmp_path):
    """bench/bench.py preference on one rank: SFT on a chat file made from the pairs (prompt and chosen
    response) and DPO on the pairs both train, and a DPO step feeds about twice the tokens (each
    pair's prompt twice, beside both its responses); the step-time ratio is reported, not asserted."""
    p, res = run_bench(tmp_path, "preference", 1, "--micro", "8")
    r = res["preference"]
    assert len(r["sft"]) == len(r["dpo"]) == 1 and r["ratio"]["ratio"] > 0, r
    assert 1.5 < r["tokens_ratio"] < 3, r
    assert "# preference: tiny.yaml, micro 8, 1 rank(s), ZeRO stage 0, offload none" in p.stdout, p.stdout[-2000:]
    assert r["plan"]["sft"] == r["plan"]["dpo"], r
