"""train.objective reward's bad input (issue 74): a pair whose two responses are the same text, a margin that is not
a number, a margin on some pairs only: each stops the run with exit 2 naming the file's row, the key and the fix,
before a step; the config's contradictions (a score head without the objective, the objective with the language
model's head, a factory, Liger, micro_batch_size auto) are refused by --print-config."""

import json

import pytest
from helpers import ROOT, cli, refused_by_print_config

from trainer.run.cli import main

EXP = ROOT / "configs" / "experiments" / "tiny-reward.yaml"

BAD = {
    "head-without-reward": (["train.objective=dpo", "model.head=score"], ["model.head", "train.objective: reward"]),
    "reward-with-lm-head": (["model.head=causal_lm"], ["model.head", "remove model.head"]),
    "liger": (["model.kernels=liger"], ["model.kernels", "set none"]),
    "auto-micro": (["train.micro_batch_size=auto", "train.global_batch_size=16"], ["train.micro_batch_size"]),
    "reward-section-elsewhere": (["train.objective=dpo", "train.reward.center_rewards_coefficient=0.1"],
                                 ["train.reward", "is train.objective reward's"]),
    "negative-centring": (["train.reward.center_rewards_coefficient=-1"], ["center_rewards_coefficient"]),
    "infinite-centring": (["train.reward.center_rewards_coefficient=inf"], ["center_rewards_coefficient"]),
    "margin-field-for-dpo": (["train.objective=dpo", "train.reward.center_rewards_coefficient=null",
                              "data.train.margin_field=mm"], ["data.train.margin_field", "is train.objective reward's"]),
    "beta": (["train.preference.beta=0.5"], ["train.preference.beta", "reward has no beta"]),
    "label-smoothing": (["train.preference.label_smoothing=0.1"], ["train.preference.label_smoothing", "remove it"]),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_reward_key_exits_2_naming_the_file_the_key_and_the_fix(name, tmp_path, capsys):
    refused_by_print_config(EXP, *BAD[name], tmp_path, capsys)


def test_the_example_s_head_is_a_score_and_its_config_round_trips(tmp_path, capsys):
    assert main([str(EXP), "--print-config", "--set", f"run_dir={tmp_path / 'run'}"]) == 0
    out = capsys.readouterr().out
    assert "head: score" in out and "objective: reward" in out


def pairs_file(tmp_path, rows):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def bad_pairs_sets(tmp_path, rows, **more):
    data = pairs_file(tmp_path, rows)
    return {"train.objective": "reward", "data.train.files": str(data), "data.train.kind": "preference",
            "data.eval_fraction": 0, "train.eval_every": 0, "train.max_steps": 2, "train.micro_batch_size": 1,
            "data.cache_dir": str(tmp_path / "cache"), "run_dir": str(tmp_path / "run"), "checkpoint.every_steps": 0,
            **more}  # fmt: skip


def pair(i, chosen="yes", rejected="no", **more):
    return {"prompt": f"question {i}?", "chosen": f" {chosen}", "rejected": f" {rejected}", **more}


@pytest.mark.parametrize(
    "rows,needles",
    [
        ([pair(0), pair(1, "same", "same"), pair(2)], ["pairs.jsonl:2", "the same text", "fix or remove the pair"]),
        ([pair(0, margin=1), pair(1, margin="big"), pair(2, margin=0)], ["pairs.jsonl:2", "margin is 'big'",
                                                                          "give each pair's margin as a number"]),
        ([pair(0, margin=1), pair(1), pair(2, margin=0.5)], ["pairs.jsonl:2", "margin is None", "or remove the column"]),
    ],
    ids=["identical", "not-a-number", "some-rows-only"],
)  # fmt: skip
def test_bad_pairs_exit_2_before_a_step_naming_the_row_and_the_fix(tmp_path, rows, needles):
    code, out = cli(bad_pairs_sets(tmp_path, rows))
    assert code == 2 and "Traceback" not in out, out[-3000:]
    for needle in needles:
        assert needle in out, f"{needle!r} not in:\n{out[-3000:]}"
    assert "step      1/" not in out  # before a step


@pytest.mark.parametrize(
    "experiment,sets",
    [("tiny-reward", []), ("tiny-dpo", []), ("tiny-grpo", []),
     ("tiny-grpo", ["train.rl.advantage=rloo", "train.rl.loss_type=dapo", "train.rl.normalize_advantages=true"]),
     ("tiny-grpo", ["train.rl.multi_objective_aggregation=normalize_then_sum"])],
    ids=["reward", "dpo", "grpo", "rloo", "normalize-then-sum"],
)  # fmt: skip
def test_a_saved_experiment_validates_as_it_was_written(experiment, sets):
    """A checkpoint's experiment.yaml (to_yaml: every key, defaults included) validates again and gives the same
    experiment: a resume compares the two. The review's finding: rules that refused a key by its being written
    (train.reward for another objective, rloo's and GRPO's keys on the other side) refused every saved experiment,
    whose yaml writes them all, so --resume compared the raw files and stopped (data.packing: None against True)."""
    import yaml

    from trainer.config import load, validate

    exp = load(ROOT / "configs" / "experiments" / f"{experiment}.yaml", sets)
    again = validate(yaml.safe_load(exp.to_yaml()))
    assert again.to_dict() == exp.to_dict()


@pytest.mark.parametrize(
    "case",
    ["eval-not-a-number", "eval-identical", "margin-field-not-there", "prepare-data", "prepare-data-eval"],
)
def test_the_review_s_bad_pairs_exit_2_naming_the_file_the_key_and_the_fix(tmp_path, case):
    """The review's findings: a data.eval file's bad margins and identical pairs trained (its checks were dropped with
    its rows' statistics); --prepare-data said the data was built where the run then refused it after building the
    model (the checks now run where the data is built); a margin_field no row has trained without margins."""
    good = [pair(0, margin=1), pair(1, margin=0.5)]
    evals = {"eval-not-a-number": [pair(5, margin=0), pair(6, margin="x")], "eval-identical": [pair(5), pair(6, "a", "a")],
             "prepare-data-eval": [pair(5, margin=0), pair(6, margin="x")]}.get(case)  # fmt: skip
    more: dict = {}
    if evals is not None:
        path = tmp_path / "eval.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in evals))
        more = {"data.eval": {"files": str(path), "kind": "preference"}}
    rows = [pair(0), pair(1, "b", "b")] if case == "prepare-data" else [pair(0), pair(1)] if case.startswith(
        "margin-field") else good  # fmt: skip
    if case == "margin-field-not-there":
        more["data.train.margin_field"] = "nothere"
    extra = ["--prepare-data"] if case.startswith("prepare-data") else []
    code, out = cli(bad_pairs_sets(tmp_path, rows, **more), *extra)
    assert code == 2 and "Traceback" not in out, out[-3000:]
    needle = {"eval-not-a-number": "eval.jsonl:2: margin is 'x'", "eval-identical": "eval.jsonl:2: the chosen and",
              "margin-field-not-there": "data.train.margin_field: nothere: no row", "prepare-data": "pairs.jsonl:2",
              "prepare-data-eval": "eval.jsonl:2: margin is 'x'"}[case]  # fmt: skip
    assert needle in out, out[-3000:]
    assert "model:" not in out  # before the model is built


def test_a_large_margin_is_kept_as_given(tmp_path):
    """The review's finding: margins were stored in fp32, so 1e300 became inf and the run said the pair had none."""
    from trainer.config import DataSection
    from trainer.data import build

    path = pairs_file(tmp_path, [pair(0, margin=1e300), pair(1, margin=-2.5)])
    section = DataSection(train={"files": str(path), "kind": "preference"}, tokenizer="byte", seq_len=64,
                          eval_fraction=0, cache_dir=str(tmp_path / "cache"))  # fmt: skip
    d = build(section, seed=0)
    assert d.margins.tolist() == [1e300, -2.5] and d.finetune["margin_rows"] == 2


def test_a_classifier_of_two_labels_is_refused_as_a_reward_model_s_start(tmp_path):
    """The review's finding: a pretrained sequence classifier of 2 labels crashed in from_pretrained (exit 1, a
    traceback: its head's size against num_labels 1); TRL refuses it. Exit 2, naming the key and the fix."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    cfg = AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, n_positions=64, vocab_size=257, num_labels=2,
                               pad_token_id=256)  # fmt: skip
    AutoModelForSequenceClassification.from_config(cfg).save_pretrained(tmp_path / "cls2")
    sets = bad_pairs_sets(
        tmp_path, [pair(0), pair(1)], **{"model.config": None, "model.pretrained": str(tmp_path / "cls2")}
    )
    code, out = cli(sets)
    assert code == 2 and "Traceback" not in out, out[-3000:]
    assert "model.pretrained" in out and "classifier of 2 labels" in out and "give a causal LM" in out, out[
        -2000:
    ]
