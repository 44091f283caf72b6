"""What the experiment pins and what it only constrains (review of issue 61, findings 2 and 8): a ZeRO stage or an
offload to the host pins a rung (above the rules' choice it needs strategy.justification, and --force runs it when
it is predicted not to fit); strategy.offload_params and strategy.offload: none only narrow the rungs the rules
choose from, and the plan says when they change nothing or when they are what blocks the job."""

import shutil

import pytest

from trainer import config, model, strategy
from trainer.common.errors import UserError
from trainer.run.cli import main

GiB = 2**30
QLORA = "configs/experiments/llama3-8b-qlora.yaml"
FULL = ("model.lora=null",)


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    cache = tmp_path_factory.mktemp("counts")  # bench/plan_matrix.py's counts, copied (none written back)
    shutil.copytree("bench/results/plan_matrix", cache, dirs_exist_ok=True)
    return str(cache)


def planned(counts, world, device, host, *sets, force=False):
    exp = config.load(QLORA, list(sets))
    info = model.info(exp.model, 257, 256, cache_dir=counts)
    return strategy.plan(exp, info, world_size=world, gpus_per_node=min(world, 8), device_type="cuda",
                         device_memory=device * GiB, host_memory=host * GiB, precision="bf16", force=force)  # fmt: skip


def test_offload_params_is_no_pin_and_the_plan_says_when_it_changes_nothing(counts):
    """QLoRA of an 8B on one 80 GB GPU fits on the device: offload_params: true had made it 'zero0 pinned by the
    experiment', though the key applies to ZeRO-3 with offload only and changed nothing."""
    free = planned(counts, 1, 80, 256)
    p = planned(counts, 1, 80, 256, "strategy.offload_params=true")
    assert p.candidate == free.candidate and not p.pinned, p.reason
    assert "pinned" not in p.reason and "strategy.offload_params: true has no effect" in p.reason, p.reason


def test_offload_params_that_moves_the_plan_up_needs_a_justification(counts):
    """The 8B trained in full on one 80 GB GPU: the rules take ZeRO-Offload (zero2+cpu); offload_params: true has
    no effect there. On 16 GB only ZeRO-3 with the parameters offloaded fits, which true agrees with."""
    p = planned(counts, 1, 80, 2048, *FULL, "strategy.offload_params=true")
    assert p.candidate.name == "zero2+cpu" and "has no effect" in p.reason and not p.pinned, p.reason
    p = planned(counts, 1, 16, 2048, *FULL, "strategy.offload_params=true")
    assert p.candidate.name == "zero3+cpu" and "pinned" not in p.reason, p.reason
    # 8 x 24 GB: the rules take ZeRO-3 with the optimizer alone offloaded; true moves the plan up to the
    # parameters' offload, which needs a justification as a pin above the rules' choice does
    job = (8, 24, 2048, *FULL, "strategy.hardware.gpu=rtx4090", "train.global_batch_size=64")
    assert planned(counts, *job).candidate.name == "zero3+cpu (optimizer only)"
    with pytest.raises(UserError) as e:
        planned(counts, *job, "strategy.offload_params=true")
    assert "strategy.offload_params: true moves the plan to zero3+cpu" in str(e.value), e.value
    assert "strategy.justification" in str(e.value) and "pinned" not in str(e.value), e.value
    p = planned(counts, *job, "strategy.offload_params=true", "strategy.justification=measuring")
    assert p.candidate.name == "zero3+cpu" and not p.pinned and "justification: measuring" in p.reason, (
        p.reason
    )
    assert "without it the rules would take zero3+cpu (optimizer only)" in p.reason, p.reason
    assert "zero3+cpu (optimizer only) needs" not in p.reason, p.reason  # not a rung it was allowed


def test_a_constraint_that_blocks_the_job_is_named_and_no_pinned_rung_is_forced(counts):
    """The 8B in full on one 16 GB GPU with 2 TB of host memory fits only with its parameters offloaded. With
    offload_params: false the plan had said 'the pinned zero0 is predicted not to fit ... set
    strategy.zero_stage/offload: auto', never naming offload_params, and --force then planned zero0 at 180 GB on a
    14 GB budget; strategy.offload: none had been 'the pinned zero0' too."""
    for key, value in (("strategy.offload_params", "false"), ("strategy.offload", "none")):
        for force in (False, True):
            with pytest.raises(UserError) as e:
                planned(counts, 1, 16, 2048, *FULL, f"{key}={value}", force=force)
            first = str(e.value).splitlines()[0]
            assert "pinned" not in first and f"{key}: {value}" in first and "zero3+cpu" in first, first
            assert f"set {key}: auto" in first, first


def test_a_stage_pin_is_still_a_pin(counts):
    p = planned(counts, 1, 80, 256, "strategy.zero_stage=0")
    assert p.pinned and "pinned by the experiment" in p.reason


def test_offload_params_against_a_template_s_stage_exits_2_naming_both(capsys):
    """A template of stage 0-2 contradicts offload_params as strategy.zero_stage 0-2 does (it had planned zero2
    and exited 0)."""
    args = ["configs/experiments/tiny.yaml", "--plan", "--set", "strategy.offload_params=true", "--set",
            "strategy.deepspeed=configs/deepspeed/zero2.json", "--set", "strategy.justification=measuring"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "strategy.offload_params" in err and "strategy.deepspeed" in err, err
    assert "configs/deepspeed/zero2.json" in err and "zero_optimization.stage 2" in err, err
