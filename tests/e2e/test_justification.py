"""Pinning a stage above the rules' choice needs a justification; --plan is fast and GPU-free."""

import subprocess
import sys
import time

import pytest
from helpers import ROOT, TINY, TRAIN, bin_train, env_for, train

pytestmark = pytest.mark.e2e


def test_pinned_stage_3_without_justification_names_stage_0(tmp_path):
    p = bin_train(
        TINY,
        "--set",
        "strategy.zero_stage=3",
        "--set",
        "strategy.justification=",
        "--set",
        f"run_dir={tmp_path}",
    )
    assert p.returncode == 2, p.stderr
    assert "zero3 is pinned, but the cheaper zero0 fits" in p.stderr and "strategy.justification" in p.stderr
    assert "Traceback" not in p.stderr


def test_pinned_stage_3_with_justification_runs(tmp_path):
    r = train(
        tmp_path,
        {
            "strategy.zero_stage": 3,
            "strategy.justification": "profiling ZeRO-3 gathers",
            "train.max_steps": 2,
            "train.eval_every": 0,
            "model.config.n_layer": 1,
            "data.num_workers": 0,
            "checkpoint.save_final": False,
        },
        debug=False,
    )
    assert "ZeRO stage 3" in r.output and "justification: profiling ZeRO-3 gathers" in r.output


def imported(stderr: str) -> set[str]:
    """Top-level modules a `python -X importtime` run imported."""
    return {
        line.rsplit("|", 1)[1].strip().split(".")[0]
        for line in stderr.splitlines()
        if line.startswith("import time:")
    }


@pytest.mark.parametrize("experiment", ["tiny.yaml", "llama7b.yaml"])
def test_plan_prints_the_table_and_decision_without_heavy_imports(experiment, tmp_path):
    """--plan needs no GPU, no process group and no DeepSpeed; a model seen before (its shape is
    cached) is planned without importing torch or transformers, whose import alone takes seconds."""
    for attempt in ("cold", "warm"):
        t0 = time.perf_counter()
        p = subprocess.run(
            [
                sys.executable,
                "-X",
                "importtime",
                str(TRAIN),
                str(ROOT / "configs" / "experiments" / experiment),
                "--plan",
                "--world-size",
                "8",
                "--set",
                "strategy.device_memory=80GB",
                "--set",
                f"data.cache_dir={tmp_path}",
            ],
            cwd=ROOT,
            env=env_for(1),
            capture_output=True,
            text=True,
            timeout=300,
        )
        took = time.perf_counter() - t0
        assert p.returncode == 0, p.stderr[-3000:]
        for col in (
            "candidate",
            "params",
            "grads",
            "optimizer",
            "activations",
            "total/rank",
            "host/node",
            "fits",
        ):
            assert col in p.stdout
        assert "decision:" in p.stdout and "zero0" in p.stdout and "zero3+nvme" in p.stdout
        mods = imported(p.stderr)
        print(f"--plan {experiment} ({attempt} model-shape cache): {took:.2f} s")
        assert "deepspeed" not in mods
        if attempt == "warm":
            assert not mods & {"torch", "transformers", "deepspeed", "datasets"}, mods & {
                "torch",
                "transformers",
            }


def test_max_restarts_cannot_run_inside_a_launcher(tmp_path):
    p = bin_train(
        TINY,
        "--max-restarts",
        "1",
        env={"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "CROSS_RANK": "0"},
    )
    assert p.returncode == 2 and "cannot run under one" in p.stderr


def test_a_missing_hostfile_stops_before_anything_starts(tmp_path):
    p = bin_train(
        TINY,
        "--launcher",
        "deepspeed",
        "--hostfile",
        tmp_path / "hostfile",
        "--max-restarts",
        "1",
        "--set",
        f"run_dir={tmp_path / 'run'}",
    )
    assert p.returncode == 2 and "does not exist" in p.stderr and not (tmp_path / "run").exists()


def test_prepare_data_builds_the_cache_without_deepspeed_and_the_job_reads_it(tmp_path):
    """--prepare-data: the tokenized cache built ahead of the job, without a launcher, a process
    group or DeepSpeed; run again it is already there; a training job then reads it (no tokenizing)."""
    cache = tmp_path / "cache"
    cmd = [sys.executable, "-X", "importtime", str(TRAIN), str(TINY), "--prepare-data",
           "--set", f"data.cache_dir={cache}"]  # fmt: skip
    first = subprocess.run(cmd, cwd=ROOT, env=env_for(1), capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "data: 3,460 train / 183 eval sequences of 128 tokens (466,196 tokens) in" in first.stdout, (
        first.stdout
    )
    assert ", built in " in first.stdout
    assert "deepspeed" not in imported(first.stderr)
    again = subprocess.run(cmd, cwd=ROOT, env=env_for(1), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and ", already there;" in again.stdout, again.stdout
    job = train(tmp_path, {"train.max_steps": 1, "train.eval_every": 0, "checkpoint.save_final": False},
                cache=cache, debug=False)  # fmt: skip
    assert "data: tokenized and cached" not in job.output and "step      1/1" in job.output
