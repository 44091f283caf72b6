"""GRPO's bad input through the real CLI (issue 56 item 7): exit 2, no traceback, the key or the function
named with the fix; a reward function that returns strings stops the run at its first generation naming
the function and the rows, never a silent zero. And --preview-data of prompt data: the prompts as generation
starts from them, with the columns the rewards get (it described them as packed text)."""

import json
import re

import pytest
from helpers import ROOT, bin_train, data_cache

pytestmark = pytest.mark.e2e

EXP = ROOT / "configs" / "experiments" / "tiny-grpo.yaml"


def run(tmp_path, *sets, experiment=EXP, env=None):
    args = [experiment, "--set", f"run_dir={tmp_path / 'run'}", "--set", f"data.cache_dir={data_cache()}"]
    for s in ("model.config.n_layer=1", "train.max_steps=1", "checkpoint.save_final=false", *sets):
        args += ["--set", s]
    p = bin_train(*args, env=env)
    out = p.stdout + p.stderr
    assert p.returncode == 2, f"exit {p.returncode}\n{out}"
    assert "Traceback" not in out, out
    return out


def rewards(tmp_path, function):
    """tiny-grpo with its format reward replaced by `function`."""
    text = EXP.read_text().replace("- function: format", f"- function: {function}")
    p = tmp_path / "exp.yaml"
    p.write_text(
        text.replace("files: data/tiny/count_prompts.jsonl", f"files: {ROOT}/data/tiny/count_prompts.jsonl")
    )
    return p


CONFIG = {
    "unknown loss type": (["train.rl.loss_type=ppo"], ["train.rl.loss_type", "dapo", "dr_grpo"]),
    "one completion a prompt": (["train.rl.num_generations=1"], ["train.rl.num_generations", "greater than or equal to 2"]),
    "groups split across micro steps": (["train.rl.num_generations=5"],
                                        ["train.rl.num_generations", "whole groups of 5", "make them a multiple"]),
    "sequence parallelism": (["strategy.sequence_parallel=2"], ["strategy.sequence_parallel", "not supported"]),
    "a KL penalty without LoRA": (["train.rl.beta=0.04"], ["train.rl.beta", "use LoRA"]),
    "an eval split": (["data.eval_fraction=0.1"], ["data.eval", "remove data.eval"]),
    "text data": (["data.train.kind=text"], ["data.train.kind", "give data of kind prompt"]),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CONFIG))
def test_a_bad_setting_is_refused_naming_the_key_and_the_fix(tmp_path, name):
    sets, needles = CONFIG[name]
    out = run(tmp_path, *sets)
    for needle in needles:
        assert needle in out, f"{needle!r} not in:\n{out}"


def test_a_reward_that_does_not_import_is_refused_before_training(tmp_path):
    out = run(tmp_path, experiment=rewards(tmp_path, "no_such_package.rewards:score"))
    assert "train.rl.rewards[0]: cannot import 'no_such_package.rewards'" in out, out
    assert "step " not in out  # nothing trained


def test_a_reward_module_that_raises_at_import_is_refused_before_training(tmp_path):
    """The finding: a module raising at import (an API key missing) gave exit 1 and a traceback."""
    (tmp_path / "judge_rewards.py").write_text("raise RuntimeError('needs OPENAI_API_KEY')\n")
    out = run(
        tmp_path, experiment=rewards(tmp_path, "judge_rewards:score"), env={"PYTHONPATH": str(tmp_path)}
    )
    assert (
        "train.rl.rewards[0]: importing 'judge_rewards' raised RuntimeError: needs OPENAI_API_KEY" in out
    ), out
    assert "step " not in out


def test_a_reward_returning_strings_stops_the_run_naming_it_and_the_rows(tmp_path):
    (tmp_path / "my_rewards.py").write_text("def score(prompts, completions, **columns):\n"
                                            "    return ['good' for _ in completions]\n")  # fmt: skip
    out = run(tmp_path, experiment=rewards(tmp_path, "my_rewards:score"), env={"PYTHONPATH": str(tmp_path)})
    assert "train.rl.rewards: my_rewards:score returned 'good' (a str) for completion 0" in out, out
    assert "it must return a finite number or None" in out


def test_a_template_without_a_generation_prompt_is_refused(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"How many letters are in '{w}'?"}], "answer": str(len(w))}
            for w in ("string", "list", "tuple", "dict")]  # fmt: skip
    data = tmp_path / "chat_prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    template = tmp_path / "no_prompt.jinja"
    template.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}")
    out = run(tmp_path, f"data.train.files={data}", f"data.chat_template={template}")
    assert "the chat template has no generation prompt" in out and "data.chat_template" in out, out


def test_preview_data_shows_the_prompts_and_the_columns_the_rewards_get(tmp_path):
    p = bin_train(EXP, "--preview-data", "1", "--set", f"run_dir={tmp_path / 'run'}",
                  "--set", f"data.cache_dir={data_cache()}")  # fmt: skip
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert "72 prompts" in out and "leaving" in out and "packed" not in out, out
    assert re.search(r"prompt 1 \(row \d+; \d+ tokens\): \"How many letters are in '\w+'\? Answer:\"", out), (
        out
    )
    assert re.search(r'columns for the rewards: \{"answer": "\d+"\}', out), out
