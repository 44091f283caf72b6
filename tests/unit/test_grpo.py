"""GRPO's loss and advantages against TRL's GRPOTrainer (issue 56 item 4; trainer/objectives/grpo.py), in
fp64 on the same completions, rewards and old/reference log-probs: every loss type, beta 0 and 0.04,
num_iterations > 1 (old log-probs apart from the current ones), epsilon_high and delta; the advantages for
group, batch and none scaling with None rewards and weights; at num_iterations 1 the ratio is exactly 1 and
the gradient the policy gradient over the normaliser; clipped tokens get no gradient and the clip
indicators equal hand counts; truncated completions, masked, count in neither the loss nor its normaliser;
and a step's loss does not depend on how it is split into micro batches."""

import collections
import types

import pytest
import torch

from trainer.objectives import grpo

trl = pytest.importorskip("trl")
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402
from trl.trainer.utils import nanstd as trl_nanstd  # noqa: E402

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


def trl_loss(loss_type, logps, mask, old, ref, adv, beta, eps, eps_high, delta, max_len):
    """TRL's GRPOTrainer._compute_loss on one micro batch of one process, its model's forward replaced by
    the given per-token log-probs."""
    metrics = collections.defaultdict(lambda: collections.defaultdict(list))
    acc = types.SimpleNamespace(num_processes=1, gather=lambda x: x, gather_for_metrics=lambda x: x,
                                reduce=lambda x, reduction="sum": x, sync_gradients=True)  # fmt: skip
    fake = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token", beta=beta,
        args=types.SimpleNamespace(delta=delta, use_bias_correction_kl=False, steps_per_generation=1), loss_type=loss_type,
        epsilon_low=eps, epsilon_high=eps_high, use_vllm=False, vllm_importance_sampling_correction=False,
        max_completion_length=max_len, current_gradient_accumulation_steps=1, accelerator=acc,
        model=types.SimpleNamespace(training=True), _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics=metrics,
    )  # fmt: skip
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": adv, "num_items_in_batch": mask.sum()}  # fmt: skip
    if old is not None:
        inputs["old_per_token_logps"] = old
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    return GRPOTrainer._compute_loss(fake, None, inputs), metrics["train"]


@pytest.mark.parametrize("delta", [None, 1.5])
@pytest.mark.parametrize("eps_high", [None, 0.28])
@pytest.mark.parametrize("iterations", [1, 3])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
def test_the_loss_and_its_gradient_are_trl_s(loss_type, beta, iterations, eps_high, delta):
    s = grpo.Settings(
        loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=eps_high, delta=delta, max_new_tokens=T
    )
    logits, logps, mask, old, ref, adv = batch(iterations=iterations, beta=beta)
    theirs, _ = trl_loss(
        loss_type, logps, mask, old, ref, adv, beta, 0.2, eps_high if eps_high else 0.2, delta, T
    )
    (g_theirs,) = torch.autograd.grad(theirs, logits, retain_graph=True)
    o = old if old is not None else logps.detach()
    normaliser = mask.sum() if loss_type == "bnpo" else grpo.step_normaliser(s, B, int(mask.sum()))
    ours = grpo.micro_loss(logps, o, ref, adv, mask, s, float(normaliser))
    (g_ours,) = torch.autograd.grad(ours, logits)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-12)
    assert torch.allclose(g_ours, g_theirs, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_are_trl_s_with_none_and_weighted_rewards(scale):
    g = torch.Generator().manual_seed(3)
    per_function = torch.randn(8, 2, generator=g, dtype=torch.float64)
    per_function[1, 0] = float("nan")  # a function returned None for it
    per_function[5] = float("nan")  # every function did: unscorable, advantage 0
    weights = torch.tensor([1.0, 0.5], dtype=torch.float64)
    rewards = grpo.combined(per_function, weights)
    ours, zero = grpo.advantages(rewards, 4, scale)
    # TRL's sum_then_normalize, written out from grpo_trainer.py
    r = (per_function * weights.unsqueeze(0)).nansum(dim=1)
    r[torch.isnan(per_function).all(dim=1)] = torch.nan
    mean = torch.nanmean(r.view(-1, 4), dim=1).repeat_interleave(4)
    std = (
        trl_nanstd(r.view(-1, 4), dim=1).repeat_interleave(4)
        if scale != "batch"
        else trl_nanstd(r).expand_as(r)
    )
    theirs = r - mean
    if scale != "none":
        theirs = theirs / (std + 1e-4)
    theirs = torch.nan_to_num(theirs, nan=0.0)
    assert torch.allclose(ours, theirs, rtol=1e-12, atol=1e-12)
    assert ours[5] == 0 and zero.dtype == torch.bool


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
    _, low, high, region = grpo.token_losses(logps, old, None, adv, s)
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


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_the_step_loss_does_not_depend_on_its_split(loss_type):
    """The sum of the micro batches' losses, each over the step's normaliser x micro batches and averaged
    as DeepSpeed averages them, is the step's loss, for any split of its completions (their lengths
    differ: TRL's per-micro-batch normalisers made dapo and grpo depend on the split, #3021, #6439)."""
    s = grpo.Settings(loss_type=loss_type, max_new_tokens=T)
    logits, logps, mask, _, _, adv = batch()
    n = grpo.step_normaliser(s, B, int(mask.sum()))
    whole = grpo.micro_loss(logps, logps.detach(), None, adv, mask, s, n)
    for parts in (2, 3, 6):
        size = B // parts
        split = sum(
            grpo.micro_loss(logps[i : i + size], logps[i : i + size].detach(), None, adv[i : i + size],
                            mask[i : i + size], s, n / parts)
            for i in range(0, B, size)
        ) / parts  # fmt: skip
        assert split.item() == pytest.approx(whole.item(), rel=1e-12)
