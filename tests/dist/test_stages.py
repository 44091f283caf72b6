"""Every ZeRO stage (and CPU offload) trains on 2 ranks through the real launchers, and its
checkpoints resume exactly (kills during a save and SIGTERM: test_kills.py).

Run A per stage trains 2K steps straight on data small enough that epochs end inside it, with a
checkpoint every K (dropout on, gradient accumulation at stages 0 and 3). Its own checks: the loss
falls, every rank ends with identical parameters (digests gathered across ranks), within every
epoch the ranks consume disjoint samples, the memory held matches the plan, and torchrun gives the
same per-step losses. Run B, a new job under torchrun (a checkpoint written under one launcher
resumes under the other), resumes from A's checkpoint at K for K more steps: its per-step losses
equal A's bit for bit (fp32 on CPU is deterministic) and the final weights are equal. Run A is made
once per test session (conftest.runs, under torchrun; ZeRO-2's also under the deepspeed launcher, whose
checkpoint run B resumes under torchrun) and shared with test_kills.py.
"""

import json
import re

import pytest
import yaml
from helpers import CASES, K, assert_same_continuation, assert_written_in_background, check_memory, check_run
from helpers import resume_sets as sets
from helpers import FAST, train

pytestmark = pytest.mark.dist


# ----------------------------------------------------------------------------- every stage trains


@pytest.mark.parametrize("name", list(CASES))
def test_stage_trains_on_two_ranks(runs, name):
    check_run(runs(name), name)


@pytest.mark.parametrize("name", ["zero0", "zero1", "zero2", "zero3"])
def test_measured_memory_matches_the_plan(runs, name):
    check_memory(runs(name), name)


def test_zero3_offloads_the_optimizer_alone_where_that_fits(runs):
    """Stage 3 with CPU offload and strategy.offload_params: auto (issue 61): the plan offloads the optimizer
    alone (it fits, and the parameters' copies in every pass would cost time), the DeepSpeed JSON has no
    offload_param, and the run trains as the other rungs do (test_stage_trains_on_two_ranks); the same pin
    with offload_params: true offloads the parameters too (run A of zero3+cpu). (The memory census cannot
    tell offloaded states from the rest on CPU, where both are host memory: no offload case is held to it.)"""
    r, p = runs("zero3+cpu-opt"), runs("zero3+cpu")
    zero = r.rank_reports()[0]["ds_config"]["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "cpu" and "offload_param" not in zero
    assert "zero3+cpu (optimizer only)" in r.output and r.rank_reports()[0]["plan"]["offload_params"] is False
    assert p.rank_reports()[0]["ds_config"]["zero_optimization"]["offload_param"]["device"] == "cpu"


def test_torchrun_gives_the_same_losses_as_deepspeed(runs):
    ds, tr = runs("zero2", "deepspeed"), runs("zero2")
    check_run(tr, "zero2")
    assert "via torchrun" in tr.output and "via deepspeed" in ds.output
    assert tr.losses == ds.losses  # bitwise: same seed, stage and data order
    assert tr.rank_reports()[0]["param_digest"] == ds.rank_reports()[0]["param_digest"]


def test_chunked_loss_trains_as_the_standard_loss_at_stage_3(tmp_path, small_data, runs):
    """model.chunked_loss at ZeRO-3 (the LM head's weight, tied to the embedding, is partitioned and
    used outside its module: an external parameter) with gradient accumulation, under torchrun:
    the same per-step losses as the standard loss to fp32 rounding, and identical ranks."""
    stage, accum, _ = CASES["zero3"]
    a = runs("zero3")
    c = train(tmp_path, {**sets(small_data, stage, accum), "model.chunked_loss": True}, launcher="torchrun")
    assert "chunked loss" in c.output
    check_run(c, "zero3")
    assert c.losses.keys() == a.losses.keys()
    for step, loss in a.losses.items():
        assert c.losses[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), f"step {step}"


# ----------------------------------------------------------------------------- exact resume


@pytest.mark.parametrize("name", ["zero0", "zero1", "zero2", "zero3"])
def test_stop_and_resume_is_exact(tmp_path, small_data, runs, name):
    """Run B resumes in a new job, under torchrun, from run A's own checkpoint at step K (stopping at
    a signal, then resuming, is test_sigterm_to_one_rank_saves_and_exits_0)."""
    stage, accum, _ = CASES[name]
    a = runs(name, "deepspeed" if name == "zero2" else "torchrun")  # zero2: written under the other launcher

    # The checkpoint carries the exact DeepSpeed JSON, the resolved experiment and the state.
    d = a.run_dir / "checkpoints" / "step_00000006"
    ds_saved = json.loads((d / "ds_config.json").read_text())
    assert ds_saved == a.rank_reports()[0]["ds_config"]
    assert ds_saved["zero_optimization"]["stage"] == stage and ds_saved["gradient_accumulation_steps"] == accum
    assert yaml.safe_load((d / "experiment.yaml").read_text())["strategy"]["zero_stage"] == stage
    st = json.loads((d / "trainer_state.json").read_text())
    assert st["step"] == K and st["world_size"] == 2 and st["zero_stage"] == stage
    assert st["samples"] == K * 8 * accum and st["tokens"] == st["samples"] * 128
    assert st["data_position"]["sample"] > 0, "the checkpoint should fall in the middle of an epoch"
    assert {"torch", "deepspeed", "transformers"} <= set(st["versions"]) and st["plan"]["stage"] == stage
    assert all((d / f).stat().st_size == n for f, n in st["files"].items())

    assert_written_in_background(a.run_dir, K)  # checkpoint.async (auto): the copy, not the live state
    b = train(tmp_path, sets(small_data, stage, accum), launcher="torchrun", extra_args=["--resume", str(d)])
    assert f"resumed from {d} at step 6" in b.output
    final = json.loads((b.run_dir / "checkpoints" / "step_00000012" / "trainer_state.json").read_text())
    assert final["data_position"]["epoch"] > st["data_position"]["epoch"], "an epoch should end after the resume"
    assert_same_continuation(a, b)


def test_eval_prompts_at_stage_3_on_two_ranks(tmp_path):
    """train.eval_prompts at ZeRO-3 on 2 ranks: every rank takes part in generation (the gathers of
    the partitioned weights need all of them in every forward), rank 0 prints each completion once."""
    r = train(
        tmp_path,
        {**FAST, "strategy.zero_stage": 3, "train.max_steps": 2, "train.eval_batches": 1,
         "train.eval_prompts": ["def ", "x = "], "train.eval_max_new_tokens": 8},
        launcher="torchrun",
    )  # fmt: skip
    assert r.output.count("sample step 2: 'def ' -> ") == 1 and r.output.count("sample step 2: 'x = ' -> ") == 1
    samples = [m for m in r.metrics if "samples" in m][-1]["samples"]
    assert [s["prompt"] for s in samples] == ["def ", "x = "]
    assert all(len(s["completion"]) <= 8 for s in samples)  # a byte token decodes to at most one character
