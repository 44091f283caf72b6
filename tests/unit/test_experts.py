"""Mixture-of-experts models (trainer/model/experts.py): MFU counts the parameters a token runs
through (its top-k experts), the router's auxiliary loss is weighted as the main loss is (counted
once a step, not once per sequence-parallel shard and micro batch), and the experts' load is logged."""

import dataclasses

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from trainer import config, model
from trainer.engine import plain_loss, sequence_parallel_loss, target_count
from trainer.model.experts import ExpertLoad, active_params, router, router_loss
from trainer.strategy import describe_params, flops_per_token

# Qwen3-30B-A3B's shape (its config.json): published as 30.5B parameters, 3.3B activated
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                 "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936, "tie_word_embeddings": False,
                 "max_position_embeddings": 40960, "decoder_sparse_step": 1, "mlp_only_layers": []}  # fmt: skip


def test_mfu_counts_the_parameters_a_token_runs_through():
    """Qwen3-30B-A3B: 30.53B parameters, 3.35B a token runs through (its 8 of 128 experts); MFU's 6N
    was the 30.5B, ~9x too high. A dense model has no separate count."""
    exp = config.load(
        "configs/experiments/tiny.yaml", [f"model.config={__import__('json').dumps(QWEN3_30B_A3B)}"]
    )
    info = model.info(exp.model, None, None)
    assert info.params == pytest.approx(30.53e9, rel=1e-3) and info.active == pytest.approx(3.353e9, rel=1e-3)
    assert "3,353,032,704 active a token" in describe_params(info)
    whole = flops_per_token(dataclasses.replace(info, active=None), 4096)
    active = flops_per_token(info, 4096)
    assert whole / active > 6  # the attention term is the same on both sides
    dense = config.load("configs/experiments/tiny.yaml", [])
    assert model.info(dense.model, 257, 256).active is None


def tiny_moe(**kw):
    cfg = AutoConfig.for_model("qwen3_moe", hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                               num_experts=4, num_experts_per_tok=2, vocab_size=97, output_router_logits=True,
                               router_aux_loss_coef=0.5, **kw)  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).float()


def test_the_routers_auxiliary_loss_is_weighted_by_the_forwards_share_of_targets():
    """A forward's loss is its targets' summed loss over the step's per-forward share (num_items); the
    auxiliary loss (a mean over the forward's tokens) is weighted by the forward's targets / num_items,
    so that a step's auxiliary loss is its forwards' target-weighted mean: under sequence parallelism
    the shards' weights add up to one (it was added once per shard: 2x at sequence parallel 2)."""
    m = tiny_moe()
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    coef, load = router(m)
    assert coef == 0.5 and isinstance(load, ExpertLoad)
    out = m(input_ids=ids, labels=ids, use_cache=False)
    main = out.loss - coef * out.aux_loss
    assert router_loss(out.loss, out, coef, torch.tensor(30), 60.0).item() == pytest.approx(
        (main + coef * out.aux_loss * 0.5).item()
    )
    assert router_loss(out.loss, out, coef, torch.tensor(30), None) is out.loss  # blocks: every forward alike

    from trainer.model.sequence import shard

    weights = []
    for rank in (0, 1):  # sequence parallel 2, token blocks: num_items = the row's positions, 2 x 15
        got = sequence_parallel_loss(m, ids, None, 2, rank, False, (coef, load))
        x, pos, shifted = shard(ids, 2, rank)
        o = m(input_ids=x, position_ids=pos, labels=shifted, shift_labels=shifted, num_items_in_batch=30.0,
              use_cache=False)  # fmt: skip
        weights.append(((got - (o.loss - coef * o.aux_loss)) / (coef * o.aux_loss)).item())
    assert weights == pytest.approx([16 / 30, 14 / 30], rel=1e-5) and sum(weights) == pytest.approx(
        1.0, rel=1e-5
    )
    counted = load.flush(1)
    assert len(counted["expert_load"]) == 2 and all(r >= 1 for r in counted["expert_load"])


def test_expert_load_counts_each_tokens_top_k_per_layer():
    m = tiny_moe()
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(2))
    load = ExpertLoad(2, 4)
    out = plain_loss(m, ids, None, (0.5, load))
    assert torch.isfinite(out)
    counts = load.counts
    assert (
        counts.shape == (2, 4) and counts.sum(dim=1).tolist() == [2 * 16 * 2] * 2
    )  # tokens x top-k, per layer
    flushed = load.flush(1)
    want = (counts.max(dim=1).values / counts.mean(dim=1)).tolist()
    assert flushed["expert_load"] == [round(x, 3) for x in want] and load.counts is None
    assert target_count(ids) == 2 * 15
    assert active_params(m, m.config) < sum(p.numel() for p in m.parameters())


def test_the_eval_loss_of_a_mixture_of_experts_leaves_the_auxiliary_loss_out():
    """Eval (engine.eval_loss passes the router without its load counter): transformers' loss less the
    auxiliary term, so eval loss and perplexity are the LM's; no expert load is counted."""
    from trainer.engine import _with_router

    m = tiny_moe()
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(3))
    out = m(input_ids=ids, labels=ids, use_cache=False)
    got = _with_router(out, (0.5, None), torch.tensor(30), 1.0)
    assert got.item() == pytest.approx((out.loss - 0.5 * out.aux_loss).item())
    plain = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 97), ids[:, 1:].reshape(-1))
    assert got.item() == pytest.approx(plain.item(), rel=1e-5)


def test_expert_parallel_ranks_load_is_each_ranks_experts_tokens_over_the_mean_ranks():
    """Under expert parallel 2 rank 0 holds experts 0-1 and rank 1 experts 2-3 (AutoEP's consecutive split): a layer
    routing 30 tokens to rank 0's experts and 10 to rank 1's gives shares 1.5 and 0.5; averaged over the layers."""
    load = ExpertLoad(2, 4, ep=2)
    load.counts = torch.tensor([[20.0, 10.0, 5.0, 5.0], [10.0, 10.0, 10.0, 10.0]])
    got = load.flush(1)
    assert got["expert_rank_load"] == [round((1.5 + 1.0) / 2, 3), round((0.5 + 1.0) / 2, 3)]
    load.counts = torch.ones(2, 4)
    assert "expert_rank_load" not in ExpertLoad(2, 4).flush(1) and "expert_rank_load" in load.flush(1)
