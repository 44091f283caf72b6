"""Mixture-of-experts models (Qwen3-MoE, Mixtral, DeepSeek-V3, gpt-oss): what a token computes, the
router's auxiliary loss normalised as the main loss is, and how evenly the experts are loaded.

- **Active parameters** (`active_params`): a token runs its top-k of E routed experts, so its FLOPs
  follow the parameters outside the routed experts plus k/E of theirs (shared experts whole). MFU
  counts those (6 N_active a token); counting every expert overstated it about E/k times (~9x for
  Qwen3-30B-A3B: 30.5B parameters, 3.3B active).
- **The router's auxiliary loss** (`output_router_logits: true` in the model's config): transformers
  adds `router_aux_loss_coef * aux` to each forward's loss, a mean over that forward's tokens. The
  main loss of a micro batch is its targets' summed loss over the step's per-micro share of targets
  (engine.py), so `router_loss` re-weights the auxiliary term by the micro batch's (or the shard's,
  under sequence parallelism) share of the step's targets: a step's auxiliary loss is then the
  target-weighted mean of its forwards', counted once, not once per shard and per micro batch.
- **Expert load** (`ExpertLoad`): where the model returns router logits, the tokens routed to each
  expert of each layer, summed over the log interval and every rank: max / mean per layer (1.0 is
  even; a collapsed router shows as E / k); under expert parallelism also each expert-parallel rank's
  share (`expert_rank_load`, its experts' tokens over the mean rank's: the all-to-all waits for the busiest).
"""

from __future__ import annotations

import re
from typing import Any

ROUTED = re.compile(r"(^|\.)experts\.")  # a routed expert's weights (shared experts are `shared_experts`)


def routing(cfg: Any) -> tuple[int, int] | None:
    """(experts per token, routed experts) from a transformers config, None for a dense model."""
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    k = getattr(cfg, "num_experts_per_tok", None)
    e = next((getattr(cfg, n) for n in ("num_experts", "num_local_experts", "n_routed_experts")
              if isinstance(getattr(cfg, n, None), int)), None)  # fmt: skip
    return (k, e) if isinstance(k, int) and isinstance(e, int) and 0 < k < e else None


def active_params(module: Any, cfg: Any) -> int | None:
    """Parameters a token runs through: all but the routed experts', plus k/E of those; None for a
    dense model (every parameter is active)."""
    found = routing(cfg) if cfg is not None else None
    if found is None:
        return None
    k, e = found
    seen: dict[int, tuple[str, int]] = {}
    for name, p in module.named_parameters():
        seen.setdefault(id(p), (name, p.numel()))
    routed = sum(n for name, n in seen.values() if ROUTED.search(name))
    if not routed:
        return None
    total = sum(n for _, n in seen.values())
    return int(total - routed + routed * k / e)


def router_loss(loss: Any, out: Any, coef: float | None, targets: Any, num_items: float | None) -> Any:
    """`loss` (transformers' main loss + coef x aux of this forward) with the auxiliary term weighted
    by this forward's share of the step's targets (`targets` / `num_items`, engine.py's denominator);
    unchanged where the model returned no auxiliary loss or every forward holds as many targets."""
    aux = getattr(out, "aux_loss", None)
    if aux is None or not coef or num_items is None:
        return loss
    return loss + coef * aux.to(loss.dtype) * (targets / num_items - 1)


class ExpertLoad:
    """Tokens routed to each expert of each layer since the last flush (on the device: no sync)."""

    def __init__(self, k: int, experts: int, ep: int = 1) -> None:
        # ep: expert parallelism's degree (AutoEP): rank r of an expert-parallel group holds experts
        # r * E / ep ... (r + 1) * E / ep - 1, whose tokens it receives by all-to-all
        self.k, self.experts, self.counts, self.ep = k, experts, None, ep

    def update(self, out: Any) -> None:
        import torch

        logits = getattr(out, "router_logits", None)
        if not logits:
            return
        rows = [
            torch.bincount(
                x.detach().reshape(-1, x.shape[-1]).topk(self.k, dim=-1).indices.reshape(-1),
                minlength=self.experts,
            )[: self.experts]  # fmt: skip
            for x in logits
            if x is not None
        ]
        if rows:
            now = torch.stack(rows).double()
            self.counts = now if self.counts is None else self.counts + now

    def flush(self, world_size: int) -> dict[str, Any]:
        """{expert_load: max / mean per layer, expert_load_worst: the largest}, over every rank (one
        all-reduce; every rank calls it); {} when no router logits came."""
        import torch.distributed as dist

        counts, self.counts = self.counts, None
        if counts is None:
            return {}
        if dist.is_initialized() and world_size > 1:
            dist.all_reduce(counts)
        ratio = (counts.max(dim=1).values / counts.mean(dim=1).clamp(min=1e-9)).tolist()
        out = {"expert_load": [round(r, 3) for r in ratio], "expert_load_worst": round(max(ratio), 3)}
        if self.ep > 1 and self.experts % self.ep == 0:
            # each expert-parallel rank's tokens (its experts' together) over the mean rank's, per layer then
            # averaged over the layers: 1.0 is even; the all-to-all waits for the busiest rank
            ranks = counts.reshape(counts.shape[0], self.ep, -1).sum(dim=2)
            share = (ranks / ranks.mean(dim=1, keepdim=True).clamp(min=1e-9)).mean(dim=0).tolist()
            out["expert_rank_load"] = [round(r, 3) for r in share]
        return out


def router(model: Any) -> tuple[float, Any] | None:
    """A mixture of experts whose config has output_router_logits: (its router_aux_loss_coef, an
    ExpertLoad); None otherwise (trainer/model/experts.py)."""
    cfg = getattr(model, "config", None)
    found = routing(cfg) if cfg is not None else None
    if found is None or not getattr(cfg.get_text_config(), "output_router_logits", False):
        return None
    return float(getattr(cfg.get_text_config(), "router_aux_loss_coef", 0.0) or 0.0), ExpertLoad(*found)
