"""train.objective reward (issue 74 item 1) on real launchers: a reward model with LoRA (its score head trained in
full beside the adapters) at ZeRO-3 on 2 ranks logs the losses of 1 rank (fp32, the pairs' margins and the centring
term in the loss), resumes its step-4 checkpoint bit for bit, and exports a model that loads as
AutoModelForSequenceClassification with one label and the tokenizer's pad token, and as GRPO's `function: model`
reward (trainer/rl/reward_model.py)."""

import json

import pytest
from helpers import NODROP, ROOT, split_losses, train

pytestmark = pytest.mark.dist

PREFS = ROOT / "data" / "tiny" / "python_prefs.jsonl"


@pytest.fixture(scope="module")
def prefs(tmp_path_factory):
    """The first 16 pairs, each with a margin (0, 0.5 or 1)."""
    path = tmp_path_factory.mktemp("prefs") / "prefs.jsonl"
    rows = [json.loads(x) for x in PREFS.read_text().splitlines()[:16]]
    path.write_text("".join(json.dumps({**r, "margin": 0.5 * (i % 3)}) + "\n" for i, r in enumerate(rows)))
    return path


def reward_sets(data, **kw):
    return {"data.train.files": str(data), "data.train.kind": "preference", "data.eval_fraction": 0,
            "data.num_workers": 0, "train.objective": "reward", "train.reward.center_rewards_coefficient": 0.01,
            "model.config.n_layer": 2, "model.lora": {"r": 4, "alpha": 8, "dropout": 0.0},
            "strategy.zero_stage": 3, "train.max_steps": 8, "train.log_every": 1, "train.eval_every": 0,
            "optim.lr": 3e-3, "optim.warmup_steps": 0, "checkpoint.every_steps": 4, "checkpoint.keep_last": 0,
            **NODROP, **kw}  # fmt: skip


def test_lora_at_zero3_on_2_ranks_trains_as_1_rank_resumes_and_exports_a_reward_model(tmp_path, prefs):
    runs = {}
    losses = split_losses(tmp_path, lambda split: reward_sets(prefs, **split), names=("micro4", "2ranks"),
                          check=lambda r: runs.setdefault(len(runs), r))  # fmt: skip
    two = runs[1]
    assert (
        "objective: reward (-log sigmoid(r_chosen - r_rejected - margin) + 0.01 x (r_c + r_r)^2" in two.output
    )
    assert "ZeRO stage 3" in two.output and len(set(losses["2ranks"].values())) == 8
    recs = [m for m in two.metrics if "reward_accuracy" in m]
    assert len(recs) == 8 and all(m["pairs"] == 4 for m in recs) and "logps_chosen" not in recs[0]
    ckpt = two.run_dir / "checkpoints" / "step_00000004"
    b = train(tmp_path / "resumed", reward_sets(prefs, **{"train.micro_batch_size": 2}), launcher="torchrun",
              nproc=2, extra_args=["--resume", str(ckpt)])  # fmt: skip
    assert {s: v for s, v in b.losses.items() if s > 4} == {s: v for s, v in two.losses.items() if s > 4}
    import subprocess
    import sys

    out = tmp_path / "export"
    final = two.run_dir / "checkpoints" / "step_00000008"
    subprocess.run([sys.executable, str(ROOT / "bin" / "export"), str(final), str(out)], check=True,
                   capture_output=True, cwd=ROOT)  # fmt: skip
    import torch
    from transformers import AutoModelForSequenceClassification

    from trainer.rl.reward_model import RewardModel

    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert model.config.num_labels == 1 and model.config.pad_token_id is not None
    rm = RewardModel(str(out), device="cpu", dtype=torch.float32)
    scores = rm(
        ["Name the section on compound.\n"] * 2, ["Compound statements", "With Statement Context Managers"]
    )
    assert all(abs(s) < 1e3 for s in scores) and scores[0] != scores[1]
