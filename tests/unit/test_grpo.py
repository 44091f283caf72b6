"""GRPO's loss by its own properties (trainer/objectives/grpo.py; against TRL's code: test_grpo_trl.py): at
num_iterations 1 the ratio is exactly 1 and the gradient the policy gradient over the normaliser; clipped
tokens get no gradient and the clip indicators equal hand counts; truncated completions, masked, count in
neither the loss nor its normaliser; and a step's loss does not depend on how it is split into micro
batches, for every type but bnpo."""

import pytest
import torch

from trainer.objectives import grpo

B, T = 6, 5


def batch(seed=0, iterations=1, beta=0.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, generator=g, dtype=torch.float64, requires_grad=True)
    logps = torch.nn.functional.logsigmoid(logits)  # a differentiable stand-in for the policy's log-probs
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[1, 3:] = 0
    mask[4, 1:] = 0
    old = (
        (logps.detach() + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64))
        if iterations > 1
        else None
    )
    ref = logps.detach() + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64) if beta else None
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return logits, logps, mask, old, ref, adv


def test_at_one_iteration_the_ratio_is_one_and_the_gradient_the_policy_gradient():
    s = grpo.Settings(loss_type="dapo")
    logits, logps, mask, _, _, adv = batch()
    loss = grpo.micro_loss(logps, logps.detach(), None, adv, mask, s, float(mask.sum()))
    (g,) = torch.autograd.grad(loss, logits, retain_graph=True)
    expected = -(adv.unsqueeze(1) * mask)  # d/dlogp of -A r with r = exp(logp - logp.detach()) = 1
    (g_pg,) = torch.autograd.grad((expected * logps).sum() / mask.sum(), logits)
    assert torch.allclose(g, g_pg, rtol=1e-12, atol=1e-15)
    assert loss.item() == pytest.approx(-(adv.unsqueeze(1) * mask).sum().item() / mask.sum().item())


def test_clipped_tokens_get_no_gradient_and_the_clip_counts_are_hand_counts():
    s = grpo.Settings(loss_type="dapo", epsilon=0.2, epsilon_high=0.28)
    logps = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    # ratios exp(0 - old): 2.0 (above 1.28), 0.5 (below 0.8), 1.1 (inside)
    old = torch.log(torch.tensor([[0.5, 2.0, 1 / 1.1], [0.5, 2.0, 1 / 1.1]], dtype=torch.float64))
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.float64)
    loss = grpo.micro_loss(logps, old, None, adv, mask, s, 6.0)
    (g,) = torch.autograd.grad(loss, logps)
    t = grpo.token_losses(logps, old, None, adv, mask, s)
    low, high, region = t.low, t.high, t.low | t.high
    # row 0 (A > 0): ratio 2.0 clipped high (no gradient); 0.5 not clipped for A > 0 (min picks r A); 1.1 inside
    # row 1 (A < 0): 0.5 clipped low (no gradient); 2.0 unclipped for A < 0 (r A is the min); 1.1 inside
    assert high.tolist() == [[True, False, False], [False, False, False]]
    assert low.tolist() == [[False, False, False], [False, True, False]]
    assert region.sum().item() == 2
    assert g[0, 0] == 0 and g[1, 1] == 0 and (g[0, 1:] != 0).all() and g[1, 0] != 0 and g[1, 2] != 0


def test_masked_truncated_completions_count_in_neither_the_loss_nor_its_normaliser():
    s = grpo.Settings(loss_type="dapo")
    logits, logps, mask, _, _, adv = batch()
    ended = torch.tensor([1, 1, 0, 1, 1, 0], dtype=torch.float64)  # completions 2 and 5 did not end
    masked = mask * ended.unsqueeze(1)
    full = grpo.micro_loss(logps, logps.detach(), None, adv, masked, s, float(masked.sum()))
    kept = [0, 1, 3, 4]
    alone = grpo.micro_loss(
        logps[kept], logps[kept].detach(), None, adv[kept], mask[kept], s, float(mask[kept].sum())
    )
    assert full.item() == pytest.approx(alone.item(), rel=1e-12)
    (g,) = torch.autograd.grad(full, logits)
    assert (g[2] == 0).all() and (g[5] == 0).all()


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", [t for t in grpo.LOSS_TYPES if t != "bnpo"])
def test_the_step_loss_does_not_depend_on_its_split(loss_type, level):
    """The sum of the micro batches' losses, each over the step's normaliser x micro batches and averaged
    as DeepSpeed averages them, is the step's loss, for any split of its completions (their lengths
    differ: TRL's per-micro-batch normalisers made dapo and grpo depend on the split, #3021, #6439)."""
    s = grpo.Settings(loss_type=loss_type, max_new_tokens=T, importance_sampling_level=level)
    logits, logps, mask, old, _, adv = batch(iterations=3)
    n = grpo.step_normaliser(s, B, int(mask.sum()))
    whole = grpo.micro_loss(logps, old, None, adv, mask, s, n)
    for parts in (2, 3, 6):
        size = B // parts
        split = sum(
            grpo.micro_loss(logps[i : i + size], old[i : i + size], None, adv[i : i + size],
                            mask[i : i + size], s, n / parts)
            for i in range(0, B, size)
        ) / parts  # fmt: skip
        assert split.item() == pytest.approx(whole.item(), rel=1e-12)
