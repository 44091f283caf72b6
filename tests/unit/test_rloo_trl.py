"""RLOO (train.rl.advantage: rloo; issue 74 item 3) against TRL 1.16's RLOOTrainer, its code called
(tests/trl_ref.py), never copied: the advantages (the leave-one-out baseline over a group's scorable completions,
beta x the completion's summed log-ratio to the reference in the reward, reward_clip_range, normalize_advantages,
None rewards, masked truncated completions) and the reward metrics equal `_generate_and_score_completions`'s;
the loss and its gradient equal `_compute_loss`'s (a clipped ratio of the whole completion's log-probability,
averaged over completions), at one iteration and with old log-probs; the step's loss does not depend on its split;
RLOO's keys and GRPO's are refused on the other side. fp64 but TRL's rewards (fp32 there)."""

import pytest
import torch

trl = pytest.importorskip("trl")
import trl_ref  # noqa: E402

from trainer.config.rl_schema import RLSection, rl_problems  # noqa: E402
from trainer.objectives import grpo  # noqa: E402
from trainer.objectives.grpo_loss import loo_advantages  # noqa: E402

G, N, T = 4, 12, 5


def generation(seed=3):
    g = torch.Generator().manual_seed(seed)
    per_function = torch.randn(N, 2, generator=g).to(torch.float32).to(torch.float64)
    per_function[1, 0] = float("nan")  # a function returned None for it
    per_function[5] = float("nan")  # every function did: unscorable, advantage 0
    per_function[9:, :] = float("nan")  # a group of one scorable completion: its baseline 0/0, advantage 0
    lengths = [5, 3, 5, 2, 4, 5, 1, 5, 3, 5, 2, 4]
    ended = [i % 3 != 0 for i in range(N)]  # every third hit max_new_tokens (no EOS)
    ids = [[7] * (n - 1) + [1 if e else 7] for n, e in zip(lengths, ended, strict=True)]
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths], dtype=torch.float64)
    old = torch.randn(N, T, generator=g, dtype=torch.float64).clamp(max=0) * mask - 1.0
    ref = old + 0.3 * torch.randn(N, T, generator=g, dtype=torch.float64)
    return per_function, ids, mask, old, ref, torch.tensor(ended)


@pytest.mark.parametrize(
    "rl",
    [{}, {"beta": 0.0}, {"beta": 0.05, "normalize_advantages": True}, {"reward_clip_range": (-0.5, 0.4)},
     {"mask_truncated_completions": True}],
    ids=["defaults", "no-kl", "normalized", "clipped", "masked"],
)  # fmt: skip
def test_the_advantages_and_the_reward_metrics_are_rloo_trainer_s(rl):
    from types import SimpleNamespace

    from trainer.objectives.grpo_metrics import RLMetrics
    from trainer.rl.rewards import combined

    per_function, ids, mask, old, ref, ended = generation()
    weights = [1.0, 0.5]
    beta = rl.get("beta", 0.05)  # RLOOConfig's default
    out, theirs = trl_ref.rloo_generate_and_score(
        ids, per_function, weights, old, ref, num_generations=G, **rl
    )
    counts = (ended | (not rl.get("mask_truncated_completions"))).to(torch.float64)
    kl = ((old - ref) * mask * counts.unsqueeze(1)).sum(-1)
    adv, zero = loo_advantages(combined(per_function, torch.tensor(weights, dtype=torch.float64)), kl, G, beta,
                               rl.get("normalize_advantages", False), rl.get("reward_clip_range"))  # fmt: skip
    assert torch.allclose(adv, out["advantages"].to(torch.float64), rtol=1e-5, atol=1e-6), (
        adv,
        out["advantages"],
    )
    assert adv[5] == 0 and (adv[9:] == 0).all() and adv.abs().sum() > 0
    assert out["old_logps"].to(torch.float64) == pytest.approx(
        (old * (out["completion_mask"])).sum(1), rel=1e-12
    )
    section = RLSection(num_generations=G, advantage="rloo", beta=beta,
                        rewards=[{"function": "f0", "weight": 1.0}, {"function": "f1", "weight": 0.5}])  # fmt: skip
    m = RLMetrics(section)
    scored = SimpleNamespace(
        extra={"step": (per_function, zero, adv)}, completions=[([1, 2], True)] * N, seconds=0.0
    )
    m.count_generation(scored, [SimpleNamespace(name="f0"), SimpleNamespace(name="f1")])
    got = m.flush(1)
    for ours_key, key in (("reward", "reward"), ("reward_std", "reward_std"), ("reward_f0", "rewards/f0/mean"),
                          ("reward_f1_std", "rewards/f1/std"), ("zero_std_share", "frac_reward_zero_std")):  # fmt: skip
        assert got[ours_key] == pytest.approx(theirs[key][0], rel=1e-5, abs=1e-6), ours_key


def loss_batch(seed=0, iterations=1):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, T, generator=g, dtype=torch.float64, requires_grad=True)
    logps = torch.nn.functional.logsigmoid(logits)
    mask = torch.ones(6, T, dtype=torch.float64)
    mask[1, 3:] = 0
    mask[4, 1:] = 0
    old = logps.detach() + (
        0.2 * torch.randn(6, T, generator=g, dtype=torch.float64) if iterations > 1 else 0
    )
    adv = torch.randn(6, generator=g, dtype=torch.float64)
    return logits, logps, mask, old, adv


@pytest.mark.parametrize("iterations", [1, 3])
@pytest.mark.parametrize("rl", [{}, {"epsilon": 0.1, "epsilon_high": 0.3}], ids=["defaults", "clip-higher"])
def test_the_loss_and_its_gradient_are_rloo_trainer_s(iterations, rl):
    logits, logps, mask, old, adv = loss_batch(iterations=iterations)
    theirs = trl_ref.rloo_compute_loss(logps, mask, adv, (old * mask).sum(1), **rl)
    (g_theirs,) = torch.autograd.grad(theirs, logits, retain_graph=True)
    s = grpo.settings(RLSection(advantage="rloo", **rl))
    ours = grpo.micro_loss(logps, old, None, adv, mask, s, grpo.step_normaliser(s, 6, int(mask.sum())))
    (g_ours,) = torch.autograd.grad(ours, logits)
    assert g_theirs.abs().sum() > 0
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-9, abs=1e-12)
    assert torch.allclose(g_ours, g_theirs, rtol=1e-9, atol=1e-13), (g_ours - g_theirs).abs().max()
    if iterations > 1:  # the clip is reached: whole completions clipped, counted as TRL counts them
        terms = grpo.token_losses(logps, old, None, adv, mask, s)
        assert bool((terms.low | terms.high).any())


def test_a_masked_truncated_completion_counts_in_neither_the_loss_nor_its_normaliser():
    """TRL zeroes a truncated completion's mask but keeps it in the mean (its loss -A, no gradient): ours is
    TRL's times B / (B - truncated) in value and gradient, as GRPO's grpo type (docs/rl.md)."""
    logits, logps, mask, old, adv = loss_batch(iterations=3)
    masked = mask.clone()
    masked[2] = 0
    theirs = trl_ref.rloo_compute_loss(logps, masked, adv, (old * masked).sum(1))
    (g_theirs,) = torch.autograd.grad(theirs, logits, retain_graph=True)
    s = grpo.settings(RLSection(advantage="rloo"))
    ours = grpo.micro_loss(logps, old, None, adv, masked, s, grpo.step_normaliser(s, 5, int(masked.sum())))
    (g_ours,) = torch.autograd.grad(ours, logits)
    assert torch.allclose(g_ours, g_theirs * 6 / 5, rtol=1e-9, atol=1e-13)
    assert ours.item() == pytest.approx((theirs.item() * 6 + float(adv[2])) / 5, rel=1e-9)


def test_the_step_loss_does_not_depend_on_its_split():
    logits, logps, mask, old, adv = loss_batch(iterations=3)
    s = grpo.settings(RLSection(advantage="rloo"))
    n = grpo.step_normaliser(s, 6, int(mask.sum()))
    whole = grpo.micro_loss(logps, old, None, adv, mask, s, n)
    for parts in (2, 3, 6):
        size = 6 // parts
        split = sum(grpo.micro_loss(logps[i : i + size], old[i : i + size], None, adv[i : i + size],
                                    mask[i : i + size], s, n / parts) for i in range(0, 6, size)) / parts  # fmt: skip
        assert split.item() == pytest.approx(whole.item(), rel=1e-12)


def test_rloo_keys_and_grpo_keys_are_refused_on_the_other_side():
    from types import SimpleNamespace

    def problems(**rl):
        section = RLSection(rewards=[{"function": "format"}], **rl)
        return [k for k, _ in rl_problems_of(section)]

    def rl_problems_of(section):
        exp = SimpleNamespace(
            train=SimpleNamespace(objective="grpo", rl=section, micro_batch_size=8, grad_accum=1, eval_every=0),
            data=SimpleNamespace(sources=[("train", SimpleNamespace(kind="prompt"))], eval=None, eval_fraction=0,
                                 model_fields_set=set()),
            strategy=SimpleNamespace(sequence_parallel="auto"),
            model=SimpleNamespace(lora=None, chunked_loss="auto"),
        )  # fmt: skip
        return rl_problems(exp)

    assert problems(advantage="rloo") == []
    assert problems(advantage="rloo", loss_type="grpo", scale_rewards="batch") == [
        "train.rl.loss_type", "train.rl.scale_rewards"]  # fmt: skip
    assert problems(normalize_advantages=True) == ["train.rl.normalize_advantages"]
    assert problems(reward_clip_range=(0, 1)) == ["train.rl.reward_clip_range"]
    assert problems(advantage="rloo", reward_clip_range=(1, 0)) == ["train.rl.reward_clip_range"]
    assert "rloo" in grpo.GRPO(RLSection(advantage="rloo", rewards=[{"function": "format"}]), 1, 1).describe()
