"""Ulysses sequence parallelism through bin/train on 2 ranks (real launchers, gloo on CPU), against
the same global batch without it: run R (sequence parallel 1: micro 1 on each of 2 data-parallel
ranks) and runs S (sequence parallel 2: the same 2 rows as micro 2 on 1 data-parallel rank, each rank
holding half of every sequence), on packed chat data (examples kept apart across the shards), a
tiny grouped-query Llama, fp32, dropout off, gradient clipping on.

- the first step's gradients (every parameter's, reduced and gathered: TRAINER_DEBUG_GRADS) equal
  R's within 1e-5 relative and the per-step losses within 1e-6, at ZeRO stages 0, 2 and 3 (R at stage
  0 for 0 and 2, at 3 for 3: zero.Init draws other initial weights);
- LoRA in bf16 at stage 3: within bf16's tolerance (2e-2 of each gradient's largest value);
- S at stage 0 resumes at sequence parallel 2 bit for bit, and at 1; R's checkpoint resumes at 2.
"""

import json

import pytest
import torch
from helpers import TINY, chat_data, train, yaml_value

pytestmark = pytest.mark.dist

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}  # fmt: skip
K = 3  # a checkpoint at step K of 2K


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    return chat_data(tmp_path_factory.mktemp("sp") / "chat.jsonl", rows=120)


def sets(chat, sp, stage=0, **kw):
    return {
        "model.config": LLAMA, "model.attn_implementation": "sdpa", "data.train.files": str(chat),
        "data.train.kind": "chat", "data.seq_len": 128, "data.eval_fraction": 0, "data.num_workers": 0,
        "train.micro_batch_size": sp, "train.max_steps": 2 * K, "train.log_every": 1, "train.eval_every": 0,
        "train.eval_prompts": [], "train.grad_clip": 1.0, "strategy.sequence_parallel": sp,
        "strategy.zero_stage": stage, "strategy.justification": "test", "checkpoint.every_steps": K,
        "checkpoint.save_final": False, "checkpoint.async": False, **kw,
    }  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory, chat):
    made = {}

    def run(name, sp, launcher="torchrun", **kw):
        if name not in made:
            tmp = tmp_path_factory.mktemp(name)
            made[name] = train(tmp, sets(chat, sp, **kw), launcher=launcher, env={"TRAINER_DEBUG_GRADS": "1"})
        return made[name]

    return run


def grads(r):
    return torch.load(r.debug_dir / "grads_step1.pt")


def assert_close_grads(a, b, rel):
    ga, gb = grads(a), grads(b)
    assert ga.keys() == gb.keys() and len(ga) > 10
    worst = max(((ga[k] - gb[k]).abs().max() / ga[k].abs().max().clamp_min(1e-30)).item() for k in ga)
    print(f"largest gradient difference {worst:.1e} of the gradient's largest value")
    assert worst <= rel


@pytest.mark.parametrize(("stage", "launcher"), [(0, "deepspeed"), (2, "torchrun"), (3, "torchrun")])
def test_sequence_parallel_2_trains_as_1_on_the_same_global_batch(runs, stage, launcher):
    # stage 3 builds the model under zero.Init, which draws other initial weights: its own reference
    ref = runs("ref", 1, launcher="torchrun") if stage < 3 else runs("ref-zero3", 1, launcher="torchrun", stage=3)
    s = runs(f"sp2-zero{stage}", 2, launcher=launcher, stage=stage)
    assert "sequence parallel 2 (data-parallel world 1)" in s.output, s.output[-3000:]
    assert "packing: model type 'llama'" in s.output  # packed rows, kept apart across the shards
    assert_close_grads(ref, s, 1e-5)
    assert ref.losses.keys() == s.losses.keys() == set(range(1, 2 * K + 1))
    for step, loss in ref.losses.items():
        assert s.losses[step] == pytest.approx(loss, rel=1e-6), step


def test_lora_in_bf16_at_stage_3_within_bf16s_tolerance(runs):
    lora = {"model.lora": {"r": 4, "dropout": 0.0}, "train.precision": "bf16", "stage": 3}
    a, b = runs("lora-sp1", 1, launcher="torchrun", **lora), runs("lora-sp2", 2, **lora)
    assert "trainable" in b.output and "sequence parallel 2" in b.output
    assert_close_grads(a, b, 2e-2)
    for step, loss in a.losses.items():
        assert b.losses[step] == pytest.approx(loss, rel=1e-2), step


def test_a_checkpoint_resumes_at_sequence_parallel_2_bit_for_bit_and_across_degrees(runs, chat, tmp_path):
    """From S's checkpoint at K: at sequence parallel 2, S's losses bit for bit; at 1 (micro 1 on two
    data-parallel ranks: the same global batch), within fp32 rounding; and R's checkpoint (sequence
    parallel 1) resumes at 2. A checkpoint holds whole model states: only the data position and the
    world carry over, and both are global."""
    s, ref = runs("sp2-zero0", 2, launcher="deepspeed"), runs("ref", 1, launcher="torchrun")
    after = lambda r: {k: v for k, v in r.losses.items() if k > K}  # noqa: E731
    for name, source, sp, want, exact in (("again", s, 2, s, True), ("to1", s, 1, s, False), ("to2", ref, 2, ref, False)):
        resumed = train(tmp_path / name, {**sets(chat, sp), "checkpoint.resume": "auto"}, launcher="torchrun",
                        extra_args=["--resume", str(source.run_dir / "checkpoints" / f"step_{K:08d}")])  # fmt: skip
        assert sorted(after(resumed)) == list(range(K + 1, 2 * K + 1)), resumed.output[-2000:]
        for step, loss in after(want).items():
            if exact:
                assert resumed.losses[step] == loss, (name, step)
            else:
                assert resumed.losses[step] == pytest.approx(loss, rel=1e-6), (name, step)


def test_tiny_trains_at_sequence_parallel_2_with_the_losses_of_one_rank(tmp_path):
    """The issue's command, `bin/train configs/experiments/tiny.yaml --launcher torchrun
    --nproc-per-node 2 --set strategy.sequence_parallel=2` (GPT-2: learned positions, its own
    attention layout), against tiny on one rank: the same global batch of 8 rows, the same losses."""
    few = {"train.max_steps": 12, "train.log_every": 1, "train.eval_every": 0, "checkpoint.save_final": False}
    one = train(tmp_path / "one", few)
    two = train(tmp_path / "two", {**few, "strategy.sequence_parallel": 2}, launcher="torchrun")
    assert "sequence parallel 2 (data-parallel world 1)" in two.output
    assert "batch: micro 8 x data-parallel world 1 x grad_accum 1 = 8 sequences" in two.output
    assert one.losses.keys() == two.losses.keys() == set(range(1, 13))
    for step, loss in one.losses.items():
        assert two.losses[step] == pytest.approx(loss, rel=1e-6), step


ACT = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2,
       "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 1024}  # fmt: skip


def test_measured_activation_bytes_per_rank_are_the_planned_ones_at_sequence_parallel_1_and_2(tmp_path):
    """What autograd keeps for backward in a training forward pass (saved-tensor hooks, each storage
    once, weights left out: TRAINER_DEBUG_ACTIVATIONS), bf16, a grouped-query Llama at 1024 tokens
    with no other lever: within 10% of the plan, in the decoder layers (the plan's per-layer count)
    and in all (the loss's share counted as its peak), on one rank and on each of 2 at sequence
    parallel 2, where a rank holds half of every sequence (plus Ulysses' gathered heads)."""
    from trainer import config, model, strategy
    from trainer.strategy.planning.activations import SEQUENCE_ATTENTION_BACKWARD, layer_bytes_per_token

    sets = {"model.config": ACT, "model.attn_implementation": "sdpa", "data.seq_len": 1024,
            "train.micro_batch_size": 1, "train.precision": "bf16", "train.max_steps": 1, "train.eval_every": 0,
            "train.eval_prompts": [], "model.activation_checkpointing": False, "model.chunked_loss": False,
            "model.tiled_mlp": False, "checkpoint.save_final": False}  # fmt: skip
    exp = config.load(TINY, [f"{k}={yaml_value(v)}" for k, v in sets.items()])
    info = model.info(exp.model, 257, None)
    for sp, launcher in ((1, "none"), (2, "torchrun")):
        r = train(tmp_path / f"sp{sp}", {**sets, "strategy.sequence_parallel": sp}, launcher=launcher,
                  env={"TRAINER_DEBUG_ACTIVATIONS": "1"})  # fmt: skip
        planned = strategy.activations(info, 1, 1024, 2, False, sp=sp, device="cpu")
        if sp > 1:  # what only the attention's backward holds (its gradients), which no saved tensor is
            planned -= SEQUENCE_ATTENTION_BACKWARD * 1024 // sp * info.hidden * 2
        layers = 2 * 1024 / sp * layer_bytes_per_token(info, 2, device="cpu", sp=sp)
        for rank in range(sp):
            got = json.loads((r.debug_dir / f"activations_rank{rank}.json").read_text())
            print(f"sp {sp} rank {rank}: layers {got['layers']:,} of {layers:,.0f} planned; all "
                  f"{got['layers'] + got['other']:,} of {planned:,}")  # fmt: skip
            assert got["count"] == 2
            assert got["layers"] == pytest.approx(layers, rel=0.1)
            assert got["layers"] + got["other"] == pytest.approx(planned, rel=0.1)


def test_overfit_batch_and_check_normalise_by_targets_under_sequence_parallelism(tmp_path, chat):
    """--overfit-batch at sequence parallel 2 trains the fixed batch with training's per-target mean: its
    losses are the same batch's on one rank without sequence parallelism (they were its targets' summed
    loss over every position of the rows: several times lower); --check passes at 2."""
    losses = {}
    for sp, launcher in ((1, "none"), (2, "torchrun")):
        run_dir = tmp_path / f"sp{sp}"
        s = {**sets(chat, sp, **{"train.micro_batch_size": 2, "train.max_steps": 3}), "run_dir": str(run_dir)}
        train(tmp_path / f"t{sp}", s, launcher=launcher, extra_args=["--overfit-batch"], debug=False)
        rows = [json.loads(x) for x in (run_dir / "overfit-batch" / "metrics.jsonl").read_text().splitlines()]
        losses[sp] = {m["step"]: m["loss"] for m in rows if "loss" in m}
    assert losses[1].keys() == losses[2].keys() == {1, 2, 3}
    for step, loss in losses[1].items():
        assert losses[2][step] == pytest.approx(loss, rel=1e-5), (step, losses)
    c = train(tmp_path / "check", sets(chat, 2, **{"train.micro_batch_size": 2}), launcher="torchrun",
              extra_args=["--check"], debug=False)  # fmt: skip
    assert "check passed" in c.output
