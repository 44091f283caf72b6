"""A reward model trained here serves as GRPO's reward (issue 74 item 1): tiny-reward's objective learns, from pairs
over tiny-grpo's prompts, to score an answer that starts with a number above one that starts with a word; exported,
it is tiny-grpo's only trained reward (`function: model`), and over 100 steps the policy's mean reward rises, and
with it the format reward that the pairs encoded and that the run logs without training on it (weight 0): the
ground truth the reward model stood in for."""

import json
import random
import subprocess
import sys

import pytest
from helpers import ROOT, train

pytestmark = pytest.mark.e2e


def pairs(path):
    """Each of tiny-grpo's prompts 4 times: chosen a number, rejected a word of random letters."""
    rnd = random.Random(0)
    rows = [json.loads(x) for x in (ROOT / "data" / "tiny" / "count_prompts.jsonl").read_text().splitlines()]
    with path.open("w") as f:
        for _ in range(4):
            for r in rows:
                word = "".join(rnd.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rnd.randint(2, 6)))
                f.write(
                    json.dumps(
                        {"prompt": r["prompt"], "chosen": f" {rnd.randint(1, 12)}", "rejected": f" {word}"}
                    )
                    + "\n"
                )
    return path


def test_a_reward_model_trained_here_raises_grpo_s_rewards_and_the_format_it_learned(tmp_path):
    rm = train(tmp_path / "rm", {"data.train.files": str(pairs(tmp_path / "pairs.jsonl")), "data.seq_len": 64,
                                 "model.config": {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2,
                                                  "n_positions": 64},
                                 "train.max_steps": 40, "train.eval_every": 0, "data.eval_fraction": 0, "train.log_every": 10,
                                 "checkpoint.every_steps": 0, "optim.lr": 3e-3},
               experiment=ROOT / "configs" / "experiments" / "tiny-reward.yaml", debug=False)  # fmt: skip
    logged = [m for m in rm.metrics if "reward_accuracy" in m]
    assert logged[-1]["reward_accuracy"] >= 0.95 and logged[-1]["reward_margin"] > 2, logged
    export = tmp_path / "rm-export"
    subprocess.run([sys.executable, str(ROOT / "bin" / "export"), str(rm.run_dir / "checkpoints" / "step_00000040"),
                    str(export)], check=True, capture_output=True, cwd=ROOT)  # fmt: skip
    rewards = [{"function": "model", "options": {"path": str(export)}},
               {"function": "format", "weight": 0.0, "options": {"pattern": r"^\s?\d"}}]  # fmt: skip
    g = train(tmp_path / "grpo", {"train.max_steps": 100, "train.log_every": 10, "checkpoint.every_steps": 0,
                                  "train.rl.rewards": rewards},
              experiment=ROOT / "configs" / "experiments" / "tiny-grpo.yaml", debug=False)  # fmt: skip
    recs = [m for m in g.metrics if "reward" in m]
    key = next(k for k in recs[0] if k.startswith("reward_model_") and not k.endswith("_std"))
    first, last = recs[0], recs[-1]
    print({m["step"]: (round(m[key], 3), round(m["reward_format"], 3)) for m in recs})
    assert last[key] > first[key] + 1.0, recs
    assert last["reward_format"] > first["reward_format"] + 0.2, recs
