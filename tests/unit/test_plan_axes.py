"""The model-parallel axes of the plan (trainer/strategy/planning/axes.py): what tensor parallelism (AutoTP) and expert
parallelism (AutoEP) divide, what they cost, when `auto` may take them, and what the DeepSpeed JSON says. The counts
are held to DeepSpeed's real shards on two ranks in tests/dist/test_axes.py."""

import dataclasses

import pytest
from helpers import TINY

from trainer import config, strategy
from trainer.common.errors import UserError
from trainer.strategy.planning.axes import axes_seconds, degrees, layout, local_info, tp_divided
from trainer.strategy.planning.candidates import Experts
from trainer.strategy.planning.hardware import machine

GiB = 2**30
# Llama-3-70B's shape (80 layers, hidden 8192, GQA 64/8, SwiGLU 28672, vocabulary 128,256) and Mixtral-8x7B's
L70 = strategy.ModelInfo(params=70_553_706_496, largest_layer=1_050_673_152, hidden=8192, layers=80, heads=64,
                         kv_heads=8, vocab=128256, positions=8192, attn_implementation="sdpa", model_type="llama",
                         intermediate=28672, idle=1_050_673_152)  # fmt: skip
L1 = strategy.ModelInfo(params=1_235_814_400, largest_layer=262_668_288, hidden=2048, layers=16, heads=32, kv_heads=8,
                        vocab=128256, positions=8192, attn_implementation="sdpa", model_type="llama",
                        intermediate=8192, tied=True)  # fmt: skip
MIXTRAL = strategy.ModelInfo(params=46_702_792_704, largest_layer=1_409_286_144, hidden=4096, layers=32, heads=32,
                             kv_heads=8, vocab=32000, positions=32768, attn_implementation="sdpa",
                             model_type="mixtral", intermediate=14336, active=12_879_925_248,
                             experts=Experts(routed=8, per_token=2, width=14336, layers=32), idle=131_072_000)  # fmt: skip


def plan(info, ranks=8, device=80 * GiB, host=2048 * GiB, gpu="h100", force=False, seq=4096, micro=1, **sets):
    overrides = [f"data.seq_len={seq}", f"train.micro_batch_size={micro}", "train.precision=bf16",
                 "model.config.n_positions=8192", "strategy.justification=", f"strategy.hardware.gpu={gpu}"]  # fmt: skip
    exp = config.load(TINY, overrides + [f"{k}={v}" for k, v in sets.items()])
    return strategy.plan(exp, info, world_size=ranks, gpus_per_node=min(ranks, 8), device_type="cuda",
                         device_memory=device, host_memory=host, precision="bf16", force=force)  # fmt: skip


def test_a_rank_of_a_tensor_parallel_group_holds_its_share_of_the_layers_and_the_head():
    """The layers' projections and the LM head divided, the rest (norms, the untied embedding) whole; a vocabulary
    that does not divide gives rank 0 a row more, as AutoTP does (257 as 129 and 128)."""
    whole = L70.params - tp_divided(L70)
    assert (
        whole == L70.vocab * L70.hidden + (2 * L70.layers + 1) * L70.hidden
    )  # the input embedding and the norms
    four = local_info(L70, tp=4)
    assert four.params == whole + tp_divided(L70) // 4
    assert (four.heads, four.kv_heads, four.intermediate) == (16, 2, 7168)
    odd = dataclasses.replace(L70, vocab=257, params=L70.params - (128256 - 257) * 8192 * 2)
    assert (
        local_info(odd, tp=2).params - (odd.params - tp_divided(odd) // 2) == 8192 // 2 * 1
    )  # half a row more


def test_a_rank_of_an_expert_parallel_group_holds_its_experts_only():
    experts = 32 * 8 * 3 * 4096 * 14336
    eight = local_info(MIXTRAL, ep=8)
    assert eight.params == MIXTRAL.params - experts * 7 // 8
    assert eight.active == MIXTRAL.active and eight.experts == MIXTRAL.experts  # a token's work is the same


def test_expert_parallelism_shrinks_what_every_rank_holds_whole_and_keeps_the_partitions():
    """ZeRO-2 on 8 ranks: the parameters every rank holds shrink from all experts to an eighth of them; the
    partitioned gradients and optimizer states stay those of the whole model over the world."""
    sets = {"strategy.zero_stage": 2, "strategy.offload": "none", "strategy.sequence_parallel": 1,
            "model.activation_checkpointing": "true", "model.chunked_loss": "false", "model.tiled_mlp": "false",
            "model.offload_activations": "false"}  # fmt: skip
    one = plan(MIXTRAL, force=True, **sets, **{"strategy.expert_parallel": 1})
    eight = plan(MIXTRAL, force=True, **sets, **{"strategy.expert_parallel": 8})
    a, b = one.estimate, eight.estimate
    assert b.params == pytest.approx(2 * local_info(MIXTRAL, ep=8).params, rel=1e-6)
    assert a.params == pytest.approx(2 * MIXTRAL.params, rel=1e-6)
    assert (b.grads, b.optimizer) == pytest.approx((a.grads, a.optimizer), rel=1e-6)
    assert "layout: dp 8 x tp 1 x ep 8 x sp 1" in strategy.describe_plan(eight)


def test_auto_offers_tensor_parallelism_only_to_a_large_model_over_nvlink_inside_a_node():
    """The seed's rule: very large models (ZeRO-0's states do not fit), NVLink-class links, inside a node; never
    to LoRA (refused), nor on a CPU run's links, nor to a 1B that fits at ZeRO-0."""
    exp = config.load(TINY, ["train.precision=bf16"])
    peers = {name: machine("cuda", config.load(TINY, [f"strategy.hardware.gpu={name}"]).strategy.hardware)[0].peers
             for name in ("h100", "l40s")}  # fmt: skip
    assert degrees(exp, L70, 8, 8, peers["h100"], "bf16", large=True)[0] == [1, 2, 4, 8]
    assert degrees(exp, L70, 8, 8, peers["l40s"], "bf16", large=True)[0] == [1]  # PCIe between the GPUs
    assert degrees(exp, L70, 8, 8, peers["h100"], "bf16", large=False)[0] == [1]
    assert degrees(exp, L70, 16, 8, peers["h100"], "bf16", large=True)[0] == [1, 2, 4, 8]  # never past a node
    assert degrees(exp, L70, 8, 4, peers["h100"], "bf16", large=True)[0] == [1, 2, 4]
    lora = config.load(TINY, ["train.precision=bf16", "model.lora={r: 8}"])
    assert degrees(lora, L70, 8, 8, peers["h100"], "bf16", large=True) == ([1], [1])
    cpu = machine("cpu", exp.strategy.hardware)[0].peers
    assert degrees(exp, L70, 2, 2, cpu, "bf16") == ([1], [1])
    assert degrees(exp, MIXTRAL, 8, 8, peers["h100"], "bf16")[1] == [1, 2, 4, 8]
    assert degrees(exp, MIXTRAL, 8, 8, peers["h100"], "fp32")[1] == [1]  # AutoEP trains in bf16


@pytest.mark.parametrize("seq", [2048, 8192])
def test_an_8b_on_16_h100s_takes_tensor_parallelism_only_where_it_is_the_fastest_that_fits(seq):
    """Llama-3-8B trained in full on 16 x 80 GB (two nodes), a global batch of 64 sequences (bench/plan_matrix.py's
    job, its counted shape): at 2k tokens tensor parallel 4 inside each node is estimated faster (the matrix's row:
    zero1 with tensor parallel 4, 9.0 against 11.4 us a token: a quarter of the gradients crosses the network);
    whatever it takes, auto is never slower than without the axis, and its reason names the setting without it."""
    from bench import plan_matrix

    l8 = plan_matrix.infos()[("8b", "full")]
    batch = {"train.global_batch_size": 64, "micro": 4}
    without = plan(l8, ranks=16, seq=seq, **batch, **{"strategy.tensor_parallel": 1})
    auto = plan(l8, ranks=16, seq=seq, **batch)
    assert auto.speed.per_token <= without.speed.per_token * (1 + 1e-9)
    if seq == 2048:
        assert auto.tp == 4 and auto.speed.per_token < without.speed.per_token and auto.dp_world == 4
        assert (
            "without tensor or expert parallelism or pipeline stages the fastest that fits is zero1"
            in auto.levers_reason
        )


def test_a_1b_on_8_h100s_stays_data_parallel():
    assert plan(L1).tp == 1


def test_the_collectives_are_priced_on_the_links():
    """AutoTP's two all-reduces a layer and pass over the node's link, AutoEP's all-to-alls past a node over the
    network: a slower link, a longer step."""
    h100 = machine("cuda", config.load(TINY, ["strategy.hardware.gpu=h100"]).strategy.hardware)[0]
    slow = dataclasses.replace(h100, peers=h100.peers / 10, network=h100.network / 10)
    for tp, ep, info in ((4, 1, L70), (1, 8, MIXTRAL)):
        fast_s = axes_seconds(info, tp, ep, 4096, 2, 2, h100, 8)
        assert 0 < fast_s < axes_seconds(info, tp, ep, 4096, 2, 2, slow, 8)
    assert axes_seconds(MIXTRAL, 1, 8, 4096, 2, 2, h100, 4) > axes_seconds(MIXTRAL, 1, 8, 4096, 2, 2, h100, 8)


def test_a_pinned_degree_that_cannot_run_names_the_key_and_the_fix():
    with pytest.raises(
        UserError, match=r"strategy.tensor_parallel: 3 cannot run this job: the model's 64 attention"
    ):
        plan(L70, ranks=3, **{"strategy.tensor_parallel": 3})
    with pytest.raises(
        UserError, match=r"strategy.expert_parallel: 3 .* 8 experts a layer do not divide by 3"
    ):
        plan(MIXTRAL, ranks=3, **{"strategy.expert_parallel": 3})


def test_the_deepspeed_json_carries_the_degrees_and_a_template_must_agree():
    exp = config.load(
        TINY, ["train.precision=bf16", "strategy.tensor_parallel=4", "strategy.justification=x"]
    )
    p = plan(L70, host=8192 * GiB, **{"strategy.tensor_parallel": 4})  # zero2+cpu: ZeRO-3 is refused under TP
    d = strategy.ds_config(exp, p, L70, {})
    assert d["tensor_parallel"] == {"autotp_size": 4} and "expert_parallel" not in d
    assert (
        d["train_batch_size"] == exp.train.micro_batch_size * 2 * exp.train.grad_accum
    )  # 8 / 4 data-parallel
    with pytest.raises(UserError, match="template says 2, the experiment says 4"):
        strategy.ds_config(exp, p, L70, {"tensor_parallel": {"autotp_size": 2}}, "t.json")
    m = plan(MIXTRAL, **{"strategy.expert_parallel": 8})
    d = strategy.ds_config(exp, m, MIXTRAL, {})
    assert d["expert_parallel"] == {"enabled": True, "autoep_size": 8}


def test_the_escalation_keeps_the_degree_and_says_it_in_its_overrides():
    from trainer.strategy.planning.levers import Levers

    lv = Levers(tp=4, checkpointing=True)
    assert (
        "strategy.tensor_parallel=4" in lv.overrides()
        and "model.activation_checkpointing=true" in lv.overrides()
    )
    assert not Levers(tp=2, checkpointing=True).covers(
        Levers(tp=4)
    )  # never another degree than the failed one's
    assert lv.describe() == "activation checkpointing, tensor parallel 4"


def test_the_layout_names_the_groups():
    assert (
        layout(8, tp=4)
        == "dp 2 x tp 4 x ep 1 x sp 1 (tensor-parallel groups [0,1,2,3], [4,5,6,7]; data-parallel groups [0,4], [1,5], [2,6], [3,7])"
    )  # noqa: E501
    assert layout(2) == "dp 2 x tp 1 x ep 1 x sp 1"
    # 3D (DeepSpeed's pipe-data-model topology: rank = stage x (dp x tp) + data x tp + tensor rank)
    assert layout(8, tp=2, pp=2) == (
        "dp 2 x tp 2 x pp 2 x ep 1 x sp 1 (pipelines [0,4], [1,5], [2,6], [3,7]; data-parallel groups (a stage's) "
        "[0,2], [1,3], [4,6], [5,7]; tensor-parallel groups (a stage's) [0,1], [2,3], [4,5], [6,7])"
    )
    assert layout(16, ep=8).startswith(
        "dp 16 x tp 1 x ep 8 x sp 1 (expert-parallel groups [0,1,2,3,4,5,6,7], [8,"
    )


def test_tensor_parallelism_never_takes_the_tiled_loss():
    """Review of issue 70: the tiled loss multiplies by AutoTP's vocabulary shard of the LM head and looked its
    targets up in the whole vocabulary (every rank stopped at the first step). On CPU in bf16 the tiled loss is
    on by default; under a pinned tensor parallelism it is off, pinned on it is refused."""
    from trainer.strategy.planning.levers import lever_sets

    tiny_llama = dataclasses.replace(L70, params=10_000_000, largest_layer=1_000_000)
    exp = config.load(
        TINY, ["train.precision=bf16", "strategy.tensor_parallel=2", "strategy.justification=x"]
    )
    sets = list(lever_sets(exp, tiny_llama, 2, "cpu", "bf16", ([2], [1])))
    assert sets and not any(s.chunked_loss for s in sets)
    auto = list(
        lever_sets(config.load(TINY, ["train.precision=bf16"]), tiny_llama, 8, "cuda", "bf16", ([1, 2], [1]))
    )
    assert any(s.tp == 2 for s in auto) and not any(s.tp == 2 and s.chunked_loss for s in auto)
    pinned = config.load(TINY, ["train.precision=bf16", "model.chunked_loss=true"])
    with pytest.raises(
        UserError, match="model.chunked_loss: the tiled loss multiplies by the LM head's weight"
    ):
        list(lever_sets(pinned, tiny_llama, 2, "cpu", "bf16", ([2], [1])))


def test_a_cpu_run_is_never_offered_the_axes_whatever_its_links():
    """Review of issue 70: `strategy.hardware.peer_gbs: 500` on a CPU run made auto take tensor parallelism."""
    exp = config.load(TINY, ["train.precision=bf16"])
    assert degrees(exp, L70, 8, 8, 500e9, "bf16", large=True, device_type="cpu") == ([1], [1])
    assert degrees(exp, L70, 8, 8, 500e9, "bf16", large=True, device_type="cuda")[0] == [1, 2, 4, 8]


def test_zero3_is_refused_under_tensor_parallelism_with_the_measured_reason():
    """It trains, but DeepSpeed 0.19.8 cannot read its tensor-parallel checkpoints back (review of issue 70)."""
    p = plan(L70, host=8192 * GiB, **{"strategy.tensor_parallel": 4})
    assert all(
        e.refused.startswith("tensor parallelism at ZeRO-3") for e in p.estimates if e.candidate.stage == 3
    )
    assert p.candidate.stage != 3


@pytest.mark.parametrize(
    ("src", "dst", "stages", "convert", "refused"),
    [
        ((2, 1), (2, 1), (1, 1), False, None),  # as saved: loads as saved
        ((2, 1), (2, 1), (3, 3), False, None),  # as saved at ZeRO-3 too: no conversion
        (
            (2, 1),
            (1, 1),
            (1, 2),
            True,
            None,
        ),  # another degree between stages 1 and 2: the universal checkpoint
        ((1, 1), (2, 1), (2, 1), False, None),
        ((2, 1), (2, 1), (0, 1), True, "converts only between ZeRO stages 1 and 2"),  # the review's case A
        ((2, 1), (1, 1), (1, 0), True, "converts only between ZeRO stages 1 and 2"),  # case B
        ((2, 1), (1, 1), (3, 3), True, "converts only between ZeRO stages 1 and 2"),  # case C
        ((2, 1), (2, 1), (3, 1), True, "converts only between ZeRO stages 1 and 2"),
        ((1, 2), (1, 1), (1, 1), True, "was saved at expert parallel 2, and this run is at 1"),
        ((1, 1), (1, 1), (0, 3), True, None),  # nothing sharded: the stage-0 and ZeRO-3 conversions as ever
    ],
)
def test_a_resume_across_the_axes_converts_only_what_deepspeed_can_read(
    tmp_path, src, dst, stages, convert, refused
):
    from trainer.checkpoint.reshard import ResumeError, axes_change

    if refused is None:
        said = axes_change(tmp_path, src, dst, stages, convert)
        assert ("the model-parallel degrees change" in said) == (src != dst)
    else:
        with pytest.raises(ResumeError, match=refused):
            axes_change(tmp_path, src, dst, stages, convert)


def test_qwen2s_query_key_and_value_biases_are_divided_with_their_projections():
    """Review of issue 70: a Qwen2 rank of tensor parallel 2 held 62,016 parameters (measured on 2 CPU ranks), the
    plan counted 62,144: AutoTP divides the q/k/v biases (128 a layer here) with their projections."""
    from trainer.config.schema import ModelSection
    from trainer.model.create import info as count

    cfg = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}  # fmt: skip
    qwen2 = count(ModelSection(config=cfg, attn_implementation="sdpa"), vocab_size=257)
    assert qwen2.qkv_bias == 64 + 32 + 32 and local_info(qwen2, tp=2).params == 62_016
