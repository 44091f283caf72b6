"""Preference training through bin/train on 2 ranks (real launchers): DPO trains at ZeRO 0, 2 and 3,
fp32 and bf16, and resumes bit for bit; the reference's log-probs are computed once (a resume reads
them); LoRA DPO at stage 3 saves a whole, sound adapter; and a step's DPO loss does not depend on how
the global batch is split into ranks, micro batches and accumulation."""

import json

import pytest
from helpers import NODROP, ROOT, split_losses, train

pytestmark = pytest.mark.dist

PREFS = ROOT / "data" / "tiny" / "python_prefs.jsonl"
PAIRS = 16  # the first 16 pairs: 8 steps of 4 or 8 pairs see each several times, so the margins grow


@pytest.fixture(scope="module")
def prefs(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefs") / "prefs.jsonl"
    path.write_text("".join(PREFS.read_text().splitlines(keepends=True)[:PAIRS]))
    return path


def dpo_sets(data, **kw):
    return {
        "data.train.files": str(data),
        "data.train.kind": "preference",
        "data.eval_fraction": 0,
        "data.num_workers": 0,
        "train.objective": "dpo",
        "model.config.n_layer": 2,
        "train.micro_batch_size": 2,
        "train.max_steps": 8,
        "train.log_every": 1,
        "train.eval_every": 0,
        "optim.lr": 3e-3,
        "optim.warmup_steps": 0,
        "checkpoint.every_steps": 4,
        "checkpoint.save_final": True,
        "checkpoint.keep_last": 0,
        **NODROP,
        **kw,
    }


CASES = {  # name -> (stage, precision, more)
    "zero0-fp32": (0, "fp32", {"train.grad_accum": 2}),
    "zero2-fp32": (2, "fp32", {}),
    "zero3-fp32": (3, "fp32", {"train.grad_accum": 2}),
    "zero3-bf16-lora": (3, "bf16", {"model.lora": {"r": 4, "alpha": 8, "dropout": 0.0}, "optim.lr": 1e-2}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_dpo_trains_and_resumes_bit_for_bit(tmp_path, prefs, name):
    """Run A: 8 steps, checkpoints at 4 and 8; the reward accuracy and margin rise, the reference's
    log-probs are computed once, before the first step. Run B resumes A's step 4 in its own run
    directory: it reads them from the cache (not recomputed) and logs A's losses and rewards after
    step 4 bit for bit, ending with A's weights."""
    stage, precision, more = CASES[name]
    sets = dpo_sets(prefs, **{"strategy.zero_stage": stage, "train.precision": precision, **more})
    launcher, cache = "deepspeed" if stage != 2 else "torchrun", tmp_path / "cache"  # its own: computed here
    a = train(tmp_path / "a", sets, launcher=launcher, cache=cache)
    assert f"ZeRO stage {stage}" in a.output and "objective: dpo (beta 0.1)" in a.output
    assert a.output.count(f"reference log-probs: computed for {PAIRS} pairs") == 1, a.output[-3000:]
    recs = [m for m in a.metrics if "reward_margin" in m]
    assert [m["step"] for m in recs] == list(range(1, 9)) and all(
        m["pairs"] == 2 * 2 * more.get("train.grad_accum", 1) for m in recs
    )
    first = recs[0]  # the policy is the reference at the first step: no margin yet (fp32: 1e-5; bf16: 1e-2)
    tol = 1e-5 if precision == "fp32" else 1e-2
    assert abs(first["reward_margin"]) < tol and first["loss"] == pytest.approx(0.6931472, abs=tol), first
    late = recs[-3:]
    assert sum(m["reward_margin"] for m in late) > 0 and max(m["reward_accuracy"] for m in late) > 0.5, recs
    ckpt = tmp_path / "a" / "run" / "checkpoints" / "step_00000004"
    b = train(tmp_path / "b", sets, launcher=launcher, cache=cache, extra_args=["--resume", str(ckpt)])
    assert "reference log-probs: read from" in b.output and "reference log-probs: computed" not in b.output
    after = lambda r: {m["step"]: (m["loss"], m["reward_margin"], m["logps_chosen"]) for m in r.metrics  # noqa: E731
                       if "reward_margin" in m and m["step"] > 4}  # fmt: skip
    assert after(b) == after(a) and sorted(after(a)) == [5, 6, 7, 8]
    assert b.rank_reports()[0]["param_digest"] == a.rank_reports()[0]["param_digest"]
    if "lora" in name:  # the adapter: whole (gathered at ZeRO-3), every B trained away from zero
        from safetensors.torch import load_file

        final = tmp_path / "a" / "run" / "checkpoints" / "step_00000008"
        saved = load_file(str(final / "adapter" / "adapter_model.safetensors"))
        b_mats = {k: v for k, v in saved.items() if "lora_B" in k}
        assert b_mats and len(saved) == 2 * len(b_mats)  # an A for every B
        assert all(v.abs().sum() > 0 for v in b_mats.values())
        assert json.loads((final / "adapter" / "adapter_config.json").read_text())["r"] == 4


def test_the_dpo_loss_does_not_depend_on_how_the_batch_is_split(tmp_path, prefs):
    """4 pairs per step: micro 2 x 2 ranks (torchrun), micro 1 x accumulation 4 and micro 4
    x 1 rank log the same DPO losses at every step (fp32, 3e-6 relative: a micro batch of one row is cut
    narrower than one of four, so its matrix products round otherwise, ~3e-7 at step 1, grown to 1.5e-6 by step 5
    at this learning rate): a micro batch's loss is the mean of its pairs' and every micro batch holds as many, so
    DeepSpeed's mean over micro batches and ranks is the mean over the step's pairs."""
    more = {
        "train.max_steps": 5,
        "checkpoint.save_final": False,
        "checkpoint.every_steps": 0,
        "optim.lr": 1e-3,
    }
    ref = split_losses(tmp_path, lambda split: dpo_sets(prefs, **split, **more), rel=3e-6)["micro4"]
    assert sorted(ref) == list(range(1, 6)) and len(set(ref.values())) == 5  # every step its own loss


@pytest.mark.parametrize("disable", [True, False])
def test_dropout_is_off_in_preference_training_by_default(tmp_path, prefs, disable):
    """A model with dropout in its config (GPT-2's 0.1 on residuals, embeddings and attention): the
    reference's log-probs are computed without dropout, so by default (train.preference.disable_dropout,
    as TRL) the policy's first forward is the reference's and the first step's rewards are 0; with the
    model's dropout kept they differ from step 1, and the banner says so."""
    drop = {"model.config.resid_pdrop": 0.1, "model.config.embd_pdrop": 0.1, "model.config.attn_pdrop": 0.1}
    sets = {**dpo_sets(prefs, **{"train.max_steps": 1, "checkpoint.save_final": False}), **drop,
            "train.preference.disable_dropout": disable}  # fmt: skip
    r = train(tmp_path, sets, debug=False)
    first = next(m for m in r.metrics if m.get("step") == 1 and "rewards_chosen" in m)
    rewards = abs(first["rewards_chosen"]) + abs(first["rewards_rejected"])
    if disable:
        assert rewards < 1e-6 and "dropout off (train.preference.disable_dropout" in r.output, first
    else:
        assert rewards > 1e-4 and "the model's dropout kept" in r.output, first


def test_a_preference_evals_margin_accuracy_and_rewards_not_perplexity(tmp_path, prefs):
    """The eval of a DPO run logs the held-out pairs' margin, accuracy and rewards; no perplexity (the
    exponential of a DPO loss means nothing: `make tiny-dpo` printed `ppl 3.37`)."""
    sets = dpo_sets(prefs, **{"train.max_steps": 4, "train.eval_every": 2, "data.eval_fraction": 0.25,
                              "checkpoint.save_final": False})  # fmt: skip
    r = train(tmp_path, sets, debug=False)
    evals = [m for m in r.metrics if "eval_loss" in m]
    assert [m["step"] for m in evals] == [2, 4], evals
    for m in evals:
        assert "eval_ppl" not in m and 0 <= m["eval_reward_accuracy"] <= 1 and m["eval_pairs"] == 4, m
        assert m["eval_reward_margin"] == pytest.approx(m["eval_rewards_chosen"] - m["eval_rewards_rejected"])
    assert evals[-1]["eval_reward_margin"] != 0
    line = next(x for x in r.output.splitlines() if "eval  step      4" in x)
    assert "margin" in line and "acc" in line and "ppl" not in line, line
