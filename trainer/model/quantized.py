"""model.lora.quantization (QLoRA): the frozen base's linear layers loaded by bitsandbytes in 4 bits
(NF4 with double quantization, as QLoRA) or 8 bits (LLM.int8), what the planner counts of them, and
their dequantized values for export."""

from __future__ import annotations

from typing import Any

from trainer.common.errors import UserError
from trainer.config import ModelSection
from trainer.strategy.planning.candidates import Quantized, nf4


def quantization(
    section: ModelSection, run_dtype: Any, zero3: bool = False, model_type: str | None = None
) -> dict[str, Any]:
    """from_pretrained's arguments for model.lora.quantization (bitsandbytes: 4bit = QLoRA's NF4 with
    double quantization; 8bit = LLM.int8), on this rank's device; {} without one. `run_dtype`: the dtype
    the engine holds floating-point parameters in (bf16, fp16 or fp32). The packed 4-bit weights are
    stored in it whatever they compute in (compute_dtype): DeepSpeed casts every floating-point
    parameter to it, which would rewrite packed bytes held in any other, and ZeRO-3 partitions them so."""
    q = section.lora.quantization if section.lora is not None else None
    if q not in ("4bit", "8bit"):
        return {}
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        raise UserError(
            f"model.lora.quantization: {q} needs bitsandbytes, which is not installed: pip install -e '.[qlora]' "
            "(or pip install 'bitsandbytes>=0.50'), or set it to none"
        )
    import torch
    from transformers import BitsAndBytesConfig

    from trainer.model.vision import unquantized

    lora = section.lora
    dtype = compute_dtype(lora, run_dtype)
    # a vision-language model (`model_type`): its vision tower and projector stay in the training precision
    skip = {"llm_int8_skip_modules": names} if (names := unquantized(model_type)) else {}
    if q == "4bit":
        config = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=lora.quant_type, bnb_4bit_use_double_quant=lora.double_quant,
            bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=run_dtype, **skip,
        )  # fmt: skip
    else:
        config = BitsAndBytesConfig(load_in_8bit=True, **skip)
    if zero3:  # zero.Init places and partitions the weights itself
        return {"quantization_config": config}
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    return {"quantization_config": config, "device_map": {"": device}}


def compute_dtype(lora: Any, held: Any) -> Any:
    """The dtype a 4-bit layer computes in: model.lora.compute_dtype, `auto` = the engine's (`held`)."""
    import torch

    return {"auto": held, "bf16": torch.bfloat16, "fp32": torch.float32}[lora.compute_dtype]


def bnb_layers(model: Any, kinds: tuple[str, ...] = ("Linear4bit", "Linear8bitLt")) -> list[tuple[str, Any]]:
    """(name, module) of bitsandbytes' own quantized layers in `model` (not peft's wrappers of them)."""
    return [(name, m) for name, m in model.named_modules()
            if type(m).__module__.startswith("bitsandbytes") and type(m).__name__ in kinds]  # fmt: skip


def quiet_bitsandbytes() -> None:
    """bitsandbytes on a CPU with AVX512-BF16 asks for the hub-downloaded `kernels` package: this
    project's choice is its own CPU kernels (no network at run time), nothing to report."""
    import logging

    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def quantized_count(module: Any, section: ModelSection) -> Quantized | None:
    """ModelInfo.quantized for model.lora.quantization, from the model on the meta device: the linear
    layers bitsandbytes replaces (every nn.Linear and GPT-2's Conv1D but the output embedding, as
    transformers converts them)."""
    q = section.lora.quantization if section.lora is not None else None
    if q not in ("4bit", "8bit"):
        return None
    import torch
    from transformers.pytorch_utils import Conv1D

    from trainer.model.vision import unquantized

    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    skip = unquantized(getattr(getattr(module, "config", None), "model_type", None))  # a vision tower's
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    if type(base).__name__.endswith(
        "ForSequenceClassification"
    ):  # its score head (the output layer): bnb keeps it
        skip = (*skip, "score")
    layers = [m for name, m in module.named_modules() if isinstance(m, torch.nn.Linear | Conv1D)
              and m is not head and ".lora_" not in name and not m.weight.requires_grad
              and not any(f".{s}." in f".{name}." for s in skip)]  # the frozen base's  # fmt: skip
    sizes = tuple(sorted(m.weight.numel() for m in layers))
    if q == "8bit":  # int8 weights and an fp32 scale per output row
        rows = sum(m.weight.shape[1 if isinstance(m, Conv1D) else 0] for m in layers)
        return Quantized(sum(sizes), 1.0, 0.0, 4 * rows // max(1, len(layers)), sizes)
    return nf4(sizes, section.lora.double_quant)


def stored_quantized(section: ModelSection, cfg: Any) -> None:
    """A checkpoint stored quantized (its config.json has a quantization_config: a bnb-4bit upload, GPTQ,
    AWQ...) loads quantized whatever the experiment says. Its weights cannot train in full, and LoRA
    over it is QLoRA, planned and checkpointed as such only when model.lora.quantization says so:
    refused otherwise, naming the setting."""
    stored = getattr(cfg, "quantization_config", None)
    if stored is None:
        return
    stored = stored if isinstance(stored, dict) else stored.to_dict()
    method = stored.get("quant_method", "an unknown method")
    bits = "4bit" if stored.get("load_in_4bit") else "8bit" if stored.get("load_in_8bit") else None
    where = (
        f"model.pretrained: {section.pretrained} is stored quantized ({method}{', ' + bits if bits else ''})"
    )
    if section.lora is None:
        raise UserError(f"{where}: quantized weights cannot be trained in full; add model.lora (adapters over it, "
                        f"quantization: {bits or '4bit'}) or give the model's unquantized weights")  # fmt: skip
    if method != "bitsandbytes" or bits is None:
        raise UserError(f"{where}: only bitsandbytes' 4bit and 8bit are supported under the adapters; give the "
                        "model's unquantized weights (model.lora.quantization then quantizes them as they load)")  # fmt: skip
    if section.lora.quantization != bits:
        raise UserError(f"{where}: set model.lora.quantization: {bits} (it loads so whatever the setting says, "
                        "and the plan and the checkpoints must know it)")  # fmt: skip
    lora = section.lora
    kept = {
        "quant_type": stored.get("bnb_4bit_quant_type", "fp4"),
        "double_quant": stored.get("bnb_4bit_use_double_quant", False),
    }
    differ = [
        f"model.lora.{k}: {str(v).lower()}"
        for k, v in kept.items()
        if bits == "4bit" and getattr(lora, k) != v
    ]
    if differ:
        raise UserError(f"{where}: its weights are stored so; set {', '.join(differ)}")


def one_layout(model: Any) -> None:
    """Keep every 4-bit weight in the layout it was loaded in. On a CPU with AVX512-BF16, bitsandbytes'
    Linear4bit repacks its weight in place for a faster kernel at its first forward in eval mode without
    gradients (an eval pass, DPO's reference log-probs) and marks the quantization state so. At ZeRO-3
    the weight is gathered again from its partition, in the old layout, under the new mark: every
    later forward computed with scrambled weights, silently (a DPO run's first margin 0.139, not 0).
    Training and eval compute alike instead."""
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False


def loaded_quantized(model: Any, section: ModelSection, held: Any, zero3: bool) -> None:
    """A model loaded with model.lora.quantization, made to compute as the experiment says: one layout
    (`one_layout`), every 4-bit layer computing in compute_dtype (a checkpoint stored quantized brings
    its own, often fp16, which transformers keeps), and its packed weights held where DeepSpeed leaves
    them whole: in `held` (the engine's dtype, which it casts floating-point parameters to) or as bytes,
    which ZeRO-3 cannot partition as planned."""
    one_layout(model)
    compute = compute_dtype(section.lora, held)
    for name, m in bnb_layers(model, ("Linear4bit",)):
        m.compute_dtype = compute
        stored = m.weight.dtype
        if (stored.is_floating_point and stored != held) or (not stored.is_floating_point and zero3):
            raise UserError(
                f"model.pretrained: {section.pretrained} stores its 4-bit weights as {stored} ({name}), which "
                f"{'DeepSpeed would cast to ' + str(held) + ', rewriting the packed bytes' if stored.is_floating_point else 'ZeRO-3 cannot partition'}; "
                "give the model's unquantized weights (model.lora.quantization quantizes them as they load)"
                + ("" if stored.is_floating_point else ", or pin strategy.zero_stage below 3")
            )  # fmt: skip


def quantized_layers(model: Any) -> int:
    """bitsandbytes' own quantized layers in `model` (4-bit Linear4bit, 8-bit Linear8bitLt)."""
    return len(bnb_layers(model))


def check_built(module: Any, lora: Any, planned: Quantized | None) -> list[str]:
    """A model built with model.lora.quantization, checked before DeepSpeed wraps it: something was
    quantized (transformers may drop the request on some path: never train unasked bf16), nothing
    quantized trains (model.lora.train_modules: peft's trainable copy of a quantized layer gets no
    gradient). Returns the lines rank 0 logs: what was quantized, and whether the plan counted it."""
    n = quantized_layers(module)
    if n == 0:
        raise UserError(
            f"model.lora.quantization: {lora.quantization} was asked for, but no layer of the loaded model is "
            "quantized; set it to none to train on the weights in the training precision"
        )
    trained = [name for name, p in module.named_parameters() if p.requires_grad and (
        getattr(p, "quant_state", None) is not None or not p.is_floating_point())]  # fmt: skip
    if trained:
        raise UserError(
            f"model.lora.train_modules: {', '.join(lora.train_modules)} would train quantized weights "
            f"({trained[0]}{' ...' if len(trained) > 1 else ''}), which get no gradient; name modules that "
            "are not quantized (the embeddings, the head) or set model.lora.quantization: none"
        )
    counted = len(planned.sizes) if planned else 0
    what = f"4bit {lora.quant_type}{', double quantization' if lora.double_quant else ''}" if (
        lora.quantization == "4bit") else "8bit (LLM.int8)"  # fmt: skip
    lines = [] if counted == n else [f"warning: the memory plan counted {counted} quantized layers, bitsandbytes "
                                     f"quantized {n}: the planned bytes of the base are off by the difference"]  # fmt: skip
    return [
        *lines,
        f"base weights: {what}, {n} linear layers quantized by bitsandbytes (frozen; adapters train)",
    ]


def dequantized(module: Any, dtype: Any) -> dict[str, Any]:
    """{parameter name: its values in `dtype`, in the layer's own shape} for every quantized weight of
    `module` (bitsandbytes' Params4bit and Int8Params): what a forward computes with."""
    import bitsandbytes.functional as F
    import torch

    out = {}
    for name, p in module.named_parameters():
        state = getattr(p, "quant_state", None)
        if state is not None:  # 4-bit: the packed values through the code, scaled by the blocks' absmax
            out[name] = F.dequantize_4bit(p.data, state).to(dtype)
        elif getattr(p, "SCB", None) is not None and p.dtype == torch.int8:  # LLM.int8: a scale per row
            out[name] = (p.data.float() * p.SCB.float().unsqueeze(1) / 127).to(dtype)
    return out
