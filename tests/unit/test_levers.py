"""The second axis of the plan (trainer/strategy/planning/levers.py, activations.py, ladder.py,
longest.py): activation levers (sequence parallelism, the tiled loss and MLP, checkpointing, host
copies) counted per rank, tried cheapest first before the next ZeRO rung."""

import dataclasses

import pytest
from helpers import TINY

from trainer import config, strategy
from trainer.common.errors import UserError
from trainer.strategy.planning.levers import Levers, lever_sets, sp_problem
from trainer.strategy.planning.longest import longest_sequence

GiB = 2**30
# A Llama-3-8B shape: hidden 4096, 32 layers, GQA 32/8, SwiGLU 14336, vocabulary 128,256
L8 = strategy.ModelInfo(params=8_030_261_248, largest_layer=525_336_576, hidden=4096, layers=32, heads=32,
                        kv_heads=8, vocab=128256, positions=1 << 20, attn_implementation="sdpa", model_type="llama",
                        intermediate=14336)  # fmt: skip


def plan(info=L8, ranks=8, seq=32768, device=80 * GiB, host=1024 * GiB, **sets):
    overrides = [f"data.seq_len={seq}", "train.micro_batch_size=1", "train.precision=bf16",
                 "model.config.n_positions=1048576", "strategy.justification="]  # fmt: skip
    exp = config.load(TINY, overrides + [f"{k}={v}" for k, v in sets.items()])
    return strategy.plan(exp, info, world_size=ranks, gpus_per_node=min(ranks, 8), device_type="cuda",
                         device_memory=device, host_memory=host, precision="bf16")  # fmt: skip


def test_an_8b_model_at_32k_tokens_on_8_gpus_fits_with_sequence_parallelism():
    """The issue's case: every ZeRO rung refused it (the activations alone over 80 GB); one lever,
    Ulysses over the 8 ranks, brings the activations under the budget and zero2 fits; the table and
    the reason say which lever and why."""
    with pytest.raises(UserError, match="nothing fits"):
        plan(**{"strategy.sequence_parallel": 1, "model.activation_checkpointing": "false", "model.tiled_mlp": "false",
                "model.chunked_loss": "false", "model.offload_activations": "false"})  # fmt: skip
    p = plan()
    assert p.levers == Levers(sp=8) and p.candidate.name == "zero1" and p.dp_world == 1
    assert (
        "the fastest setting that fits" in p.levers_reason and "274.60 GB of activations" in p.levers_reason
    )
    assert "activation levers: sequence parallel 8" in strategy.describe_plan(p)


def test_sequence_parallelism_divides_the_activations_and_adds_the_all_to_all_buffers():
    """Every per-token term over seq/sp tokens (the whole logits too); the tiled loss's chunk and the
    head's gradient stay whole; one layer's attention over the whole sequence adds 8 contexts (its
    all-to-all buffers and the sdpa core's backward: tests/unit/test_sequence.py measures them)."""
    one = strategy.activations(L8, 1, 32768, 2, False)
    eight = strategy.activations(L8, 1, 32768, 2, False, sp=8)
    buffers = 8 * 32768 / 8 * 4096 * 2  # contexts of bf16 values: the rank's 1/8 of the heads, every token
    assert eight == pytest.approx(one / 8 + buffers, rel=1e-6)


def test_the_tiled_mlp_keeps_the_mlps_input_instead_of_its_intermediates():
    whole = strategy.activations(L8, 1, 8192, 2, False, True)
    tiled = strategy.activations(L8, 1, 8192, 2, False, True, tiled_mlp=True)
    # 8I of 2-byte values a token and layer (gate, silu, up, product) are not kept; the MLP's input is kept either
    # way (the norm's output the projections read is the tensor the tiled MLP keeps)
    assert whole - tiled == pytest.approx(8192 * 32 * 8 * 14336, rel=1e-6)


def test_offloaded_checkpoints_keep_two_layer_inputs_on_the_device_and_the_rest_on_the_host():
    ckpt = strategy.activations(L8, 1, 8192, 2, True, True)
    off = strategy.activations(L8, 1, 8192, 2, True, True, offload=True)
    assert ckpt - off == pytest.approx(2 * 8192 * 4096 * 30, rel=1e-6)  # 30 of 32 layer inputs leave
    p = plan(seq=262144, ranks=1)
    assert p.levers.offload and p.estimate.host > 32 * 2 * 262144 * 4096  # counted in host memory


def test_levers_are_tried_cheapest_first_and_the_experiment_fixes_what_it_sets():
    exp = config.load(TINY, ["model.config.n_positions=4096"])
    order = list(lever_sets(exp, L8, 8, "cuda"))
    assert order[0] == Levers() and order[1] == Levers(chunked_loss=True)
    assert [len(x.on) for x in order] == sorted(len(x.on) for x in order)  # fewest levers first
    assert all(x.checkpointing for x in order if x.offload)  # host copies are of checkpointed activations
    assert {x.sp for x in order} == {1, 2, 4, 8}
    fixed = config.load(TINY, ["strategy.sequence_parallel=1", "model.activation_checkpointing=true"])
    assert all(x.sp == 1 and x.checkpointing for x in lever_sets(fixed, L8, 8, "cuda"))
    assert not any(x.offload for x in lever_sets(exp, L8, 8, "cpu"))  # no host copies on a CPU run


@pytest.mark.parametrize(
    ("sp", "ranks", "heads", "kv", "seq", "attn", "why"),
    [
        (2, 3, 32, 8, 1024, "sdpa", "rank(s) are not a multiple of 2"),
        (3, 3, 32, 8, 1023, "sdpa", "attention heads do not divide by 3"),
        (4, 4, 12, 6, 1024, "sdpa", "divide neither way"),
        (4, 4, 32, 8, 1026, "sdpa", "does not divide by 4"),
        (2, 2, 32, 8, 1024, "eager", "eager attention"),
    ],
)
def test_sequence_parallelism_refuses_what_ulysses_cannot_split(sp, ranks, heads, kv, seq, attn, why):
    info = strategy.ModelInfo(params=1, largest_layer=1, heads=heads, kv_heads=kv)
    assert why in sp_problem(info, sp, ranks, seq, attn)
    assert (
        sp_problem(strategy.ModelInfo(params=1, largest_layer=1, heads=32, kv_heads=2), 8, 8, 1024, "sdpa")
        is None
    )


def test_the_longest_sequence_on_one_h100():
    """--plan --max-seq-len for the 8B on one 80 GB GPU with 1 TB of host memory: every lever and
    rung: about half a million tokens (ALST reports 500K on one H100), and more with 8 GPUs."""
    exp = config.load(
        TINY, ["model.config.n_positions=1048576", "train.micro_batch_size=1", "train.precision=bf16"]
    )
    kw = {"gpus_per_node": 1, "device_type": "cuda", "device_memory": 80 * GiB, "host_memory": 1024 * GiB,
          "precision": "bf16"}  # fmt: skip
    one, p = longest_sequence(exp, L8, world_size=1, **kw)
    assert 400_000 < one < 700_000 and p.candidate.name == "zero3+cpu" and p.levers.checkpointing
    wide = strategy.ModelInfo(**{**L8.__dict__, "positions": 1 << 23})
    eight, p8 = longest_sequence(exp, wide, world_size=8, **{**kw, "gpus_per_node": 8})
    assert eight > 2 * one and p8.levers.sp == 8


def test_the_run_time_escalation_climbs_the_rungs_then_the_levers():
    p = plan(info=strategy.ModelInfo(params=10**6, largest_layer=10**5, hidden=64, layers=2, heads=4, vocab=96,
                                     model_type="llama"),
             seq=256, ranks=2, **{"strategy.zero_stage": 3, "strategy.offload": "none",
                                  "strategy.justification": "test"})  # fmt: skip
    assert p.candidate.name == "zero3" and p.levers == Levers()
    levers, nxt = p.next_after()
    assert nxt.name == "zero3" and levers == Levers(chunked_loss=True)  # the pinned rung, the next lever


def test_the_longest_sequence_at_each_sequence_parallel_degree():
    """--plan --max-seq-len under sequence_parallel: auto: a line for each degree the 8 ranks and the
    heads allow, each longer than the one before until the model's positions end it."""
    from trainer.strategy.planning.longest import per_degree

    exp = config.load(
        TINY, ["model.config.n_positions=1048576", "train.micro_batch_size=1", "train.precision=bf16"]
    )
    kw = {"world_size": 8, "gpus_per_node": 8, "device_type": "cuda", "device_memory": 80 * GiB,
          "host_memory": 1024 * GiB, "precision": "bf16"}  # fmt: skip
    lines = per_degree(exp, L8, kw)
    assert lines[0] == "longest sequence at each sequence-parallel degree (8 rank(s)):"
    assert [x.split()[2] for x in lines[1:]] == ["1", "2", "4", "8"]
    seqs = [int(x.split()[3].replace(",", "")) for x in lines[1:]]
    assert 300_000 < seqs[0] < seqs[1] < seqs[2] <= seqs[3] == 1_048_576
    assert "the model's positions end there" in lines[-1]
    fixed = config.load(TINY, ["strategy.sequence_parallel=2"])
    assert per_degree(fixed, L8, kw) == []  # the experiment's own degree: the one answer below


def test_the_run_time_escalation_never_gives_up_a_rung_or_a_lever():
    """After the last rung without levers comes the cheapest lever on that rung, not zero0 with it:
    each attempt holds no more than the one that ran out of memory by the plan and keeps what it moved off
    the device (zero2+cpu, a lower stage than zero3, is passed over), and NVMe without a path is skipped."""
    info = strategy.ModelInfo(params=10**6, largest_layer=10**5, hidden=64, layers=2, heads=4, vocab=96,
                              model_type="llama")  # fmt: skip
    p = plan(info=info, seq=256, ranks=2, **{"strategy.justification": "test"})
    assert p.candidate.name == "zero0" and p.levers == Levers()
    seen = []
    while (after := p.next_after()) is not None:
        seen.append((after[0].describe(), after[1].name))
        p = dataclasses.replace(p, levers=after[0], candidate=after[1])
    assert seen == [
        ("none", "zero1"), ("none", "zero2"), ("none", "zero3"), ("none", "zero3+cpu (optimizer only)"),
        ("none", "zero3+cpu"),
        ("tiled loss", "zero3+cpu"),
        ("tiled loss, tiled MLP", "zero3+cpu"), ("tiled loss, tiled MLP, sequence parallel 2", "zero3+cpu"),
        ("tiled loss, tiled MLP, sequence parallel 2, activation checkpointing", "zero3+cpu"),
        ("tiled loss, tiled MLP, sequence parallel 2, activation checkpointing, checkpointed activations on the host",
         "zero3+cpu"),
    ]  # fmt: skip


def test_a_mixture_of_experts_mlp_is_never_tiled():
    """Review of issue 68: with the experts' activations counted, the plan took the tiled MLP for Qwen3-MoE and
    Mixtral jobs, which crash at the first backward (DeepSpeed's TiledMLP calls the block on 2-D shards, which
    their blocks cannot unpack; gpt-oss's block returns a tuple). auto never tries it for a mixture of experts;
    true is refused with the reason, before any process starts."""
    from trainer.strategy.planning.candidates import Experts

    moe = dataclasses.replace(
        L8, experts=Experts(routed=8, per_token=2, width=14336, layers=32), intermediate=None
    )
    exp = config.load(TINY, ["model.config.n_positions=4096"])
    assert not any(x.tiled_mlp for x in lever_sets(exp, moe, 8, "cuda"))
    assert any(x.tiled_mlp for x in lever_sets(exp, L8, 8, "cuda"))
    pinned = config.load(TINY, ["model.config.n_positions=4096", "model.tiled_mlp=true"])
    with pytest.raises(UserError, match=r"model.tiled_mlp: .*mixture of experts.*set model.tiled_mlp: false"):
        list(lever_sets(pinned, moe, 8, "cuda"))
