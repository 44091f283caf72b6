"""The embedded default experiment, run as the README says: bin/train configs/experiments/tiny.yaml."""

import json
import subprocess
import sys

import pytest
from helpers import ROOT, TINY, TRAIN, env_for, train

pytestmark = pytest.mark.e2e


def test_tiny_trains_and_the_loss_falls(tmp_path):
    r = train(tmp_path, {}, launcher="none", debug=False)
    first = r.metrics[0]["loss"]
    evals = r.eval_losses
    assert sorted(evals) == [100, 200, 300]
    assert evals[300] <= 0.7 * first, (
        f"final eval loss {evals[300]:.3f} not 30% below the first logged {first:.3f}"
    )
    assert "ZeRO stage 0, offload none -- zero0 is the first rung that fits" in r.output
    assert "batch: micro 16 x world 1 x grad_accum 1 = 16 sequences = 2,048 tokens per step" in r.output
    line = [m for m in r.metrics if "loss" in m][-1]
    for key in (
        "step",
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "samples_per_s",
        "step_time_s",
        "data_wait_share",
    ):
        assert key in line, key
    assert line["tokens_per_s"] > 0 and 0 <= line["data_wait_share"] <= 1 and line["grad_norm"] > 0


def run_cli(*args):
    return subprocess.run(
        [sys.executable, str(TRAIN), *map(str, args)],
        cwd=ROOT,
        env=env_for(1),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_print_config_shows_the_resolved_experiment_and_deepspeed_json():
    p = run_cli(TINY, "--print-config", "--world-size", "4", "--set", "train.grad_accum=2")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "# experiment (resolved)" in out and "grad_accum: 2" in out
    ds_text = out[out.index("# DeepSpeed config") :]
    ds = json.loads(ds_text[ds_text.index("{") :])
    assert ds["train_batch_size"] == 16 * 4 * 2 and ds["gradient_accumulation_steps"] == 2


def test_describe_config_lists_every_key():
    p = run_cli("--describe-config")
    assert p.returncode == 0
    assert "train.micro_batch_size" in p.stdout and "strategy.zero_stage" in p.stdout


def test_local_rank_argument_is_accepted():
    p = run_cli(TINY, "--local_rank=0", "--print-config")
    assert p.returncode == 0, p.stderr
