"""A TRL user's GRPO experiment trains here (issue 60): configs/experiments/tiny-grpo-trl.yaml (chat prompts,
trl.rewards' think_format_reward and the get_soft_overlong_punishment factory by path, the answer built-in)
with two of the user's own reward functions, one in a module beside the experiment file (numpy values and
log_metric) and one in the working directory (async, returning bools), at num_iterations 2 and with
log_completions: it trains; the rewards' metrics are logged on the steps that generated and only there; the
completions log holds chat prompts, completions and each function's value; bin/report shows the last ones.
One bin/train run of 4 steps of the tiny model."""

import json
import subprocess
import sys

import pytest
from helpers import ROOT, TRAIN, data_cache, env_for

pytestmark = pytest.mark.e2e
pytest.importorskip("trl")

EXP = ROOT / "configs" / "experiments" / "tiny-grpo-trl.yaml"
BESIDE = """import numpy as np


def numpy_length(completions, completion_ids, log_metric, **kwargs):
    log_metric("mean_ids", float(np.mean([len(i) for i in completion_ids])))
    return [np.float32(len(c[0]["content"]) / 100) for c in completions]
"""
CWD = """import asyncio


async def async_think(completions, trainer_state, **kwargs):
    await asyncio.sleep(0.01)
    assert trainer_state.max_steps == 4 and trainer_state.global_step in (0, 2)
    return [("<think>" in c[0]["content"]) for c in completions]
"""


def test_a_trl_experiment_with_the_user_s_rewards_trains_and_logs_what_it_generated(tmp_path):
    beside, cwd = tmp_path / "experiment", tmp_path / "work"
    beside.mkdir()
    cwd.mkdir()
    text = EXP.read_text().replace("files: data/tiny/", f"files: {ROOT}/data/tiny/")
    text = text.replace("        options: {column: answer}\n", "        options: {column: answer}\n"
                        "      - function: beside_yaml:numpy_length\n        weight: 0.1\n"
                        "      - function: in_cwd:async_think\n        weight: 0.5\n")  # fmt: skip
    (beside / "exp.yaml").write_text(text)
    (beside / "beside_yaml.py").write_text(BESIDE)
    (cwd / "in_cwd.py").write_text(CWD)
    run = tmp_path / "run"
    sets = {"run_dir": run, "data.cache_dir": data_cache(), "train.max_steps": 4, "train.log_every": 1,
            "checkpoint.every_steps": 0, "checkpoint.save_final": "false", "train.rl.num_iterations": 2,
            "train.rl.log_completions": 2, "data.num_workers": 0}  # fmt: skip
    args = [sys.executable, str(TRAIN), str(beside / "exp.yaml")]
    for k, v in sets.items():
        args += ["--set", f"{k}={v}"]
    p = subprocess.run(args, cwd=cwd, env=env_for(1), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records if "loss" in r}
    assert sorted(steps) == [1, 2, 3, 4]
    names = ("reward_think_format_reward", "reward_get_soft_overlong_punishment", "reward_answer",
             "reward_numpy_length", "reward_async_think", "reward", "reward_std", "mean_ids", "completion_length")  # fmt: skip
    for s in (1, 3):  # generated
        assert all(k in steps[s] for k in names), sorted(steps[s])
        assert steps[s]["reward_get_soft_overlong_punishment"] <= 0 and 0 < steps[s]["mean_ids"] <= 16
    for s in (2, 4):  # the same generation trained again: nothing generated, nothing of it logged
        assert not any(k in steps[s] for k in names), sorted(steps[s])
        assert "clip_region" in steps[s] and "entropy" in steps[s]  # the loss's own metrics: every step
    rows = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 1, 3, 3]
    assert rows[0]["prompt"][0]["role"] == "user" and isinstance(rows[0]["completion"], str)
    assert set(rows[0]["rewards"]) == {n.removeprefix("reward_") for n in names[:5]}
    report = subprocess.run([sys.executable, str(ROOT / "bin" / "report"), str(run)], cwd=ROOT, env=env_for(1),
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert report.returncode == 0, report.stderr
    assert "completions at step 3" in report.stdout and "How many letters" in report.stdout, report.stdout
