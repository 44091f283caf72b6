"""The rules between fields for the model-parallel axes (docs/strategies.md): tensor and expert parallelism and
pipeline stages, what each has been trained against one rank with (registered with rules.py's others)."""

from __future__ import annotations

from trainer.config.rules import contradiction
from trainer.config.schema import Experiment


@contradiction
def _axes(exp: Experiment) -> list[tuple[str, str]]:
    """Tensor and expert parallelism (docs/strategies.md): what they have been trained against one rank with."""
    s, t, out = exp.strategy, exp.train, []
    for key, name in (("tensor_parallel", "tensor parallelism"), ("expert_parallel", "expert parallelism"),
                      ("pipeline_stages", "pipeline stages")):  # fmt: skip
        n = getattr(s, key)
        if n == "auto" or n == 1:
            continue
        if n == 0:
            out.append((f"strategy.{key}", "0 ranks cannot hold a model: give 1 (off), a degree, or auto"))
            continue
        if exp.model.factory is not None:
            out.append((f"strategy.{key}", f"{name} divides a transformers model's layers; a factory's model is "
                        "its own: set 1"))  # fmt: skip
        elif t.objective != "sft":
            out.append(
                (f"strategy.{key}", f"{t.objective} with {name} is not verified yet (sft is); set 1 or auto")
            )
        elif exp.model.lora is not None:
            why = PP_LORA if key == "pipeline_stages" else AXES_LORA
            out.append((f"strategy.{key}", f"LoRA with {name} is refused: {why}; set 1, or model.lora: null"))
        if key == "expert_parallel" and t.precision == "fp32":
            out.append((f"strategy.{key}", "AutoEP trains in bf16 (its grouped expert kernels): set "
                        "train.precision: bf16"))  # fmt: skip
    return out + _stages(exp)


def _stages(exp: Experiment) -> list[tuple[str, str]]:
    """Pipeline stages (docs/strategies.md): what DeepSpeed's pipeline engine takes, and what is verified with it."""
    s, out, key = exp.strategy, [], "strategy.pipeline_stages"
    n = s.pipeline_stages
    if n == "auto" or n in (0, 1):
        return out
    if s.zero_stage in (2, 3):
        out.append((key, f"DeepSpeed's pipeline engine takes ZeRO 0 and 1 only (\"ZeRO-2 and ZeRO-3 are incompatible "
                    f"with pipeline parallelism\"), and strategy.zero_stage is {s.zero_stage}; set zero_stage: 1 "
                    "(the optimizer states partitioned over each stage's data-parallel ranks) or auto"))  # fmt: skip
    for other in (
        "sequence_parallel",
        "expert_parallel",
    ):  # (tensor parallelism inside the stages: 3D, verified)
        if getattr(s, other) not in ("auto", 1):
            out.append((key, f"pipeline stages with strategy.{other}: {getattr(s, other)} are not verified here "
                        "(each axis is trained against one rank alone); set one of them to 1"))  # fmt: skip
    if exp.model.chunked_loss is True:
        out.append((key, "the tiled loss multiplies by the LM head's weight, which the last stage holds, where the "
                    "pipeline's loss sees the logits; set model.chunked_loss: false (or auto)"))  # fmt: skip
    return out


# Why LoRA is refused under pipeline stages (issue 71): not trained against one rank here yet
PP_LORA = (
    "the stages are built from the transformers model's own layers and not yet trained with peft's wrapped ones "
    "against one rank (nor their adapter files written from the pipeline's layer files)"
)

# Why LoRA is refused under tensor and expert parallelism (measured, issue 70: a grouped-query Llama, r=4, ZeRO-1, 2 CPU
# ranks)
AXES_LORA = (
    "AutoTP replaces the projections peft's LoRA layers wrap after the optimizer's groups are made, and DeepSpeed "
    "0.19.8's ZeRO optimizer then cannot map them (KeyError: Parameter in stage_1_and_2's _create_param_mapping, "
    "measured); AutoEP's replaced experts are not verified with adapters either"
)
