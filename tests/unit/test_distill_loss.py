"""The distillation divergence (trainer/objectives/divergence.py) against TRL's own code: GKD's
`generalized_jsd_loss` on whole logits and the stable DistillationTrainer's `_chunked_divergence_loss` (its
chunked kernel's torch path), loss and gradient, at TRL's defaults (GKD's beta 0.5, the stable trainer's 1.0,
temperature 1) and at beta 0, 0.5, 1 and between with temperature != 1; the same whatever the vocabulary chunk;
split-invariant (micro batches summed with the step's token count = the whole batch); and the logits never whole
(what autograd keeps a token is a few floats, not the vocabulary)."""

import pytest
import torch

from trainer.objectives import divergence

N, H_S, H_T, V = 12, 16, 24, 300


@pytest.fixture(scope="module")
def tensors():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(N, H_S, generator=g), torch.randn(V, H_S, generator=g) * 0.5,
            torch.randn(N, H_T, generator=g), torch.randn(V, H_T, generator=g) * 0.5,
            torch.rand(N, generator=g) > 0.3)  # fmt: skip


def ours(t, beta, temperature, chunk=64):
    h_s, w_s, h_t, w_t, mask = t
    a, b = h_s.clone().requires_grad_(), w_s.clone().requires_grad_()
    out = divergence.loss(a, b, h_t, w_t, mask, beta, temperature, mask.sum(), chunk=chunk)
    out.backward()
    return out.detach(), a.grad, b.grad


CASES = [(0.5, 1.0), (1.0, 1.0), (0.0, 0.7), (0.5, 0.7), (1.0, 0.7), (0.1, 2.0), (0.9, 1.3)]


@pytest.mark.parametrize("beta,temperature", CASES)
def test_the_loss_and_gradient_are_trls(tensors, beta, temperature):
    from trl.experimental.gkd.gkd_trainer import GKDTrainer
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    h_s, w_s, h_t, w_t, mask = tensors
    loss, g_h, g_w = ours(tensors, beta, temperature)
    a, b = h_s.clone().requires_grad_(), w_s.clone().requires_grad_()
    labels = torch.where(mask, 1, -100)[None]
    gkd = GKDTrainer.generalized_jsd_loss((a @ b.t())[None], (h_t @ w_t.t())[None], labels=labels, beta=beta,
                                          temperature=temperature)  # fmt: skip
    gkd.backward()
    c, d = h_s.clone().requires_grad_(), w_s.clone().requires_grad_()
    stable, _, _ = _chunked_divergence_loss(c[None], h_t[None], d, w_t, mask[None].long(), beta,
                                            temperature=temperature)  # fmt: skip
    stable.backward()
    for ref, ga, gb in ((gkd, a.grad, b.grad), (stable, c.grad, d.grad)):
        assert loss.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-7)
        assert torch.allclose(g_h, ga, rtol=1e-4, atol=1e-6) and torch.allclose(g_w, gb, rtol=1e-4, atol=1e-6)


def test_the_chunk_changes_nothing_and_the_split_is_invariant(tensors, monkeypatch):
    """Chunks of 7 entries, 64 and the whole vocabulary, blocks of 5 tokens: the same loss and gradient (to fp32
    rounding); micro batches of 5 and 7 tokens each divided by the step's token count sum to the whole batch's
    loss and gradient."""
    whole = ours(tensors, 0.5, 0.7, chunk=V)
    for chunk in (7, 64):
        got = ours(tensors, 0.5, 0.7, chunk=chunk)
        assert all(torch.allclose(x, y, rtol=1e-5, atol=1e-7) for x, y in zip(got, whole, strict=True))
    monkeypatch.setattr(divergence, "TOKENS", 5)
    got = ours(tensors, 0.5, 0.7, chunk=64)
    assert all(torch.allclose(x, y, rtol=1e-5, atol=1e-7) for x, y in zip(got, whole, strict=True))
    monkeypatch.undo()
    h_s, w_s, h_t, w_t, mask = tensors
    a, b = h_s.clone().requires_grad_(), w_s.clone().requires_grad_()
    total = sum(
        divergence.loss(a[s], b, h_t[s], w_t, mask[s], 0.5, 0.7, mask.sum())
        for s in (slice(0, 5), slice(5, N))
    )
    total.backward()
    assert total.item() == pytest.approx(whole[0].item(), rel=1e-6)
    assert torch.allclose(a.grad, whole[1], atol=1e-7) and torch.allclose(b.grad, whole[2], atol=1e-7)


def test_the_logits_are_never_whole(tensors):
    """What autograd keeps for backward: the inputs and three floats a token (the two log-normalizers and E[g]);
    TRL's GKD loss on whole logits keeps several (tokens x vocabulary) tensors."""
    h_s, w_s, h_t, w_t, mask = tensors
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    a, b = h_s.clone().requires_grad_(), w_s.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        divergence.loss(a, b, h_t, w_t, mask, 0.5, 1.0, mask.sum(), chunk=64)
    inputs = sum(x.numel() * 4 for x in (h_s, w_s, h_t, w_t))
    assert sum(kept.values()) <= inputs + 3 * 4 * N + 8 * N  # (and the mask's indices)
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    kept.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        GKDTrainer.generalized_jsd_loss((a @ b.t())[None], (h_t @ w_t.t())[None], beta=0.5)
    assert sum(kept.values()) >= 3 * N * V * 4
