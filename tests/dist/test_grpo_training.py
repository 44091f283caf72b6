"""GRPO on real launchers (issue 56 item 4): a step's gradient does not depend on how it is split (1 rank x
accumulation 4 = 2 ranks x 2 = 4 ranks x 1, gloo) nor on the ZeRO stage (0, 2, 3 on 2 ranks: ZeRO-3 gathers the
weights for generation, the ranks in step), for dapo and grpo; a resumed run generates the same completions and
logs the same rewards and losses as the uninterrupted one, bit for bit, at ZeRO 0 and 3. (torchrun throughout:
the deepspeed launcher's start costs twice torchrun's, and the launchers have their own tests.)

The job: configs/experiments/tiny-grpo.yaml's model and prompts (1 layer), 4 completions a prompt, 4 new
tokens; the first step's gradients (every parameter's, reduced and gathered: TRAINER_DEBUG_GRADS) compared."""

import pytest
import torch
from helpers import ROOT, train

pytestmark = pytest.mark.dist

EXP = ROOT / "configs" / "experiments" / "tiny-grpo.yaml"
# seed 8: a first step whose groups' rewards differ (a step of equal rewards has no gradient to compare)
BASE = {"seed": 8, "model.config.n_layer": 1, "train.rl.num_generations": 4, "train.rl.max_new_tokens": 4, "train.max_steps": 1,
        "train.log_every": 1, "checkpoint.every_steps": 0, "checkpoint.save_final": False, "data.num_workers": 0}  # fmt: skip
# name -> (ranks, launcher, micro, accum): 16 completions a step (4 prompts) however split
SPLITS = {"1x4": (1, "none", 4, 4), "2x2": (2, "torchrun", 4, 2), "4x1": (4, "torchrun", 4, 1)}


def grads(r):
    return torch.load(r.debug_dir / "grads_step1.pt")


def assert_close(a, b, rel=1e-5):
    assert a.keys() == b.keys()
    for k in a:
        scale = max(float(a[k].abs().max()), 1e-12)
        assert float((a[k] - b[k]).abs().max()) <= rel * scale + 1e-9, (
            k,
            float((a[k] - b[k]).abs().max()),
            scale,
        )


def rewards(r):
    return [m["reward"] for m in r.metrics if "reward" in m]


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_a_step_s_gradient_does_not_depend_on_its_split(tmp_path, loss_type):
    out = {}
    for name, (n, launcher, micro, accum) in SPLITS.items():
        sets = {
            **BASE,
            "train.rl.loss_type": loss_type,
            "train.micro_batch_size": micro,
            "train.grad_accum": accum,
        }
        out[name] = train(tmp_path / name, sets, launcher=launcher, nproc=n, experiment=EXP,
                          env={"TRAINER_DEBUG_GRADS": "1"})  # fmt: skip
    ref = grads(out["1x4"])
    assert any(float(g.abs().max()) > 0 for g in ref.values()), (
        "no gradient: every group's rewards were equal"
    )
    for name in ("2x2", "4x1"):
        assert rewards(out[name]) == pytest.approx(rewards(out["1x4"]), rel=1e-12)  # the same completions
        assert_close(grads(out[name]), ref)


def test_rloo_s_step_with_the_kl_in_its_reward_does_not_depend_on_its_split(tmp_path):
    """advantage: rloo (issue 74): the leave-one-out baseline over every rank's rewards, less beta x each
    completion's log-ratio to the reference (LoRA's adapters off), gathered as the rewards are: step 2's gradient
    (the adapters have moved: a KL to pay) is the same on 1 rank x 4 and 2 ranks x 2."""
    exp = tmp_path / "tiny-rloo.yaml"  # tiny-grpo's without its loss_type (GRPO's key: refused with rloo)
    exp.write_text(EXP.read_text().replace("    loss_type: dapo\n", ""))
    out = {}
    for name in ("1x4", "2x2"):
        n, launcher, micro, accum = SPLITS[name]
        sets = {**BASE, "train.rl.advantage": "rloo", "train.rl.beta": 0.05, "train.max_steps": 2, "optim.lr": 1e-2,
                "optim.warmup_steps": 0, "model.lora": {"r": 4, "alpha": 8, "dropout": 0.0},
                "train.micro_batch_size": micro, "train.grad_accum": accum}  # fmt: skip
        out[name] = train(tmp_path / name, sets, launcher=launcher, nproc=n, experiment=exp,
                          env={"TRAINER_DEBUG_GRADS": "2"})  # fmt: skip
    kl = [m["kl"] for m in out["1x4"].metrics if "kl" in m]
    assert len(kl) == 2 and kl[0] == 0 and kl[1] != 0, kl  # the adapters start at zero: the KL from step 2
    assert "rloo (4 completions a prompt" in out["1x4"].output
    a, b = (torch.load(out[k].debug_dir / "grads_step2.pt") for k in ("1x4", "2x2"))
    assert any(float(g.abs().max()) > 0 for g in a.values())
    assert rewards(out["2x2"]) == pytest.approx(rewards(out["1x4"]), rel=1e-12)
    assert_close(b, a)


def pretrained(tmp_path):
    """tiny-grpo's model saved once: the same weights at every stage (ZeRO-3's own initialisation draws others)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = tmp_path / "base"
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("gpt2", n_layer=1, n_embd=64, n_head=4, n_positions=128, vocab_size=257, resid_pdrop=0,
                               embd_pdrop=0, attn_pdrop=0, bos_token_id=256, eos_token_id=256)  # fmt: skip
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return {"model.config": None, "model.pretrained": str(out)}


def test_the_zero_stages_agree(tmp_path):
    out = {}
    base = pretrained(tmp_path)
    for stage in (0, 2, 3):
        sets = {**BASE, **base, "train.micro_batch_size": 4, "train.grad_accum": 2, "strategy.zero_stage": stage,
                "strategy.justification": "test"}  # fmt: skip
        out[stage] = train(tmp_path / f"z{stage}", sets, launcher="torchrun", nproc=2, experiment=EXP,
                           env={"TRAINER_DEBUG_GRADS": "1"})  # fmt: skip
        assert f"ZeRO stage {stage}" in out[stage].output
    for stage in (2, 3):
        assert rewards(out[stage]) == pytest.approx(rewards(out[0]), rel=1e-12)
        assert_close(grads(out[stage]), grads(out[0]))


@pytest.mark.parametrize("stage,ranks", [(0, 1), (3, 2)])
def test_a_resumed_run_generates_and_trains_as_the_uninterrupted_one(tmp_path, stage, ranks):
    sets = {**BASE, **pretrained(tmp_path), "train.micro_batch_size": 4, "train.grad_accum": 2, "train.max_steps": 6,
            "checkpoint.every_steps": 3,
            "checkpoint.keep_last": 0, "strategy.zero_stage": stage, "strategy.justification": "test",
            "optim.lr": 3e-2}  # fmt: skip
    launcher = "none" if ranks == 1 else "torchrun"
    a = train(tmp_path / "a", sets, launcher=launcher, nproc=ranks, experiment=EXP)
    ckpt = a.run_dir / "checkpoints" / "step_00000003"
    b = train(
        tmp_path / "b",
        sets,
        launcher=launcher,
        nproc=ranks,
        experiment=EXP,
        extra_args=["--resume", str(ckpt)],
    )
    assert f"resumed from {ckpt} at step 3" in b.output
    after = lambda r: {m["step"]: (m["loss"], m["reward"], m["completion_length"]) for m in r.metrics  # noqa: E731
                       if m.get("step", 0) > 3 and "reward" in m}  # fmt: skip
    assert after(b) == after(a) and len(after(a)) == 3  # bit for bit
    assert b.rank_reports()[0]["param_digest"] == a.rank_reports()[0]["param_digest"]


def test_no_reference_is_held_at_beta_0_nor_with_lora_s_adapters_off(tmp_path):
    """beta 0 builds no reference, and beta > 0 with LoRA takes the model with its adapters off: the weights,
    gradients and optimizer states the engine holds (the census, after the first optimizer step) are the plan's within
    10%, and the same with and without the KL term (a reference copy would add the base's weights again)."""
    from helpers import check_memory

    base = pretrained(tmp_path)
    census = {}
    for beta in (0.0, 0.04):
        sets = {**BASE, **base, "model.lora": {"r": 4, "alpha": 8, "dropout": 0.0}, "train.rl.beta": beta,
                "train.micro_batch_size": 4, "train.grad_accum": 2, "train.max_steps": 2}  # fmt: skip
        r = train(tmp_path / f"beta{beta}", sets, experiment=EXP)
        check_memory(r, f"grpo beta {beta}")
        census[beta] = r.rank_reports()[0]["memory"]
        if beta:
            assert any("kl" in m for m in r.metrics), "the KL term was not computed"
    assert census[0.0]["params"] == census[0.04]["params"], census
