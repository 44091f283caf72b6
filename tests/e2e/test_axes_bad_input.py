"""Tensor and expert parallelism and pipeline stages that cannot run the job, through the real CLI (`--plan`: nothing starts): exit 2,
no traceback, the key and the fix."""

import json

import pytest
from helpers import TINY, bin_train, data_cache

pytestmark = pytest.mark.e2e

LLAMA = "{model_type: llama, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 256}"  # noqa: E501
WIDE = LLAMA.replace("intermediate_size: 128", "intermediate_size: 130").replace(
    "num_key_value_heads: 2", "num_key_value_heads: 4"
)  # noqa: E501
MIXTRAL = LLAMA.replace("llama", "mixtral").replace("}", ", num_local_experts: 4, num_experts_per_tok: 2}")


def plan(tmp_path, config, *sets, world=2, per_node=None):
    args = [TINY, "--plan", "--world-size", str(world), "--set", f"model.config={config}",
            "--set", f"run_dir={tmp_path / 'run'}", "--set", f"data.cache_dir={data_cache()}"]  # fmt: skip
    if per_node:
        args += ["--nproc-per-node", str(per_node)]
    for s in sets:
        args += ["--set", s]
    return args


def template(tmp_path, d):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps(d))
    return f"strategy.deepspeed={p}"


CASES = {
    "tensor parallel not dividing the heads": (
        lambda t: plan(t, LLAMA, "strategy.tensor_parallel=3", world=3),
        [
            "strategy.tensor_parallel: 3 cannot run this job",
            "4 attention heads do not divide by 3",
            "or 1 (off)",
        ],
    ),
    "tensor parallel not dividing the key/value heads": (
        lambda t: plan(t, LLAMA, "strategy.tensor_parallel=4", world=4),
        ["strategy.tensor_parallel: 4", "2 key/value heads do not divide by 4"],
    ),
    "tensor parallel not dividing the MLP": (
        lambda t: plan(t, WIDE, "strategy.tensor_parallel=4", world=4),
        ["strategy.tensor_parallel: 4", "130 MLP's intermediate size do not divide by 4"],
    ),
    "tensor parallel across nodes": (
        lambda t: plan(t, LLAMA, "strategy.tensor_parallel=2", world=4, per_node=1),
        ["strategy.tensor_parallel: 2", "would cross nodes of 1 rank(s)", "inside a node only"],
    ),
    "tensor parallel for a family AutoTP is not verified on": (
        lambda t: plan(
            t,
            "{model_type: gpt2, n_layer: 2, n_embd: 64, n_head: 4, n_positions: 256}",
            "strategy.tensor_parallel=2",
        ),
        ["strategy.tensor_parallel: 2", "model type 'gpt2' is not one AutoTP has been verified on"],
    ),  # fmt: skip
    "tensor parallel with LoRA": (
        lambda t: plan(t, LLAMA, "strategy.tensor_parallel=2", "model.lora={r: 4}"),
        [
            "strategy.tensor_parallel",
            "LoRA with tensor parallelism is refused",
            "_create_param_mapping",
            "set 1",
        ],
    ),
    "tensor parallel with sequence parallelism": (
        lambda t: plan(t, LLAMA, "strategy.tensor_parallel=2", "strategy.sequence_parallel=2", world=4),
        [
            "strategy.tensor_parallel: 2 with strategy.sequence_parallel: 2 is not verified",
            "set one of them to 1",
        ],
    ),
    "expert parallel on a dense model": (
        lambda t: plan(t, LLAMA, "strategy.expert_parallel=2", "train.precision=bf16"),
        ["strategy.expert_parallel: 2 cannot run this job", "model type 'llama' is dense"],
    ),
    "expert parallel not dividing the experts": (
        lambda t: plan(t, MIXTRAL, "strategy.expert_parallel=3", "train.precision=bf16", world=3),
        ["strategy.expert_parallel: 3", "4 experts a layer do not divide by 3"],
    ),
    "expert parallel in fp32": (
        lambda t: plan(t, MIXTRAL, "strategy.expert_parallel=2", "train.precision=fp32"),
        ["strategy.expert_parallel", "AutoEP trains in bf16", "set train.precision: bf16"],
    ),
    "tensor parallel with the tiled loss": (
        lambda t: plan(t, LLAMA, "strategy.tensor_parallel=2", "model.chunked_loss=true"),
        ["model.chunked_loss", "AutoTP divides by the vocabulary", "set model.chunked_loss: false"],
    ),
    "tensor parallel at ZeRO-3": (
        lambda t: plan(
            t, LLAMA, "strategy.tensor_parallel=2", "strategy.zero_stage=3", "strategy.justification=x"
        ),
        ["tensor parallelism at ZeRO-3 writes checkpoints DeepSpeed 0.19.8 cannot read whole"],
    ),
    "a template's expert parallel size without enabled": (
        lambda t: plan(
            t, MIXTRAL, "train.precision=bf16", template(t, {"expert_parallel": {"autoep_size": 2}})
        ),
        ["expert_parallel.autoep_size 2 without expert_parallel.enabled", '"enabled": true'],
    ),
    "a template's degree that disagrees with the experiment's": (
        lambda t: plan(
            t, LLAMA, "strategy.tensor_parallel=2", template(t, {"tensor_parallel": {"autotp_size": 4}})
        ),
        ["tensor_parallel.autotp_size", "template says 4, the experiment says 2"],
    ),
    # pipeline stages (issue 71)
    "more pipeline stages than the model has items": (
        lambda t: plan(t, LLAMA, "strategy.pipeline_stages=8", "train.eval_prompts=[]", world=8),
        ["strategy.pipeline_stages: 8 cannot run this job", "the model has 2 layers: 3 stages at most"],
    ),
    "fewer micro batches than stages": (
        lambda t: plan(
            t,
            LLAMA,
            "strategy.pipeline_stages=2",
            "train.eval_prompts=[]",
            "train.grad_accum=1",
            "train.global_batch_size=null",
            "strategy.justification=",
        ),
        [
            "strategy.pipeline_stages: 2 with 1 micro batch(es) a step",
            "leaves 50% of each step idle",
            "strategy.justification",
        ],
    ),  # fmt: skip
    "pipeline stages at ZeRO-2": (
        lambda t: plan(
            t, LLAMA, "strategy.pipeline_stages=2", "train.eval_prompts=[]", "strategy.zero_stage=2"
        ),
        ["strategy.pipeline_stages", "takes ZeRO 0 and 1 only", "set zero_stage: 1"],
    ),
    "pipeline stages with LoRA": (
        lambda t: plan(t, LLAMA, "strategy.pipeline_stages=2", "train.eval_prompts=[]", "model.lora={r: 4}"),
        ["strategy.pipeline_stages", "LoRA with pipeline stages is refused", "set 1"],
    ),
    "pipeline stages for a family not trained in stages": (
        lambda t: plan(
            t, LLAMA.replace("llama", "gemma"), "strategy.pipeline_stages=2", "train.eval_prompts=[]"
        ),
        [
            "strategy.pipeline_stages: 2 cannot run this job",
            "model type 'gemma' has not been trained in stages",
            "set it to 1 (off)",
        ],
    ),  # fmt: skip
    "pipeline stages in bf16 without ZeRO": (
        lambda t: plan(
            t,
            LLAMA,
            "strategy.pipeline_stages=2",
            "train.eval_prompts=[]",
            "train.precision=bf16",
            "strategy.zero_stage=0",
        ),
        ["BF16_Optimizer"],
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", list(CASES))
def test_an_axis_that_cannot_run_the_job_exits_2_naming_the_key_and_the_fix(tmp_path, name):
    build, needles = CASES[name]
    p = bin_train(*build(tmp_path))
    out = p.stderr + p.stdout
    assert p.returncode == 2, f"exit {p.returncode}\n{out}"
    assert "Traceback" not in out, out
    for needle in needles:
        assert needle in out, f"{needle!r} not in:\n{out}"


def test_deepspeeds_own_defaults_in_a_template_say_off(tmp_path):
    """`"tensor_parallel": {"autotp_size": 0}` and `"expert_parallel": {"enabled": false, "autoep_size": 2}` are
    DeepSpeed's ways of saying off (review of issue 70: both were refused as disagreeing with the experiment)."""
    for i, d in enumerate(
        ({"tensor_parallel": {"autotp_size": 0}}, {"expert_parallel": {"enabled": False, "autoep_size": 2}})
    ):
        (tmp_path / str(i)).mkdir()
        p = bin_train(
            *plan(tmp_path / str(i), MIXTRAL, "train.precision=bf16", template(tmp_path / str(i), d))
        )
        assert p.returncode == 0, p.stderr[-2000:]
        assert "layout: dp 2 x tp 1 x ep 1 x sp 1" in p.stdout


def test_a_templates_expert_parallel_is_the_plans_and_changes_it(tmp_path):
    """`"expert_parallel": {"autoep_size": 2}` in a strategy.deepspeed template (the experiment's left at auto) is
    the plan's degree: the experts divided in the plan (where it used to change nothing), the layout shown."""
    cases = {}
    for name, extra in (
        ("none", []),
        ("ep2", [template(tmp_path, {"expert_parallel": {"enabled": True, "autoep_size": 2}})]),
    ):
        p = bin_train(*plan(tmp_path, MIXTRAL, "train.precision=bf16", "strategy.zero_stage=2",
                            "strategy.justification=test", *extra))  # fmt: skip
        assert p.returncode == 0, p.stderr[-3000:]
        cases[name] = p.stdout
    assert "layout: dp 2 x tp 1 x ep 2 x sp 1 (expert-parallel groups [0,1]" in cases["ep2"]
    assert "layout: dp 2 x tp 1 x ep 1 x sp 1" in cases["none"]
    params = {
        k: next(line for line in v.splitlines() if line.startswith("zero2 ")).split()[1:3]
        for k, v in cases.items()
    }
    assert params["ep2"] != params["none"], params
