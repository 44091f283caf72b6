"""train.rl's keys of issue 60, given wrong (bin/train in this process, --print-config: nothing trains): each
exits 2 with one message naming the experiment file, the key and the fix, no traceback; and the warnings TRL
gives for legal but unlikely combinations are given at start."""

import pytest
from helpers import ROOT

EXP = ROOT / "configs" / "experiments" / "tiny-grpo.yaml"


def model(options):
    """train.rl.rewards with one reward model of these options, as --set writes it."""
    import json

    return "train.rl.rewards=" + json.dumps([{"function": "model", "options": options}])


BAD = {
    "KL correction not a bool": (["train.rl.use_bias_correction_kl=maybe"], ["train.rl.use_bias_correction_kl", "bool"]),
    "unknown importance level": (["train.rl.importance_sampling_level=seq"], ["train.rl.importance_sampling_level", "token", "sequence"]),
    "unknown aggregation": (["train.rl.multi_objective_aggregation=mean"], ["train.rl.multi_objective_aggregation", "normalize_then_sum"]),
    "unknown loss type": (["train.rl.loss_type=ppo"], ["train.rl.loss_type", "cispo", "vespo"]),
    "entropy quantile above 1": (["train.rl.top_entropy_quantile=1.5"], ["train.rl.top_entropy_quantile", "less than or equal to 1"]),
    "entropy quantile not a number": (["train.rl.top_entropy_quantile=top"], ["train.rl.top_entropy_quantile", "number"]),
    "sapo temperature 0": (["train.rl.sapo_temperature_neg=0"], ["train.rl.sapo_temperature_neg", "greater than 0"]),
    "vespo lambda negative": (["train.rl.vespo_lambda_pos=-1"], ["train.rl.vespo_lambda_pos", "greater than 0"]),
    "vespo k negative": (["train.rl.vespo_k_neg=-1"], ["train.rl.vespo_k_neg", "greater than or equal to 0"]),
    "min_p above 1": (["train.rl.min_p=2"], ["train.rl.min_p", "less than or equal to 1"]),
    "repetition penalty": (["train.rl.repetition_penalty=1.1"], ["train.rl.repetition_penalty", "remove it (1.0)"]),
    "unknown generation cache": (["train.rl.generation_cache=paged"], ["train.rl.generation_cache", "dynamic", "static"]),
    "static cache at ZeRO-3": (["train.rl.generation_cache=static", "strategy.zero_stage=3"],
                               ["train.rl.generation_cache", "zero_stage 0-2"]),
    # the review's: a template pinning stage 3 reached the planner ("the pinned zero3 is predicted not to fit")
    "static cache at a stage 3 template": (["train.rl.generation_cache=static", "strategy.deepspeed=configs/deepspeed/zero3.json"],
                                           ["train.rl.generation_cache", "strategy.deepspeed", "stage 0-2 template"]),
    "log_completions negative": (["train.rl.log_completions=-1"], ["train.rl.log_completions", "greater than or equal to 0"]),
    "log_completions not a number": (["train.rl.log_completions=all"], ["train.rl.log_completions", "integer"]),
    "scale_rewards with normalize_then_sum": (["train.rl.multi_objective_aggregation=normalize_then_sum",
                                               "train.rl.scale_rewards=none"], ["train.rl.scale_rewards", "remove scale_rewards"]),
    # a second review of distill found it: a mixture of prompt sources stopped with a traceback in the data cache
    "a mixture of prompt sources": (['data.train=[{"files": "data/tiny/count_prompts.jsonl", "kind": "prompt"}, '
                                     '{"files": "data/tiny/count_chat_prompts.jsonl", "kind": "prompt", "weight": 0.5}]'],
                                    ["data.train", "a mixture of prompt sources is not built for grpo"]),
    "a reward model without a path": ([model({})], ["train.rl.rewards[0].options.path", "sequence-classification"]),
    "a reward model with an empty path": ([model({"path": ""})], ["train.rl.rewards[0].options.path"]),
    "a reward model's batch size 0": ([model({"path": "m", "batch_size": 0})],
                                      ["train.rl.rewards[0].options.batch_size", ">= 1"]),
    "a reward model's unknown option": ([model({"path": "m", "pooling": "mean"})],
                                        ["train.rl.rewards[0].options", "not pooling"]),
    # the review's: a weight of NaN was accepted (every combined reward NaN: no advantage, no learning)
    "a reward weight NaN": (['train.rl.rewards=[{"function": "format", "weight": .nan, "options": {"pattern": "x"}}]'],
                            ["train.rl.rewards[0].weight", "nan", "a finite number"]),
    "a reward weight infinite": (['train.rl.rewards=[{"function": "answer"}, {"function": "format", "weight": -.inf, '
                                  '"options": {"pattern": "x"}}]'], ["train.rl.rewards[1].weight", "-inf", "a finite number"]),
}  # fmt: skip


def run(sets, tmp_path, capsys):
    from trainer.run.cli import main

    args = [str(EXP), "--print-config", "--set", f"run_dir={tmp_path / 'run'}"]
    for s in sets:
        args += ["--set", s]
    capsys.readouterr()
    code = main(args)
    got = capsys.readouterr()
    return code, got.out + got.err


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_rl_key_exits_2_naming_the_file_the_key_and_the_fix(name, tmp_path, capsys):
    sets, needles = BAD[name]
    code, out = run(sets, tmp_path, capsys)
    assert code == 2, out
    assert "Traceback" not in out and "tiny-grpo.yaml" in out, out
    for needle in needles:
        assert needle in out, f"{needle!r} not in:\n{out}"


@pytest.mark.parametrize(
    "sets,needle",
    [(["train.rl.loss_type=cispo"], "cispo caps the ratio at epsilon_high, unset"),
     (["train.rl.loss_type=luspo"], "luspo is a sequence-level loss"),
     (["train.rl.loss_type=dapo", "train.rl.importance_sampling_level=sequence"], "GSPO's setup is loss_type: grpo")],
)  # fmt: skip
def test_trl_s_warnings_are_given(sets, needle):
    from trainer import config

    exp = config.load(EXP, sets)
    assert any(needle in w for w in config.warnings(exp)), config.warnings(exp)


@pytest.mark.parametrize("stop", [True, False])
def test_the_end_of_turn_stops_a_completion_unless_trls_behaviour_is_asked_for(stop, tmp_path):
    """Issue 74 item 2: where a chat template's end-of-turn token is no EOS id (Qwen3's tokenizer with a base
    model's EOS <|endoftext|>: turns end in <|im_end|>), TRL generates past it; ours stops there, a difference
    said in docs/rl.md, and train.rl.stop_at_end_of_turn: false gives TRL's."""
    from distill_helpers import gpt2_of, qwen3_base_tokenizer
    from helpers import train

    tok_dir, tok = qwen3_base_tokenizer(tmp_path)
    r = train(tmp_path, {"model.pretrained": str(gpt2_of(tok, tmp_path / "m")), "model.config": None,
                         "data.tokenizer": str(tok_dir), "data.train.files": "data/tiny/count_chat_prompts.jsonl",
                         "data.seq_len": 160, "train.rl.stop_at_end_of_turn": stop},
              experiment=EXP, extra_args=["--dry-run"], debug=False)  # fmt: skip
    stops = "stopping at '<|endoftext|>', '<|im_end|>';" if stop else "stopping at '<|endoftext|>';"
    assert stops in r.output, r.output[-3000:]
