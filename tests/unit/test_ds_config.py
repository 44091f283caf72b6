"""The DeepSpeed JSON: one source of truth for every value the experiment owns."""

import json

import pytest
from helpers import TINY

from trainer import config, strategy
from trainer.common.errors import ConfigError, UserError
from trainer.strategy.planning.buffers import CUDA_CONTEXT, buffers, measured_sizes, overlap_comm

INFO = strategy.ModelInfo(params=1_000_000, largest_layer=40_000, hidden=128, layers=4, heads=4, vocab=257)


def build(overrides=(), template=None, world=2, precision="fp32", tmp_path=None):
    exp = config.load(TINY, list(overrides))
    tpl_path, tpl = strategy.template_for(exp)
    plan = strategy.plan(
        exp,
        INFO,
        world_size=world,
        gpus_per_node=world,
        device_type="cpu",
        device_memory=8 * 2**30,
        host_memory=16 * 2**30,
        precision=precision,
        template=tpl or None,
    )
    if not tpl:
        tpl_path, tpl = strategy.template_for(exp, plan.candidate)
    return strategy.ds_config(exp, plan, INFO, tpl, tpl_path), plan


def test_owned_values_come_from_the_experiment():
    ds, plan = build(
        [
            "train.micro_batch_size=4",
            "train.grad_accum=3",
            "train.grad_clip=0.5",
            "optim.lr=1e-3",
            "optim.weight_decay=0.05",
            "strategy.zero_stage=2",
        ],
        world=4,
    )
    assert ds["train_micro_batch_size_per_gpu"] == 4
    assert ds["gradient_accumulation_steps"] == 3
    assert ds["train_batch_size"] == 4 * 4 * 3  # micro x world x accum
    assert ds["gradient_clipping"] == 0.5
    assert ds["optimizer"] == {
        "type": "AdamW",
        "params": {
            "lr": 1e-3,
            "betas": [0.9, 0.95],
            "eps": 1e-8,
            "weight_decay": 0.05,
            "torch_adam": True,
            "fused": True,
        },
    }
    assert ds["scheduler"]["type"] == "WarmupCosineLR"
    assert ds["scheduler"]["params"]["total_num_steps"] == 200
    assert ds["scheduler"]["params"]["cos_min_ratio"] == 0.1
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["bf16"]["enabled"] is False and ds["fp16"]["enabled"] is False
    assert not strategy.autos(ds), "no 'auto' or 'measured' left"
    # This project's templates: "measured" (DeepSpeed's default buckets, no larger than the model)
    assert ds["zero_optimization"]["reduce_bucket_size"] == min(500_000_000, INFO.params)
    assert ds["zero_optimization"]["allgather_bucket_size"] == min(500_000_000, INFO.params)


def test_measured_sizes_at_stage_3_and_for_a_large_model():
    ds, _ = build(["strategy.zero_stage=3", "strategy.justification=test"])
    z = ds["zero_optimization"]
    assert z["reduce_bucket_size"] == INFO.params and z["stage3_prefetch_bucket_size"] == INFO.params
    assert z["stage3_param_persistence_threshold"] == 100_000  # DeepSpeed's default (HF's auto: 10 x hidden)
    big = strategy.ModelInfo(params=7 * 10**9, largest_layer=10**8, hidden=4096, trainable=4 * 10**7)
    sizes = measured_sizes(big)
    assert sizes["reduce_bucket_size"] == 4 * 10**7  # LoRA: the trainable parameters
    assert sizes["stage3_prefetch_bucket_size"] == 50_000_000
    assert (
        measured_sizes(strategy.ModelInfo(params=7 * 10**9, largest_layer=10**8))["reduce_bucket_size"]
        == 5 * 10**8
    )


def test_overlap_comm_is_measured_on_cpu_off_on_gpu_on():
    """This project's stage-1/2 templates overlap the reduction only where a CUDA stream can carry it;
    the planner counts one reduce bucket without it and two with it; a template's own value wins."""
    ds, plan = build(["strategy.zero_stage=2"])
    assert ds["zero_optimization"]["overlap_comm"] is False
    zero = ds["zero_optimization"]
    lp, c = 4, plan.candidate
    one = int(min(500_000_000, INFO.params) * lp)
    assert buffers(c, INFO, lp, False, None) == one
    assert buffers(c, INFO, lp, True, None) == CUDA_CONTEXT + 2 * one
    assert overlap_comm({"overlap_comm": "measured"}, on_gpu=True) is True
    assert overlap_comm({"overlap_comm": True}, on_gpu=False) is True  # as written
    assert overlap_comm({}, on_gpu=True) is False  # absent: DeepSpeed's default below stage 3
    assert buffers(c, INFO, lp, False, {"zero_optimization": {**zero, "overlap_comm": True}}) == 2 * one
    ds3, _ = build(["strategy.zero_stage=3", "strategy.justification=test"])
    assert ds3["zero_optimization"]["overlap_comm"] is True  # stage 3: DeepSpeed's default, kept


@pytest.mark.parametrize(("schedule", "ds_type"), [("linear", "WarmupDecayLR"), ("constant", "WarmupLR")])
def test_schedules(schedule, ds_type):
    ds, _ = build([f"optim.schedule={schedule}", "optim.warmup_steps=7", "optim.lr=2e-3"])
    assert ds["scheduler"]["type"] == ds_type
    assert ds["scheduler"]["params"]["warmup_max_lr"] == 2e-3
    assert ds["scheduler"]["params"]["warmup_num_steps"] == 7


def test_lr_scaling():
    ds, _ = build(["optim.lr_scaling=linear", "optim.lr=1e-3", "train.grad_accum=2"], world=4)
    assert ds["optimizer"]["params"]["lr"] == pytest.approx(8e-3)
    ds, _ = build(["optim.lr_scaling=sqrt", "optim.lr=1e-3"], world=4)
    assert ds["optimizer"]["params"]["lr"] == pytest.approx(2e-3)


def test_offload_sections(tmp_path):
    """ZeRO-3 with CPU offload: the optimizer alone where that fits (the parameters stay on the device: no
    offload_param section, zero3_offload_optimizer.json), the parameters too when asked for; a template that
    offloads the parameters against offload_params: false is a mismatch, never silently overridden."""
    pin = ["strategy.zero_stage=3", "strategy.offload=cpu", "strategy.justification=test"]
    ds, plan = build(pin)
    z = ds["zero_optimization"]
    assert (
        plan.candidate.name == "zero3+cpu (optimizer only)"
        and plan.candidate.template == "zero3_offload_optimizer.json"
    )
    assert z["offload_optimizer"]["device"] == "cpu" and "offload_param" not in z
    ds, plan = build([*pin, "strategy.offload_params=true"])
    z = ds["zero_optimization"]
    assert plan.candidate.name == "zero3+cpu"
    assert z["offload_optimizer"]["device"] == "cpu" and z["offload_param"]["device"] == "cpu"
    ds, plan = build(["strategy.offload=cpu", "strategy.zero_stage=2", "strategy.justification=test"])
    assert (
        plan.candidate.name == "zero2+cpu" and ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    )
    with pytest.raises(UserError, match="zero_optimization.offload_param.device.*optimizer only"):
        build(
            [*pin, "strategy.offload_params=false", "strategy.deepspeed=configs/deepspeed/zero3_offload.json"]
        )


def test_huggingface_style_template_is_accepted(tmp_path):
    hf = {  # as in the transformers DeepSpeed docs
        "fp16": {
            "enabled": "auto",
            "loss_scale": 0,
            "loss_scale_window": 1000,
            "initial_scale_power": 16,
            "hysteresis": 2,
            "min_loss_scale": 1,
        },
        "bf16": {"enabled": "auto"},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {"total_num_steps": "auto", "warmup_num_steps": "auto"},
        },
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "none"},
            "offload_param": {"device": "none"},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "sub_group_size": 1e9,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "steps_per_print": 2000,
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "wall_clock_breakdown": False,
    }
    p = tmp_path / "hf_zero3.json"
    p.write_text(json.dumps(hf))
    ds, plan = build([f"strategy.deepspeed={p}"])
    assert plan.candidate.stage == 3 and plan.pinned  # the template's stage is the pinned choice
    z = ds["zero_optimization"]
    assert z["reduce_bucket_size"] == strategy.auto_bucket(128)
    assert z["stage3_param_persistence_threshold"] == 1280
    assert ds["scheduler"]["params"]["warmup_num_steps"] == 20
    assert not strategy.autos(ds)


def test_template_that_contradicts_the_experiment_lists_every_mismatch(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 4,
                "train_batch_size": 1000,
                "gradient_clipping": 2.0,
                "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
                "zero_optimization": {"stage": 2},
            }
        )
    )
    with pytest.raises(UserError) as e:
        build([f"strategy.deepspeed={p}", "strategy.zero_stage=3"])
    text = str(e.value)
    for key in (
        "train_micro_batch_size_per_gpu: template says 4, the experiment says 8",
        "train_batch_size: template says 1000, the experiment says 16",
        "gradient_clipping: template says 2.0",
        "optimizer.type",
        "optimizer.params.lr",
        "zero_optimization.stage: template says 2, the experiment says 3",
    ):
        assert key in text, f"{key!r} not in {text}"


@pytest.mark.parametrize("value", [True, False, "auto"])
def test_the_loop_owns_gradient_accumulation(tmp_path, value):
    # bin/train calls the engine's backward and step at every micro batch: with DeepSpeed's managed
    # accumulation off, every micro batch would be an update, silently.
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"managed_gradient_accumulation": value, "zero_optimization": {"stage": 2}}))
    overrides = [f"strategy.deepspeed={p}", "train.grad_accum=4"]
    if value is False:
        with pytest.raises(
            UserError, match=r"managed_gradient_accumulation: template says false.*grad_accum 4"
        ):
            build(overrides)
    else:
        ds, _ = build(overrides)
        assert ds["managed_gradient_accumulation"] is True


def test_unknown_top_level_template_key_is_rejected(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"train_batch_sizee": 8, "zero_optimization": {"stage": 0}}))
    with pytest.raises(
        UserError,
        match=r"train_batch_sizee: unknown top-level DeepSpeed key.*Did you mean 'train_batch_size'",
    ):
        build([f"strategy.deepspeed={p}"])
    ds, _ = build([f"strategy.deepspeed={p}", 'strategy.allow_deepspeed_keys=["train_batch_sizee"]'])
    assert ds["train_batch_sizee"] == 8  # escape hatch for keys this list does not know


def test_template_json_syntax_error_names_the_line(tmp_path):
    p = tmp_path / "t.json"
    p.write_text('{\n  "zero_optimization": {"stage": 2,}\n}\n')
    with pytest.raises(UserError, match=r"t.json:2: invalid JSON"):
        build([f"strategy.deepspeed={p}"])


def test_a_value_the_planner_cannot_read_is_an_error_naming_the_key(tmp_path):
    """overlap_comm "yes" was planned as on and then refused by DeepSpeed's own validation, after the
    plan; a bucket size as a string was planned as DeepSpeed's default. Both are refused up front."""
    p = tmp_path / "t.json"
    p.write_text(
        json.dumps({"zero_optimization": {"stage": 2, "overlap_comm": "yes", "reduce_bucket_size": "5e8"}})
    )
    with pytest.raises(UserError) as e:
        build([f"strategy.deepspeed={p}"])
    text = str(e.value) + "".join(x.render(e.value.source) for x in e.value.problems)
    assert "t.json" in text and "cannot read" in text
    assert (
        "zero_optimization.overlap_comm" in text
        and "expected true, false or \"measured\", found 'yes'" in text
    )
    assert "zero_optimization.reduce_bucket_size" in text and "found '5e8'" in text
    p.write_text(
        json.dumps({"zero_optimization": {"stage": 2, "overlap_comm": False, "reduce_bucket_size": 5e8}})
    )
    ds, _ = build([f"strategy.deepspeed={p}"])
    assert (
        ds["zero_optimization"]["overlap_comm"] is False
        and ds["zero_optimization"]["reduce_bucket_size"] == 5e8
    )


def test_auto_for_a_value_nobody_owns_is_an_error(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"zero_optimization": {"stage": 2, "sub_group_size": "auto"}}))
    with pytest.raises(UserError, match="zero_optimization.sub_group_size"):
        build([f"strategy.deepspeed={p}"])


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_precision(precision):
    ds, _ = build([f"train.precision={precision}"], precision=precision)
    assert ds["bf16"]["enabled"] is (precision == "bf16")
    assert ds["fp16"]["enabled"] is (precision == "fp16")


def test_optimizer_implementation():
    impl = strategy.optimizer_implementation
    assert impl("auto", "cuda", "none") == "deepspeed"  # FusedAdam
    assert impl("auto", "cpu", "cpu") == "deepspeed"  # DeepSpeedCPUAdam for offload
    assert impl("auto", "cpu", "none") == "torch"  # bitwise-reproducible resume on CPU
    assert impl("torch", "cuda", "none") == "torch"
    ds, _ = build(["strategy.zero_stage=2", "strategy.offload=cpu"])
    assert ds["optimizer"]["params"]["torch_adam"] is False


def test_precision_auto_resolves_by_device():
    assert strategy.resolve_precision("auto", "cuda") == "bf16"
    assert strategy.resolve_precision("auto", "cpu") == "fp32"
    assert strategy.resolve_precision("fp16", "cuda") == "fp16"
    assert strategy.resolve_precision("bf16", "cpu") == "bf16"


def test_fp16_on_cpu_is_a_config_error_naming_the_key_and_the_fix():
    """DeepSpeed's CPU accelerator cannot train fp16 (its engine raises at initialize): refused
    before anything starts, with the file, the key and the fix."""
    with pytest.raises(ConfigError) as e:
        strategy.resolve_precision("fp16", "cpu", source="exp.yaml")
    text = e.value.render()
    assert "exp.yaml: train.precision: fp16 needs a CUDA GPU" in text and "--set train.precision=bf16" in text


# ----------------------------------------------------------------------------- the LR schedule on resume


def saved_json(overrides=(), world=2):
    ds, _ = build(overrides, world=world)
    return ds


def test_a_resume_with_another_max_steps_keeps_the_schedules_horizon():
    saved = saved_json(["train.max_steps=200"])
    s = strategy.schedule(config.load(TINY, ["train.max_steps=300"]), 2, saved)
    assert s.horizon == 200 and "keeps its horizon of 200 steps" in s.notes[0]
    ds, _ = build(["train.max_steps=300"])
    assert ds["scheduler"]["params"]["total_num_steps"] == 300  # fresh: the run's own max_steps
    replan = strategy.schedule(
        config.load(TINY, ["train.max_steps=300", "optim.schedule_steps=300"]), 2, saved
    )
    assert replan.horizon == 300 and "re-planned" in replan.notes[0]
    same = strategy.schedule(config.load(TINY, ["train.max_steps=200"]), 2, saved)
    assert same.horizon == 200 and same.notes == ()


def test_a_linear_schedule_kept_past_its_end_warns_that_the_lr_is_zero():
    saved = saved_json(["train.max_steps=200", "optim.schedule=linear"])
    s = strategy.schedule(config.load(TINY, ["train.max_steps=300", "optim.schedule=linear"]), 2, saved)
    assert s.horizon == 200 and "reaches lr 0 at step 200" in s.notes[0]


def test_lr_scaling_follows_the_global_batch_not_its_split_over_ranks():
    """Saved on 2 ranks x micro 8 (global 16) with linear scaling (lr x 2); resumed on 4 ranks x micro
    4, the same global batch: the peak lr stays (the rule alone would give x 4). A new global batch
    is scaled anew, with a warning."""
    saved = saved_json(["optim.lr_scaling=linear"], world=2)
    assert saved["optimizer"]["params"]["lr"] == pytest.approx(4e-3)
    split = strategy.schedule(
        config.load(TINY, ["optim.lr_scaling=linear", "train.micro_batch_size=4"]), 4, saved
    )
    assert split.lr == pytest.approx(4e-3) and "stays" in split.notes[0]
    bigger = strategy.schedule(config.load(TINY, ["optim.lr_scaling=linear"]), 4, saved)
    assert bigger.lr == pytest.approx(8e-3) and bigger.notes[0].startswith(
        "warning: the global batch changed"
    )


def applied_lrs(ds: dict, steps: int) -> list[float]:
    """The LR each optimizer step applies under our JSON's DeepSpeed scheduler, as trainer.engine
    starts it (one scheduler step after deepspeed.initialize, one after each optimizer step)."""
    import torch
    from deepspeed.runtime import lr_schedules

    from trainer.engine import start_schedule

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=ds["optimizer"]["params"]["lr"])
    sched = getattr(lr_schedules, ds["scheduler"]["type"])(opt, **ds["scheduler"]["params"])
    start_schedule(sched)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        sched.step()
    return out


@pytest.mark.parametrize("warmup", [0, 1, 5])
@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_the_lr_each_step_applies_follows_the_hf_trainers_schedules(schedule, warmup):
    """Step k applies (k - 1) / W of the peak during a warmup of W steps, and the peak from step 1
    without one, as transformers' schedules give the Trainer. DeepSpeed's schedulers alone applied
    their minimum at the first two steps (iteration -1, then 0): LR 0 twice, the peak one step late,
    and with the default optim.warmup_steps 0 a ramp over 2 steps (0, then half the peak).
    WarmupDecayLR (linear) without a warmup starts at 0, then the peak (its warmup_min_lr is also
    its floor); the decays may differ by a step (DeepSpeed's cosine reaches its floor at the last
    step)."""
    import torch
    import transformers

    lr, total = 2e-3, 20
    ds, _ = build([f"optim.schedule={schedule}", f"optim.warmup_steps={warmup}", f"optim.lr={lr}",
                   f"train.max_steps={total}", "optim.min_lr_ratio=0.0"])  # fmt: skip
    ours = applied_lrs(ds, total)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    hf_sched = {
        "cosine": transformers.get_cosine_schedule_with_warmup(opt, warmup, total),
        "linear": transformers.get_linear_schedule_with_warmup(opt, warmup, total),
        "constant": transformers.get_constant_schedule_with_warmup(opt, warmup),
    }[schedule]
    hf = []
    for _ in range(total):
        hf.append(opt.param_groups[0]["lr"])
        opt.step()
        hf_sched.step()
    if warmup:
        assert ours[:warmup] == pytest.approx(hf[:warmup])  # 0, 1/W, 2/W, ... of the peak
        assert ours[:warmup] == pytest.approx([lr * k / warmup for k in range(warmup)])
    elif schedule == "linear":
        assert ours[:2] == pytest.approx([0.0, lr])
    else:
        assert ours[0] == pytest.approx(lr) == hf[0]  # the peak at step 1
    assert ours[1] > 0  # so the round trip of --check moves the weights at its second step
    after = ours[max(warmup, 2) :]
    assert after == pytest.approx(hf[max(warmup, 2) :], abs=lr / (total - warmup) * 3.2)  # within a step
    assert all(a >= b for a, b in zip(after, after[1:], strict=False))
