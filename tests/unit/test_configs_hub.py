"""Every file in configs/ loads, validates and turns into a DeepSpeed config (litgpt's config hub test)."""

from pathlib import Path

import pytest
from helpers import ROOT, TINY

from trainer import config, model, strategy

EXPERIMENTS = sorted((ROOT / "configs" / "experiments").glob("*.yaml"))
TEMPLATES = sorted((ROOT / "configs" / "deepspeed").glob("*.json"))


def test_the_shipped_templates_are_the_ones_the_design_names():
    names = {p.stem for p in TEMPLATES}
    assert names == {
        "zero0",
        "zero1",
        "zero2",
        "zero3",
        "zero2_offload",
        "zero3_offload",
        "zero3_offload_optimizer",
        "zero3_nvme",
    }


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.name)
def test_experiment_loads_and_plans(path: Path, tmp_path):
    # tiny-sft, tiny-sft-lora and tiny-dpo start from tiny's model as `make tiny-sft` exports it, tiny-distill-chat
    # from tiny-sft-small's: plan that
    if path.name.startswith(("tiny-sft", "tiny-dpo", "tiny-distill-chat")):
        text = (
            path.read_text()
            .replace(
                "  pretrained: runs/tiny/export",
                "  config: {model_type: gpt2, n_layer: 4, n_embd: 128, n_head: 4, n_positions: 256}",
            )
            .replace(
                "  pretrained: runs/tiny-sft-small/export",
                "  config: {model_type: gpt2, n_layer: 2, n_embd: 64, n_head: 4, n_positions: 256}",
            )
        )
        assert "pretrained: runs/" not in text and "n_layer: " in text
        path = tmp_path / path.name
        path.write_text(text)
    exp = config.load(path)
    vocab = exp.model.config.get("vocab_size", 257) if exp.model.config is not None else None
    info = model.info(exp.model, vocab, None)  # meta device: nothing allocated, even for 7B
    assert info.params > 0
    from trainer.strategy.batch import resolve

    def plan_for(e):
        return strategy.plan(
            e, info, world_size=8, gpus_per_node=8, device_type="cuda", device_memory=80 * 2**30,
            host_memory=1024 * 2**30, precision=strategy.resolve_precision(exp.train.precision, "cuda"),
        )  # fmt: skip

    exp, _ = resolve(exp, 8, plan_for)  # train.micro_batch_size: auto, global_batch_size
    plan = plan_for(exp)
    tpl_path, tpl = strategy.template_for(exp, plan.candidate)
    ds = strategy.ds_config(exp, plan, info, tpl, tpl_path)
    # sequence parallelism divides the 8 ranks into 8 // sp data-parallel groups
    assert plan.sp * plan.dp_world == 8
    assert ds["train_batch_size"] == exp.train.micro_batch_size * plan.dp_world * exp.train.grad_accum
    if path.name == "llama3-8b-32k.yaml":  # the case: fits, by sequence parallelism
        assert plan.sp > 1, plan.levers_reason
    assert not strategy.autos(ds)


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.name)
def test_template_loads_and_resolves(path: Path, tmp_path):
    tpl = strategy.load_template(path)
    stage = tpl["zero_optimization"]["stage"]
    offload = tpl["zero_optimization"].get("offload_optimizer", {}).get("device", "none")
    sets = [f"strategy.deepspeed={path}"]
    if offload == "nvme":
        sets.append(f"strategy.nvme_path={tmp_path}")
    exp = config.load(TINY, sets)
    info = strategy.ModelInfo(params=10**6, largest_layer=10**5, hidden=128, layers=4, heads=4, vocab=257)
    plan = strategy.plan(
        exp,
        info,
        world_size=2,
        gpus_per_node=2,
        device_type="cpu",
        device_memory=2**33,
        host_memory=2**34,
        precision="fp32",
        template=tpl,
    )
    assert (plan.candidate.stage, plan.candidate.offload) == (stage, offload)
    ds = strategy.ds_config(exp, plan, info, tpl, str(path))
    assert ds["zero_optimization"]["stage"] == stage and not strategy.autos(ds)
