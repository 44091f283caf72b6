"""The divergence a distilled student is trained on, from both models' last hidden states and LM heads, a chunk of
the vocabulary for a block of tokens at a time: neither model's logits over the whole vocabulary exist at once (a
chunk's for a block, in fp32: `working_bytes`).

The divergence is TRL's (`GKDTrainer.generalized_jsd_loss`, `trl/kernels/chunked_divergence.py`): with p_s and
p_t the student's and the teacher's next-token distributions at temperature T (both sides' logits divided by T):

- `beta` 0: the forward KL(p_t || p_s); 1: the reverse KL(p_s || p_t);
- between: the generalized Jensen-Shannon divergence beta KL(p_t || m) + (1 - beta) KL(p_s || m) with the mixture
  m = (1 - beta) p_s + beta p_t.

No T^2 factor (TRL has none; DistillKit and SwiftKV multiply by it: `scale`). The gradient reaches the student
only: d/dz_s of the divergence is p_s (g - E_ps[g]) / T with g = (1 - beta) log(p_s / m) between, log(p_s / p_t)
at beta 1, and p_s - p_t at beta 0 (forward KL), computed again a chunk at a time in backward from the two
log-normalizers and E_ps[g] that forward keeps (a few floats a token).
"""

from __future__ import annotations

import math
from typing import Any

from trainer.config.distill_schema import CHUNK, TOKENS, working_bytes  # noqa: F401 (working_bytes: re-exported)


def _logits(hidden: Any, weight: Any, start: int, stop: int, inv_t: float) -> Any:
    return (hidden @ weight[start:stop].t()).float() * inv_t


def _log_m(log_ps: Any, log_pt: Any, beta: float) -> Any:
    import torch

    return torch.logaddexp(log_ps + math.log1p(-beta), log_pt + math.log(beta))


def _chunks(vocab: int, chunk: int) -> list[tuple[int, int]]:
    return [(a, min(a + chunk, vocab)) for a in range(0, vocab, chunk)]


def _divergence_class() -> Any:
    import torch

    class ChunkedDivergence(torch.autograd.Function):
        """Per-token divergence (N,) of the student's hidden states h_s (N, H_s) through its head w_s (V, H_s)
        from the teacher's h_t (N, H_t), w_t (V, H_t)."""

        @staticmethod
        def forward(ctx: Any, h_s: Any, w_s: Any, h_t: Any, w_t: Any, beta: float, temperature: float,
                    chunk: int) -> Any:  # fmt: skip
            inv_t, n, vocab = 1.0 / temperature, h_s.shape[0], w_s.shape[0]
            lz_s = torch.full((n,), -math.inf, device=h_s.device)
            lz_t = torch.full((n,), -math.inf, device=h_s.device)
            with torch.no_grad():
                for a, b in _chunks(vocab, chunk):
                    lz_s = torch.logaddexp(lz_s, torch.logsumexp(_logits(h_s, w_s, a, b, inv_t), -1))
                    lz_t = torch.logaddexp(lz_t, torch.logsumexp(_logits(h_t, w_t, a, b, inv_t), -1))
                div, expected = torch.zeros_like(lz_s), torch.zeros_like(lz_s)
                for a, b in _chunks(vocab, chunk):
                    log_ps = _logits(h_s, w_s, a, b, inv_t) - lz_s[:, None]
                    log_pt = _logits(h_t, w_t, a, b, inv_t) - lz_t[:, None]
                    ps, pt = log_ps.exp(), log_pt.exp()
                    if beta == 0:
                        div += (pt * (log_pt - log_ps)).sum(-1)
                    elif beta == 1:
                        div += (ps * (log_ps - log_pt)).sum(-1)
                    else:
                        log_m = _log_m(log_ps, log_pt, beta)
                        div += (beta * pt * (log_pt - log_m) + (1 - beta) * ps * (log_ps - log_m)).sum(-1)
                        expected += (ps * (1 - beta) * (log_ps - log_m)).sum(-1)
            if beta == 1:
                expected = div
            ctx.save_for_backward(h_s, w_s, h_t, w_t, lz_s, lz_t, expected)
            ctx.beta, ctx.inv_t, ctx.chunk = beta, inv_t, chunk
            return div

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            h_s, w_s, h_t, w_t, lz_s, lz_t, expected = ctx.saved_tensors
            beta, inv_t = ctx.beta, ctx.inv_t
            need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
            grad_h = torch.zeros(h_s.shape, dtype=torch.float32, device=h_s.device) if need_h else None
            # the head's gradient in its own precision, written a chunk at a time (no fp32 copy of the whole head)
            grad_w = torch.zeros(w_s.shape, dtype=w_s.dtype, device=w_s.device) if need_w else None
            for a, b in _chunks(w_s.shape[0], ctx.chunk):
                log_ps = _logits(h_s, w_s, a, b, inv_t) - lz_s[:, None]
                log_pt = _logits(h_t, w_t, a, b, inv_t) - lz_t[:, None]
                ps = log_ps.exp()
                if beta == 0:
                    gz = ps - log_pt.exp()
                elif beta == 1:
                    gz = ps * (log_ps - log_pt - expected[:, None])
                else:
                    gz = ps * ((1 - beta) * (log_ps - _log_m(log_ps, log_pt, beta)) - expected[:, None])
                gz = gz * (grad.float() * inv_t)[:, None]
                if need_h:
                    grad_h += gz @ w_s[a:b].float()
                if need_w:
                    grad_w[a:b] = (gz.t() @ h_s.float()).to(w_s.dtype)
            out_h = grad_h.to(h_s.dtype) if need_h else None
            out_w = grad_w
            return out_h, out_w, None, None, None, None, None

    return ChunkedDivergence


_CLASS: list[Any] = []


def per_token(h_s: Any, w_s: Any, h_t: Any, w_t: Any, beta: float, temperature: float = 1.0,
              chunk: int = CHUNK) -> Any:  # fmt: skip
    """The divergence of each token's next-token distributions (N,), student from teacher (module docstring);
    gradients to the student's hidden states and head only."""
    if not _CLASS:
        _CLASS.append(_divergence_class())
    import torch

    h_t, w_t = h_t.detach(), w_t.detach()
    blocks = [(a, min(a + TOKENS, h_s.shape[0])) for a in range(0, h_s.shape[0], TOKENS)] or [(0, 0)]
    return torch.cat([_CLASS[0].apply(h_s[a:b], w_s, h_t[a:b], w_t, float(beta), float(temperature), int(chunk))
                      for a, b in blocks])  # fmt: skip


def loss(h_s: Any, w_s: Any, h_t: Any, w_t: Any, mask: Any, beta: float, temperature: float, num_items: Any,
         scale: float = 1.0, chunk: int = CHUNK) -> Any:  # fmt: skip
    """TRL's loss: the divergence summed over the tokens `mask` (N,) marks, divided by `num_items` (the step's
    targets over ranks and accumulation, as the engine divides its token loss), times `scale` (temperature^2 where
    DistillKit's convention is asked for)."""
    keep = mask.reshape(-1).nonzero().flatten()
    div = per_token(h_s[keep], w_s, h_t[keep], w_t, beta, temperature, chunk)
    return div.sum() * scale / num_items
