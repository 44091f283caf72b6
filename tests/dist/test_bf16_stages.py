"""bf16, the precision every GPU run trains in, on 2 ranks through the real launchers (DeepSpeed's
CPU accelerator trains bf16 at every ZeRO stage and with CPU offload): every case of test_stages.py
again. Each stage trains; the memory held matches the plan; a new job resuming on the same stage
continues bit for bit and holds exactly the optimizer state that was saved; bin/export gives the fp32
master weights from every stage, not the bf16 copies the model computes with (and those with
`--dtype bf16`).

Run A per case is conftest.runs(name, precision="bf16"), without dropout (helpers.PRECISIONS), made
once per test session and shared with test_bf16_reshard.py.
"""

import pytest
import torch
from helpers import CASES, K, PRECISIONS, assert_same_continuation, assert_written_in_background, check_memory, check_run, train
from helpers import resume_sets as sets

pytestmark = pytest.mark.dist

BF16 = PRECISIONS["bf16"]


def assert_same_state(resumed: dict, saved: dict) -> None:
    """The fp32 master weights and Adam moments a resumed engine holds equal, bit for bit, those the
    saving engine held (checks.full_optimizer_state, gathered from any stage's partitions)."""
    assert resumed.keys() == saved.keys()
    for name, parts in saved.items():
        for key, t in parts.items():
            assert torch.equal(resumed[name][key], t), f"{name}.{key} differs after the resume"


@pytest.mark.parametrize("name", [n for n in CASES if n != "zero3+cpu-opt"])  # that rung: fp32 (test_stages)
def test_bf16_stage_trains_on_two_ranks(runs, name):
    r = runs(name, precision="bf16")
    assert "precision bf16" in r.output
    check_run(r, name)


@pytest.mark.parametrize("name", ["zero0", "zero1", "zero2", "zero3"])
def test_bf16_measured_memory_matches_the_plan(runs, name):
    """As in fp32 (helpers.check_memory), gradients included: the planner counts bf16 gradient
    partitions through the backward pass and the fp32 ones at the step (they were an upper bound
    while it counted both)."""
    check_memory(runs(name, precision="bf16"), name)


@pytest.mark.parametrize("name", ["zero0", "zero1", "zero2", "zero3", "zero3+cpu"])
def test_bf16_stop_and_resume_is_exact(tmp_path, small_data, runs, name):
    """Run B, a new torchrun job, resumes from run A's checkpoint at step K: right after loading it
    holds the fp32 masters and moments A held when it saved, bit for bit; then the same per-step
    losses bit for bit and the same final weights. With CPU offload the optimizer is DeepSpeed's
    CPU Adam, whose vectorized kernel does not round the same way on a reloaded state (see
    strategy.optimizer_implementation; the same in fp32): the state is still exact and the first
    step too, the next ones agree to 5e-5 (measured: 1e-5)."""
    stage, accum, offload = CASES[name]
    a = runs(name, precision="bf16")
    d = a.run_dir / "checkpoints" / "step_00000006"
    assert_written_in_background(a.run_dir, K)  # checkpoint.async (auto): the copy, not the live state
    extra = {"strategy.offload": offload} if offload != "none" else {}
    b = train(tmp_path, sets(small_data, stage, accum, **extra, **BF16), launcher="torchrun",
              extra_args=["--resume", str(d)])  # fmt: skip
    assert f"resumed from {d} at step 6" in b.output
    assert_same_state(torch.load(b.debug_dir / "optimizer_resumed_step6.pt"),
                      torch.load(a.debug_dir / "optimizer_saved_step6.pt"))  # fmt: skip
    if offload == "none":
        assert_same_continuation(a, b)
        return
    assert b.losses[K + 1] == a.losses[K + 1]
    for step in range(K + 2, 2 * K + 1):
        assert b.losses[step] == pytest.approx(a.losses[step], rel=5e-5), step


def test_bf16_export_from_every_stage_gives_the_fp32_master_weights(tmp_path, runs):
    """bin/export of run A's last checkpoint at stages 0-3: every weight equals the fp32 master the
    engine held at that step (bit for bit; the bf16 weights the model computes with are those
    rounded, and most masters are not bf16 numbers); `--dtype bf16` gives exactly the rounded ones,
    and that model's logits equal the engine's."""
    from transformers import AutoModelForCausalLM

    from trainer.checkpoint.export import export

    for name in ("zero0", "zero1", "zero2", "zero3"):
        a = runs(name, precision="bf16")
        ckpt = a.run_dir / "checkpoints" / f"step_{2 * K:08d}"
        masters = torch.load(a.debug_dir / f"optimizer_saved_step{2 * K}.pt")
        fp32 = AutoModelForCausalLM.from_pretrained(export(ckpt, tmp_path / name / "fp32"))
        weights = dict(fp32.named_parameters())
        assert all(p.dtype == torch.float32 for p in weights.values())
        for pname, state in masters.items():
            assert torch.equal(weights[pname].detach(), state["fp32"]), (
                f"{name}: {pname} is not the fp32 master"
            )
        w = masters["transformer.h.0.attn.c_attn.weight"]["fp32"]
        assert (w.bfloat16().float() != w).float().mean() > 0.9, "the masters carry more than bf16 precision"

        # The logits compare with the kernel the run computed with: model.attn_implementation: auto
        # is eager on CPU in bf16 at this length; the export keeps the model's default (sdpa).
        assert "eager attention" in a.stdout + a.stderr
        bf16 = AutoModelForCausalLM.from_pretrained(
            export(ckpt, tmp_path / name / "bf16", dtype="bf16"), attn_implementation="eager"
        )
        for pname, p in bf16.named_parameters():
            assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), masters[pname]["fp32"].bfloat16()), (
                pname
            )
        probe = torch.load(a.debug_dir / "probe.pt")
        with torch.no_grad():
            logits = bf16.eval()(input_ids=probe["input_ids"]).logits.float()
        assert torch.allclose(logits, probe["logits"], rtol=0, atol=1e-6), (
            (logits - probe["logits"]).abs().max()
        )
