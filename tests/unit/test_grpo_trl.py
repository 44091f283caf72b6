"""GRPO against TRL 1.16's GRPOTrainer, its code called (tests/trl_ref.py), never copied (issue 60): our
defaults are TRL's; the loss and its gradient equal TRL's `_compute_loss` at TRL's defaults for every loss
type, beta 0 and 0.04, one and three iterations, then at every option we expose (clip-higher, delta, the
sequence level, the KL's ratio correction off, top_entropy_quantile, SAPO's temperatures, VESPO's weights,
CISPO's cap); the advantages and the reward metrics equal `_generate_and_score_completions`'s for every
scaling and both aggregations, with None rewards; the clip, KL and entropy metrics equal `_compute_loss`'s.
All in fp64 but TRL's rewards (fp32 there)."""

import re

import pytest
import torch

trl = pytest.importorskip("trl")
import trl_ref  # noqa: E402

from trainer.config.rl_schema import RLSection  # noqa: E402
from trainer.objectives import grpo  # noqa: E402

B, T = 6, 5

# train.rl's names for TRL's (where they differ) and the defaults that differ on purpose: (ours, TRL's)
NAMES = {"max_new_tokens": "max_completion_length"}
DIFFERENT = {"max_new_tokens": (64, 512)}  # a tiny model's here; docs/rl.md says so: set it


def test_our_defaults_are_trl_s():
    trl_defaults = trl_ref.config_defaults()
    ours = RLSection()
    shared = [k for k in RLSection.model_fields if NAMES.get(k, k) in trl_defaults and k not in DIFFERENT]
    assert len(shared) >= 22, shared
    differ = {k: (getattr(ours, k), trl_defaults[NAMES.get(k, k)]) for k in shared
              if getattr(ours, k) != trl_defaults[NAMES.get(k, k)]}  # fmt: skip
    assert not differ, differ
    assert trl_defaults["use_bias_correction_kl"] is True and ours.use_bias_correction_kl is True


def test_the_defaults_that_differ_are_stated_with_trl_s_true_value():
    """The finding: docs/rl.md and this file said TRL's max_completion_length defaults to 256; it is 512."""
    from helpers import ROOT

    docs = (ROOT / "docs" / "rl.md").read_text()
    for k, (here, theirs) in DIFFERENT.items():
        assert getattr(RLSection(), k) == here and trl_ref.config_defaults()[NAMES.get(k, k)] == theirs, k
        assert f"| `{NAMES.get(k, k)}` ({theirs}) | `train.rl.{k}` ({here} here" in docs, k


def test_the_optimizers_defaults_that_differ_from_grpoconfigs_are_stated_and_the_banner_says_the_rate():
    """Issue 74 item 1: the table said the defaults map, and the optimizer's do not (TRL's GRPOConfig trains at 1e-6,
    betas (0.9, 0.999), linear decay; ours at 3e-4, (0.9, 0.95), cosine): each stated beside TRL's true value, the
    ones that agree said so, and the GRPO banner's optimizer line says the rate and TRL's."""
    from helpers import ROOT

    from trainer.config.schema import OptimSection, TrainSection

    d, o = trl_ref.config_defaults(), OptimSection()
    docs = (ROOT / "docs" / "rl.md").read_text()
    assert (d["learning_rate"], o.lr) == (
        1e-6,
        3e-4,
    ) and "| `learning_rate` (1e-06) | `optim.lr` (3e-4 here" in docs
    assert (d["adam_beta1"], d["adam_beta2"], o.betas) == (0.9, 0.999, (0.9, 0.95))
    assert "| `adam_beta1`, `adam_beta2` (0.9, 0.999) | `optim.betas` ((0.9, 0.95) here" in docs
    assert (d["lr_scheduler_type"], o.schedule) == (
        "linear",
        "cosine",
    ) and "`optim.schedule` (cosine here" in docs
    same = (d["warmup_steps"], d["adam_epsilon"], d["weight_decay"], d["max_grad_norm"])
    assert same == (o.warmup_steps, o.eps, o.weight_decay, TrainSection.model_fields["grad_clip"].default)
    from trainer.rl import optimizer_line

    line = optimizer_line(OptimSection())
    assert "lr 3e-04" in line and "TRL's GRPOConfig: 1e-06, betas (0.9, 0.999), linear" in line


def test_the_loss_settings_defaults_are_trl_s():
    """grpo_loss.Settings says its defaults are TRL 1.16's: every one of them (max_new_tokens said 256)."""
    import dataclasses

    trl_defaults = trl_ref.config_defaults()
    s = grpo.Settings()
    differ = {f.name: (getattr(s, f.name), trl_defaults[NAMES.get(f.name, f.name)])
              for f in dataclasses.fields(grpo.Settings) if f.name != "advantage"  # (ours: GRPO's or RLOO's)
              if getattr(s, f.name) != trl_defaults[NAMES.get(f.name, f.name)]}  # fmt: skip
    assert not differ, differ


def batch(seed=0, iterations=1, beta=0.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, generator=g, dtype=torch.float64, requires_grad=True)
    logps = torch.nn.functional.logsigmoid(logits)  # a differentiable stand-in for the policy's log-probs
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[1, 3:] = 0
    mask[4, 1:] = 0
    old = (
        logps.detach() + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64) if iterations > 1 else None
    )
    ref = logps.detach() + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64) if beta else None
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    ent = torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    return logits, logps, mask, old, ref, adv, ent


def ours_and_theirs(iterations, **rl):
    """Our loss and gradient and TRL's, on the same batch, at train.rl's defaults (ours) and GRPOConfig's
    (theirs) but `rl` (the same keys on both sides)."""
    s = grpo.settings(RLSection(**rl, max_new_tokens=T))
    logits, logps, mask, old, ref, adv, ent = batch(iterations=iterations, beta=s.beta)
    theirs, metrics = trl_ref.compute_loss(logps, mask, adv, old, ref, ent, max_completion_length=T, **rl)
    (g_theirs,) = torch.autograd.grad(theirs, logits, retain_graph=True)
    o = old if old is not None else logps.detach()
    norm = mask.sum() if s.loss_type == "bnpo" else grpo.step_normaliser(s, B, int(mask.sum()))
    keep = grpo.high_entropy(ent, mask, s.top_entropy_quantile) if s.top_entropy_quantile < 1 else None
    ours = grpo.micro_loss(logps, o, ref, adv, mask, s, float(norm), keep)
    (g_ours,) = torch.autograd.grad(ours, logits)
    return (ours, g_ours), (theirs, g_theirs), metrics


def close(ours, theirs):
    (l_o, g_o), (l_t, g_t) = ours, theirs
    assert torch.isfinite(l_t) and g_t.abs().sum() > 0  # a case that computes something
    assert l_o.item() == pytest.approx(l_t.item(), rel=1e-9, abs=1e-12)
    assert torch.allclose(g_o, g_t, rtol=1e-9, atol=1e-13), (g_o - g_t).abs().max()


@pytest.mark.parametrize("iterations", [1, 3])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
def test_the_loss_and_its_gradient_are_trl_s_at_trl_s_defaults(loss_type, beta, iterations):
    ours, theirs, _ = ours_and_theirs(iterations, loss_type=loss_type, beta=beta)
    close(ours, theirs)


OPTIONS = {
    "clip-higher": {"epsilon_high": 0.28},
    "two-sided clip": {"delta": 1.5, "epsilon": 0.1},
    "GSPO": {"importance_sampling_level": "sequence"},
    "KL without its ratio": {"use_bias_correction_kl": False},
    "the top 20% by entropy": {"top_entropy_quantile": 0.2},
    "SAPO's temperatures": {"sapo_temperature_pos": 0.5, "sapo_temperature_neg": 2.0},
    "VESPO's weights": {"vespo_k_pos": 1.0, "vespo_lambda_pos": 0.5, "vespo_k_neg": 4.0, "vespo_lambda_neg": 1.5},
    "CISPO's cap": {"epsilon_high": 5.0},
    "everything": {"epsilon_high": 0.3, "delta": 2.0, "importance_sampling_level": "sequence",
                   "top_entropy_quantile": 0.5},
}  # fmt: skip


@pytest.mark.parametrize("iterations", [1, 3])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_the_loss_and_its_gradient_are_trl_s_at_every_option(option, loss_type, beta, iterations):
    ours, theirs, _ = ours_and_theirs(iterations, loss_type=loss_type, beta=beta, **OPTIONS[option])
    close(ours, theirs)


def test_without_the_kl_correction_the_gradient_differs_by_what_the_issue_measured():
    """The finding: the KL term without TRL's default ratio correction moves the gradient (issue 60: ~1.2%
    of its scale at one iteration): the correction is what makes ours equal TRL's default."""
    ours, theirs, _ = ours_and_theirs(1, loss_type="dapo", beta=0.04, use_bias_correction_kl=False)
    s = grpo.settings(RLSection(loss_type="dapo", beta=0.04, max_new_tokens=T))
    logits, logps, mask, _, ref, adv, ent = batch(beta=0.04)
    trl_default, _ = trl_ref.compute_loss(
        logps, mask, adv, None, ref, ent, max_completion_length=T, beta=0.04
    )
    (g_default,) = torch.autograd.grad(trl_default, logits)
    gap = (ours[1] - g_default).abs().max() / g_default.abs().max()
    print(f"gradient without the correction against TRL's default: {gap:.2%} of its largest element")
    assert gap > 1e-3
    assert s.use_bias_correction_kl


def test_with_mask_truncated_completions_the_loss_is_trl_s_times_b_over_b_minus_truncated_where_the_docs_say():
    """The finding: the docs named grpo and dr_grpo only; sapo and luspo differ too. TRL zeroes a truncated
    completion's mask but still counts it among the completions it averages over (grpo, sapo, luspo) or in
    its normaliser (dr_grpo): ours is TRL's times B / (B - truncated) there, loss and gradient, and equal
    elsewhere. docs/rl.md and grpo_loss.py's docstring name exactly those types."""
    from helpers import ROOT

    from trainer.objectives import grpo_loss

    logits, logps, mask, old, _, adv, _ = batch(iterations=3)
    truncated = torch.tensor([0, 0, 1, 0, 0, 1], dtype=torch.float64)  # rows 2 and 5 hit max_new_tokens
    counts = 1 - truncated
    m = mask * counts.unsqueeze(1)  # TRL's completion mask with mask_truncated_completions (ours: the counts)
    factor, differ = B / (B - int(truncated.sum())), set()
    for lt in grpo.LOSS_TYPES:
        rl = dict(loss_type=lt, mask_truncated_completions=True)
        s = grpo.settings(RLSection(**rl, max_new_tokens=T))
        theirs, _ = trl_ref.compute_loss(logps, m, adv, old, None, None, max_completion_length=T, **rl)
        (g_theirs,) = torch.autograd.grad(theirs, logits, retain_graph=True)
        norm = m.sum() if lt == "bnpo" else grpo.step_normaliser(s, int(counts.sum()), int(m.sum()))
        ours = grpo.micro_loss(logps, old, None, adv, m, s, float(norm))
        (g_ours,) = torch.autograd.grad(ours, logits, retain_graph=True)
        f = 1.0 if lt not in grpo_loss.TRUNCATED_APART else factor
        assert ours.item() == pytest.approx(f * theirs.item(), rel=1e-9), lt
        assert torch.allclose(g_ours, f * g_theirs, rtol=1e-9, atol=1e-13), lt
        if abs(ours.item() / theirs.item() - 1) > 1e-9:
            differ.add(lt)
    assert differ == set(grpo_loss.TRUNCATED_APART) == {"grpo", "sapo", "luspo", "dr_grpo"}
    docs = (ROOT / "docs" / "rl.md").read_text()
    phrase = "B / (B - truncated)"
    for said in (docs[docs.index("With `mask_truncated_completions: true`") :][:900],
                 docs[docs.index("What differs on purpose") :][:900], grpo_loss.__doc__):  # fmt: skip
        sentence = said[: said.index(phrase)].rsplit(". ", 1)[-1]  # what the sentence names before the factor
        assert {lt for lt in grpo.LOSS_TYPES if re.search(rf"\b{lt}\b", sentence)} == differ, sentence


@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "luspo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_the_clip_kl_and_entropy_metrics_are_trl_s(loss_type, level):
    from trainer.objectives.grpo_metrics import RLMetrics

    rl = RLSection(loss_type=loss_type, beta=0.04, importance_sampling_level=level, epsilon_high=0.28,
                   max_new_tokens=T)  # fmt: skip
    s = grpo.settings(rl)
    logits, logps, mask, old, ref, adv, ent = batch(iterations=3, beta=0.04)
    _, theirs = trl_ref.compute_loss(logps, mask, adv, old, ref, ent, max_completion_length=T, loss_type=loss_type,
                                     beta=0.04, importance_sampling_level=level, epsilon_high=0.28)  # fmt: skip
    m = RLMetrics(rl)
    m.count_loss(mask, grpo.token_losses(logps.detach(), old, ref, adv, mask, s), ent)
    got = m.flush(1)
    assert got["kl"] == pytest.approx(theirs["kl"][0], rel=1e-9)
    assert got["entropy"] == pytest.approx(theirs["entropy"][0], rel=1e-9)
    if loss_type == "cispo":
        assert got["clip_high"] == pytest.approx(
            theirs["cispo_clip_ratio"][0], rel=1e-6
        )  # (a float32 mean there)
    else:
        for ours_key, key in (
            ("clip_low", "low_mean"),
            ("clip_high", "high_mean"),
            ("clip_region", "region_mean"),
        ):
            assert got[ours_key] == pytest.approx(theirs[f"clip_ratio/{key}"][0], rel=1e-6, abs=1e-12)


def rewards(seed=3):
    g = torch.Generator().manual_seed(seed)
    per_function = torch.randn(12, 2, generator=g).to(torch.float32).to(torch.float64)  # (TRL's are fp32)
    per_function[1, 0] = float("nan")  # a function returned None for it
    per_function[5] = float("nan")  # every function did: unscorable, advantage 0
    per_function[8:, 1] = 0.5  # a group where the second function agrees
    return per_function


@pytest.mark.parametrize(
    "scale,how",
    [("group", "sum_then_normalize"), ("batch", "sum_then_normalize"), ("none", "sum_then_normalize"),
     ("group", "normalize_then_sum")],
)  # fmt: skip
def test_the_advantages_and_the_reward_metrics_are_trl_s(scale, how):
    from types import SimpleNamespace

    from trainer.objectives.grpo_metrics import RLMetrics

    per_function, weights, G = rewards(), [1.0, 0.5], 4
    rows = [{"prompt": f"p{i // G}"} for i in range(12)]
    out, theirs = trl_ref.generate_and_score(rows, ["c"] * 12, per_function, weights, num_generations=G,
                                             scale_rewards=scale, multi_objective_aggregation=how)  # fmt: skip
    adv, zero = grpo.aggregate(per_function, torch.tensor(weights, dtype=torch.float64), G, scale, how)
    assert torch.allclose(adv, out["advantages"].to(torch.float64), rtol=1e-5, atol=1e-6)
    assert adv[5] == 0
    rl = RLSection(num_generations=G, scale_rewards=scale, multi_objective_aggregation=how,
                   rewards=[{"function": "f0", "weight": 1.0}, {"function": "f1", "weight": 0.5}])  # fmt: skip
    m = RLMetrics(rl)
    scored = SimpleNamespace(
        extra={"step": (per_function, zero, adv)}, completions=[([1, 2], True)] * 12, seconds=0.0
    )
    m.count_generation(scored, [SimpleNamespace(name="f0"), SimpleNamespace(name="f1")])
    got = m.flush(1)
    for ours_key, key in (("reward", "reward"), ("reward_std", "reward_std"), ("reward_f0", "rewards/f0/mean"),
                          ("reward_f0_std", "rewards/f0/std"), ("reward_f1_std", "rewards/f1/std"),
                          ("zero_std_share", "frac_reward_zero_std")):  # fmt: skip
        assert got[ours_key] == pytest.approx(theirs[key][0], rel=1e-5, abs=1e-6), ours_key


def test_reward_std_is_the_step_s_bessel_corrected_std_not_a_pooled_one():
    """The finding: rewards 0, 0, 1, 1 then 0, 1, 1, 1 over two steps of one log line; the old pooled
    population std said 0.4841, TRL logs the mean of each step's: (0.5774 + 0.5) / 2 = 0.5387."""
    from types import SimpleNamespace

    from trainer.objectives.grpo_metrics import RLMetrics

    rl = RLSection(num_generations=4, rewards=[{"function": "f", "weight": 1.0}])
    m = RLMetrics(rl)
    theirs = []
    for values in ([0.0, 0.0, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0]):
        r = torch.tensor(values, dtype=torch.float64).unsqueeze(1)
        adv, zero = grpo.aggregate(r, torch.ones(1, dtype=torch.float64), 4, "group")
        m.count_generation(SimpleNamespace(extra={"step": (r, zero, adv)}, completions=[([1], True)] * 4, seconds=0.0),
                           [SimpleNamespace(name="f")])  # fmt: skip
        _, t = trl_ref.generate_and_score([{"prompt": "p"}] * 4, ["c"] * 4, r, [1.0], num_generations=4)
        theirs.append(t["reward_std"][0])
    got = m.flush(1)
    assert got["reward_std"] == pytest.approx(sum(theirs) / 2, rel=1e-6)
    assert got["reward_std"] == pytest.approx((0.5774 + 0.5) / 2, abs=1e-4)


def test_the_entropy_quantile_is_over_every_rank_s_tokens_as_trl_s(monkeypatch):
    """top_entropy_quantile on 2 ranks (torch.distributed's all_gather stood in for): the mask is TRL's
    get_high_entropy_mask's, whose quantile is of both ranks' completion tokens (padded to the longer)."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(5)
    ents = [
        torch.rand(3, 4, generator=g, dtype=torch.float64) * 2,
        torch.rand(2, 6, generator=g, dtype=torch.float64),
    ]
    masks = [torch.ones(3, 4), torch.ones(2, 6)]
    masks[0][1, 2:] = 0
    masks[1][0, 5:] = 0
    local = [e[m.bool()].float() for e, m in zip(ents, masks, strict=True)]
    width = max(x.numel() for x in local)
    padded = [torch.cat([x, torch.full((width - x.numel(),), -1e9)]) for x in local]

    class Gather:
        calls = 0

        def __call__(self, out, t):  # the sizes first, then the padded entropies, as every rank sends them
            both = [torch.tensor([x.numel()]) for x in local] if Gather.calls % 2 == 0 else padded
            for o, b in zip(out, both, strict=True):
                o.copy_(b.to(o.dtype))
            Gather.calls += 1

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_gather", Gather())
    for rank in (0, 1):
        ours = grpo.high_entropy(ents[rank], masks[rank], 0.3, world=2)
        t = trl_ref.trainer(top_entropy_quantile=0.3)
        t.accelerator.pad_across_processes = lambda x, dim=0, pad_index=0: x  # (already padded: both ranks')
        t.accelerator.gather = lambda x: torch.cat(padded)
        theirs = t.get_high_entropy_mask(ents[rank], masks[rank], 1 - 0.3)
        assert torch.equal(ours, theirs), rank
        assert 0 < ours.sum() < masks[rank].sum()
