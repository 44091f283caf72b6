"""Tensor parallelism (DeepSpeed's AutoTP) and expert parallelism (AutoEP) through bin/train on 2 CPU ranks (real
launchers, gloo), each against the same global batch without it:

- tensor parallel 2 (one data-parallel rank of micro 2, both ranks on the same rows) against tensor parallel 1 on
  one rank (micro 2): the first step's gradients (every parameter's, gathered whole: TRAINER_DEBUG_GRADS) and the
  per-step losses, on packed chat data, fp32, gradient clipping on, for a grouped-query Llama at ZeRO-1 and a
  Qwen3 of its own head size with tied embeddings at ZeRO-2; each rank holds the shards the plan counts (axes.py:
  what AutoTP divides), measured;
- expert parallel 2 (two data-parallel ranks of micro 1, each holding 2 of 4 experts a layer) against expert
  parallel 1 on the same 2 ranks, bf16, a tiny Mixtral and a tiny Qwen3-MoE: the losses within bf16's rounding;
- a checkpoint saved under tensor parallel 2 resumes at 2 bit for bit.
"""

import re

import pytest
import torch
from helpers import chat_data, export_differences, train

pytestmark = pytest.mark.dist

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}  # fmt: skip
# its own head size (4 x 32 where hidden / heads is 16), its embedding tied to the head (AutoTP divides both together)
QWEN3 = {**LLAMA, "model_type": "qwen3", "head_dim": 32, "tie_word_embeddings": True}
# the router's auxiliary loss on: each expert's and each expert-parallel rank's load logged
MIXTRAL = {**LLAMA, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2,
           "output_router_logits": True}  # fmt: skip
QWEN3_MOE = {**QWEN3, "tie_word_embeddings": False, "model_type": "qwen3_moe", "moe_intermediate_size": 32,
             "num_experts": 4, "num_experts_per_tok": 2}  # fmt: skip
K = 3  # a checkpoint at step K of 2K
# AutoEP's precision; rows unpacked (the router's auxiliary loss, on for Mixtral, mixes a packed row's examples)
BF16 = {"train.precision": "bf16", "model.chunked_loss": False, "data.packing": False}


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    return chat_data(tmp_path_factory.mktemp("axes") / "chat.jsonl", rows=120)


def sets(chat, config, micro, **kw):
    return {
        "model.config": config, "model.attn_implementation": "sdpa", "data.train.files": str(chat),
        "data.train.kind": "chat", "data.seq_len": 128, "data.eval_fraction": 0, "data.num_workers": 0,
        "train.micro_batch_size": micro, "train.max_steps": 2 * K, "train.log_every": 1, "train.eval_every": 0,
        "train.eval_prompts": [], "train.grad_clip": 1.0, "strategy.zero_stage": 1, "strategy.justification": "test",
        "checkpoint.every_steps": K, "checkpoint.save_final": False, "checkpoint.async": False, **kw,
    }  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory, chat):
    made = {}

    def run(name, config, micro, launcher="torchrun", nproc=2, **kw):
        if name not in made:
            tmp = tmp_path_factory.mktemp(name)
            made[name] = train(tmp, sets(chat, config, micro, **kw), launcher=launcher, nproc=nproc,
                               env={"TRAINER_DEBUG_GRADS": "1"})  # fmt: skip
        return made[name]

    return run


def grads(r):
    return torch.load(r.debug_dir / "grads_step1.pt")


def worst_gradient(a, b):
    ga, gb = grads(a), grads(b)
    assert ga.keys() == gb.keys() and len(ga) > 10
    for k in ga:
        assert ga[k].shape == gb[k].shape, (k, ga[k].shape, gb[k].shape)
    return max(((ga[k] - gb[k]).abs().max() / ga[k].abs().max().clamp_min(1e-30)).item() for k in ga)


def held(run, config, tp, ep):
    """The parameters rank 0 holds (the preflight's count after AutoTP or AutoEP divided the model) are the plan's
    one-rank model (trainer/strategy/planning/axes.py's local_info), to the parameter."""
    from trainer.config.schema import ModelSection
    from trainer.model.create import info as count
    from trainer.strategy.planning.axes import local_info

    measured = int(re.search(r"rank 0 holds ([\d,]+) parameters", run.output)[1].replace(",", ""))
    total = int(re.search(r"model: ([\d,]+) parameters", run.output)[1].replace(",", ""))
    section = ModelSection(config=config, attn_implementation="sdpa")
    info = next(i for v in range(256, 264) if (i := count(section, vocab_size=v)).params == total)
    print(
        f"rank 0 holds {measured:,} of {info.params:,} parameters; the plan counts {local_info(info, tp, ep).params:,}"
    )
    assert local_info(info, tp, ep).params == measured


@pytest.mark.parametrize(("family", "stage"), [("llama", 1), ("qwen3", 2)])
def test_tensor_parallel_2_trains_as_1_on_the_same_global_batch(runs, family, stage):
    """At ZeRO-1 (a grouped-query Llama) and ZeRO-2 (a Qwen3 of its own head size, its embedding tied), against one
    rank. (ZeRO-3 trains as well, but DeepSpeed cannot read its tensor-parallel checkpoints back: refused.)"""
    config = {"llama": LLAMA, "qwen3": QWEN3}[family]
    at = {"strategy.zero_stage": stage}
    ref = runs(f"{family}-tp1", config, 2, launcher="none", **at, **{"strategy.tensor_parallel": 1})
    tp = runs(f"{family}-tp2", config, 2, **at, **{"strategy.tensor_parallel": 2})
    assert "tensor parallel 2 (data-parallel world 1)" in tp.output, tp.output[-3000:]
    assert "layout: dp 1 x tp 2 x ep 1 x sp 1 (tensor-parallel groups [0,1]" in tp.output
    held(tp, config, 2, 1)
    worst = worst_gradient(ref, tp)
    print(f"{family}: largest gradient difference {worst:.1e} of the gradient's largest value")
    assert worst <= 1e-5
    assert ref.losses.keys() == tp.losses.keys() == set(range(1, 2 * K + 1))
    for step, loss in ref.losses.items():
        assert tp.losses[step] == pytest.approx(loss, rel=1e-6), (family, step)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_expert_parallel_2_trains_as_1_in_bf16(runs, family):
    """Two data-parallel ranks of micro 1 either way; under expert parallel 2 each holds 2 of a layer's 4 experts
    and the routed tokens cross by all-to-all. bf16 (AutoEP's), so within its rounding over the steps."""
    config = {"mixtral": MIXTRAL, "qwen3_moe": QWEN3_MOE}[family]
    bf16 = BF16
    ref = runs(f"{family}-ep1", config, 1, **bf16, **{"strategy.expert_parallel": 1})
    ep = runs(f"{family}-ep2", config, 1, **bf16, **{"strategy.expert_parallel": 2})
    assert "expert parallel 2" in ep.output and "expert-parallel groups [0,1]" in ep.output, ep.output[-3000:]
    held(ep, config, 1, 2)
    assert ref.losses.keys() == ep.losses.keys() == set(range(1, 2 * K + 1))
    worst = max(abs(ep.losses[s] - loss) / loss for s, loss in ref.losses.items())
    print(f"{family}: largest loss difference {worst:.1e} relative")
    assert worst <= 2e-3
    if (
        family == "mixtral"
    ):  # router logits on: each expert-parallel rank's share of the routed tokens, logged
        loads = [m["expert_rank_load"] for m in ep.metrics if "expert_rank_load" in m]
        assert loads and all(len(x) == 2 and sum(x) == pytest.approx(2, abs=2e-3) for x in loads), loads
        assert not any("expert_rank_load" in m for m in ref.metrics)


def test_a_tensor_parallel_checkpoint_resumes_at_2_bit_for_bit_and_at_1(runs, chat, tmp_path):
    """From TP 2's checkpoint at step K (ZeRO-1): at tensor parallel 2, its losses bit for bit; at 1 on one rank
    (the same global batch), through DeepSpeed's universal checkpoint (the shards merged), within fp32 rounding,
    the change said in the log; at 1 on two data-parallel ranks and ZeRO-2 likewise."""
    tp = runs("llama-tp2", LLAMA, 2, **{"strategy.tensor_parallel": 2})
    after = {k: v for k, v in tp.losses.items() if k > K}
    step = str(tp.run_dir / "checkpoints" / f"step_{K:08d}")
    cases = (("again", 2, 2, "torchrun", 1, True), ("to1", 1, 2, "none", 1, False),
             ("to-dp2-zero2", 1, 1, "torchrun", 2, False))  # fmt: skip
    for name, degree, micro, launcher, stage, exact in cases:
        kw = {"strategy.tensor_parallel": degree, "strategy.zero_stage": stage, "checkpoint.resume": "auto"}
        resumed = train(
            tmp_path / name, sets(chat, LLAMA, micro, **kw), launcher=launcher, extra_args=["--resume", step]
        )
        assert sorted(k for k in resumed.losses if k > K) == list(range(K + 1, 2 * K + 1)), resumed.output[
            -2000:
        ]
        if degree != 2:
            assert (
                "the model-parallel degrees change (tensor parallel 2 -> 1, expert parallel 1 -> 1)"
                in resumed.output
            )
        for s, loss in after.items():
            if exact:
                assert resumed.losses[s] == loss, (name, s)
            else:
                assert resumed.losses[s] == pytest.approx(loss, rel=1e-5), (name, s)


def test_checkpoints_cross_the_degrees_the_other_way_and_for_experts(runs, chat, tmp_path):
    """TP 1's checkpoint (one rank) resumes at tensor parallel 2 (the universal checkpoint sliced for each rank)
    with its losses; EP 2's resumes at expert parallel 2 and ZeRO-2 (another stage) with its losses,
    and at expert parallel 1 is refused before anything starts (exit 2: AutoEP's names are not transformers')."""
    bf16 = BF16
    ep2 = runs("mixtral-ep2", MIXTRAL, 1, **bf16, **{"strategy.expert_parallel": 2})
    cases = (
        ("tp1-to-tp2", runs("llama-tp1", LLAMA, 2, launcher="none", **{"strategy.tensor_parallel": 1}), LLAMA, 2,
         {"strategy.tensor_parallel": 2}, "tensor parallel 1 -> 2", 1e-5),
        ("ep2-zero2", ep2, MIXTRAL, 1, {**bf16, "strategy.expert_parallel": 2, "strategy.zero_stage": 2},
         "resumed with changed settings: checkpoint.resume, run_dir, strategy.zero_stage", 2e-3),
    )  # fmt: skip
    for name, source, config, micro, kw, said, rel in cases:
        step = str(source.run_dir / "checkpoints" / f"step_{K:08d}")
        resumed = train(tmp_path / name, sets(chat, config, micro, **kw, **{"checkpoint.resume": "auto"}),
                        launcher="torchrun", extra_args=["--resume", step])  # fmt: skip
        assert said in resumed.output, resumed.output[-3000:]
        for s, loss in source.losses.items():
            if s > K:
                assert resumed.losses[s] == pytest.approx(loss, rel=rel), (name, s)
    step = str(ep2.run_dir / "checkpoints" / f"step_{K:08d}")
    refused = train(tmp_path / "ep2-to-ep1", sets(chat, MIXTRAL, 1, **bf16, **{"strategy.expert_parallel": 1}),
                    extra_args=["--resume", step], check=False)  # fmt: skip
    assert refused.returncode == 2, refused.output[-3000:]
    assert "was saved at expert parallel 2, and this run is at 1" in refused.output + refused.stderr
    assert "Traceback" not in refused.stderr


def test_bin_export_of_a_sharded_checkpoint_equals_the_export_without_the_axis(runs, tmp_path):
    """bin/export joins the shards (tensor parallel: each rank's files read whole over the data-parallel ranks, the
    shards joined by AutoTP's metadata, a tied head and embedding too; expert parallel: AutoEP's experts and router
    under transformers' names again): the model equals the one trained without the axis, to fp32's rounding (TP)
    and bf16's (EP, whose runs differ by bf16's rounding at every step)."""
    bf16 = BF16
    z2 = {"strategy.zero_stage": 2}
    pairs = (
        (runs("llama-tp1", LLAMA, 2, launcher="none", **{"strategy.tensor_parallel": 1}),
         runs("llama-tp2", LLAMA, 2, **{"strategy.tensor_parallel": 2}), 1e-6),
        (runs("qwen3-tp1", QWEN3, 2, launcher="none", **z2, **{"strategy.tensor_parallel": 1}),
         runs("qwen3-tp2", QWEN3, 2, **z2, **{"strategy.tensor_parallel": 2}), 1e-6),
        (runs("mixtral-ep1", MIXTRAL, 1, **bf16, **{"strategy.expert_parallel": 1}),
         runs("mixtral-ep2", MIXTRAL, 1, **bf16, **{"strategy.expert_parallel": 2}), 1e-2),
    )  # fmt: skip
    for worst, (_, _, rel) in zip(
        export_differences([p[:2] for p in pairs], 2 * K, tmp_path), pairs, strict=True
    ):
        assert worst <= rel


def test_tensor_parallel_2_by_data_parallel_2_on_4_ranks_trains_as_data_parallel_4(runs):
    """4 ranks: TP 2 x DP 2 (two groups of consecutive ranks, each on its own rows, micro 2) against DP 4 (micro 1),
    the same global batch of 4 rows, ZeRO-1 (its partitions over the data-parallel ranks of each shard)."""
    four = {"strategy.zero_stage": 1}
    dp4 = runs("llama-dp4", LLAMA, 1, nproc=4, **four, **{"strategy.tensor_parallel": 1})
    tp2 = runs("llama-tp2-dp2", LLAMA, 2, nproc=4, **four, **{"strategy.tensor_parallel": 2})
    assert (
        "layout: dp 2 x tp 2 x ep 1 x sp 1 (tensor-parallel groups [0,1], [2,3]; data-parallel groups [0,2], [1,3])"
        in tp2.output
    )  # noqa: E501
    assert "batch: micro 2 x data-parallel world 2 x grad_accum 1 = 4 sequences" in tp2.output
    worst = worst_gradient(dp4, tp2)
    print(f"TP 2 x DP 2: largest gradient difference {worst:.1e} of the gradient's largest value")
    assert worst <= 1e-5
    for step, loss in dp4.losses.items():
        assert tp2.losses[step] == pytest.approx(loss, rel=1e-6), step
