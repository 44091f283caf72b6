"""The divergence to a teacher's top-k: its k most probable next tokens and their log-probabilities (computed live a
vocabulary chunk at a time, or read from the store `--prepare-teacher` wrote: trainer/objectives/teacher_store.py),
the rest of its distribution one bucket, as Arcee's DistillKit handles it (`train.distill.missing`):

- `zero` (DistillKit's default, ZERO): the teacher has no mass outside its top-k: its k probabilities renormalised to
  1; the student's mass outside them is one bucket the teacher gives 0 (its forward KL is the top-k's terms alone; at
  beta 1, the reverse KL, that bucket would be infinite: refused);
- `uniform` (DistillKit's SYMMETRIC_UNIFORM): the teacher's missing mass 1 - sum(top-k) and the student's outside the
  same k tokens are one bucket each (both spread alike over the rest): k + 1 outcomes a side.

The divergence over those k + 1 buckets is TRL's generalized JSD (trainer/objectives/divergence.py: beta 0 the forward
KL, 1 the reverse, between the JSD with the mixture (1 - beta) q + beta p); with k the whole vocabulary both buckets are
empty and it is the dense divergence (tested). The student's side is its logits at the k ids and its log-normaliser,
computed a chunk of the vocabulary at a time with its gradient (`_student_class`): no whole logits either.
"""

from __future__ import annotations

import math
from typing import Any

from trainer.config.distill_schema import CHUNK, TOKENS
from trainer.objectives.divergence import _chunks, _logits


def _blocks(n: int) -> list[tuple[int, int]]:
    return [(a, min(a + TOKENS, n)) for a in range(0, n, TOKENS)] or [(0, 0)]


def teacher_topk(h_t: Any, w_t: Any, k: int, temperature: float = 1.0, chunk: int = CHUNK) -> tuple[Any, Any]:
    """The teacher's k most probable next tokens (N, k) int64 and their log-probabilities at `temperature` (N, k)
    fp32, most probable first, from its last hidden states h_t (N, H) and LM head w_t (V, H): a chunk of the
    vocabulary at a time (the top-k kept so far merged with each chunk's)."""
    import torch

    inv_t, ids_out, logp_out = 1.0 / temperature, [], []
    with torch.no_grad():
        for a0, b0 in _blocks(h_t.shape[0]):
            h = h_t[a0:b0]
            lz = torch.full((h.shape[0],), -math.inf, device=h.device)
            best_v = torch.empty((h.shape[0], 0), device=h.device)
            best_i = torch.empty((h.shape[0], 0), dtype=torch.int64, device=h.device)
            for a, b in _chunks(w_t.shape[0], chunk):
                z = _logits(h, w_t, a, b, inv_t)
                lz = torch.logaddexp(lz, torch.logsumexp(z, -1))
                v, i = z.topk(min(k, b - a), dim=-1)
                best_v, at = torch.cat([best_v, v], -1).topk(min(k, best_v.shape[1] + v.shape[1]), dim=-1)
                best_i = torch.cat([best_i, i + a], -1).gather(-1, at)
            ids_out.append(best_i)
            logp_out.append(best_v - lz[:, None])
    return torch.cat(ids_out), torch.cat(logp_out)


def _student_class() -> Any:
    import torch

    class StudentAt(torch.autograd.Function):
        """The student's logits / T at the ids (N, k) and its log-normaliser (N,), from its hidden states h (N, H)
        and head w (V, H), a vocabulary chunk at a time; backward the same way (d lse / dz = softmax)."""

        @staticmethod
        def forward(ctx: Any, h: Any, w: Any, ids: Any, temperature: float, chunk: int) -> Any:
            inv_t, n = 1.0 / temperature, h.shape[0]
            lse = torch.full((n,), -math.inf, device=h.device)
            at = torch.zeros(ids.shape, dtype=torch.float32, device=h.device)
            rows = torch.arange(n, device=h.device)[:, None].expand_as(ids)
            with torch.no_grad():
                for a, b in _chunks(w.shape[0], chunk):
                    z = _logits(h, w, a, b, inv_t)
                    lse = torch.logaddexp(lse, torch.logsumexp(z, -1))
                    inside = (ids >= a) & (ids < b)
                    at[inside] = z[rows[inside], ids[inside] - a]
            ctx.save_for_backward(h, w, ids, lse)
            ctx.inv_t, ctx.chunk = inv_t, chunk
            return at, lse

        @staticmethod
        def backward(ctx: Any, g_at: Any, g_lse: Any) -> Any:
            h, w, ids, lse = ctx.saved_tensors
            inv_t = ctx.inv_t
            need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
            grad_h = torch.zeros(h.shape, dtype=torch.float32, device=h.device) if need_h else None
            grad_w = torch.zeros(w.shape, dtype=w.dtype, device=w.device) if need_w else None
            rows = torch.arange(h.shape[0], device=h.device)[:, None].expand_as(ids)
            g_at = g_at.float() if g_at is not None else torch.zeros(ids.shape, device=h.device)
            g_lse = g_lse.float() if g_lse is not None else torch.zeros(h.shape[0], device=h.device)
            for a, b in _chunks(w.shape[0], ctx.chunk):
                gz = (_logits(h, w, a, b, inv_t) - lse[:, None]).exp() * g_lse[:, None]
                inside = (ids >= a) & (ids < b)
                gz.index_put_((rows[inside], ids[inside] - a), g_at[inside], accumulate=True)
                gz = gz * inv_t
                if need_h:
                    grad_h += gz @ w[a:b].float()
                if need_w:
                    grad_w[a:b] = (gz.t() @ h.float()).to(w.dtype)
            return (grad_h.to(h.dtype) if need_h else None), grad_w, None, None, None

    return StudentAt


_CLASS: list[Any] = []


EPS = 1e-8  # the least mass a bucket of the rest holds (DistillKit's clamp): no infinite terms where it rounds to 0


def _rest(log_probs: Any) -> Any:
    """log(1 - sum of the probabilities), the mass at least EPS (where the sum rounds to 1 or above)."""
    import torch

    x = torch.logsumexp(log_probs, -1).clamp(max=math.log1p(-EPS))
    # each branch on inputs where it is finite: a where's other branch still has a gradient
    near = x > -math.log(2)
    low, high = torch.where(near, x, -math.log(2)), torch.where(near, -math.log(2), x)
    return torch.where(near, torch.log(-torch.expm1(low)), torch.log1p(-torch.exp(high)))


def _terms(log_a: Any, log_b: Any) -> Any:
    """sum over the last axis of a (log a - log b), 0 where a is 0."""
    import torch

    has = torch.isfinite(log_a)
    la = torch.where(has, log_a, torch.zeros_like(log_a))
    lb = torch.where(has, log_b, torch.zeros_like(log_b))
    return torch.where(has, la.exp() * (la - lb), torch.zeros_like(la)).sum(-1)


def buckets(at: Any, lse: Any, t_logp: Any, beta: float, missing: str) -> Any:
    """The divergence per token (N,) over the k + 1 buckets (module docstring), from the student's logits / T at the
    teacher's ids `at` (N, k), its log-normaliser `lse` (N,) and the teacher's top-k log-probabilities (N, k)."""
    import torch

    log_q = at - lse[:, None]
    log_q = torch.cat([log_q, _rest(log_q)[:, None]], -1)
    t_logp = t_logp.float()
    if missing == "uniform":
        log_p = torch.cat([t_logp, _rest(t_logp)[:, None]], -1)
    else:
        log_p = t_logp - torch.logsumexp(t_logp, -1, keepdim=True)
        log_p = torch.cat([log_p, torch.full_like(log_p[:, :1], -math.inf)], -1)
    if beta == 0:
        return _terms(log_p, log_q)
    if beta == 1:
        return _terms(log_q, log_p)
    log_m = torch.logaddexp(log_q + math.log1p(-beta), log_p + math.log(beta))
    return beta * _terms(log_p, log_m) + (1 - beta) * _terms(log_q, log_m)


def per_token(h_s: Any, w_s: Any, t_ids: Any, t_logp: Any, beta: float, temperature: float, missing: str,
              chunk: int = CHUNK) -> Any:  # fmt: skip
    """The divergence of each token's next-token distribution (N,) from the teacher's top-k (ids, log-probs)."""
    import torch

    if not _CLASS:
        _CLASS.append(_student_class())
    out = []
    for a, b in _blocks(h_s.shape[0]):
        ids = t_ids[a:b].long()
        at, lse = _CLASS[0].apply(h_s[a:b], w_s, ids, float(temperature), int(chunk))
        out.append(buckets(at, lse, t_logp[a:b], beta, missing))
    return torch.cat(out)
