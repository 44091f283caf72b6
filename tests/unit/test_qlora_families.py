"""QLoRA over every family of the matrix (helpers.MATRIX): a tiny model of each saved as a pretrained
directory, loaded by model.build with model.lora.quantization: 4bit as a run loads it. For each, the
layers bitsandbytes quantized are the ones the planner counted (ModelInfo.quantized), the bytes the
loaded base holds (packed weights, their quantization state, the rest in bf16) are the plan's, and
the adapters train: a forward and backward on a packed row gives a finite loss and a gradient on every
adapter B. Experts stored as fused 3-D parameters (qwen3_moe, mixtral, gpt_oss, deepseek_v3's routed
experts in transformers 5) are no linear layers: they stay in the training precision, planned so."""

import pytest
import torch
from helpers import MATRIX, matrix_config, matrix_rows

from trainer import config, model
from trainer.model.quantized import quantized_layers
from trainer.run.consistency import quantization_state

pytest.importorskip("bitsandbytes")
ATTENTION = {"gpt_oss": "eager"}


def _storage_bytes(tensors):
    seen = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("model_type", list(MATRIX))
def test_qlora_loads_trains_and_is_planned_for_every_family(tmp_path, model_type):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(matrix_config(model_type)).save_pretrained(tmp_path)
    lora = {"r": 4, "alpha": 8, "dropout": 0.0, "quantization": "4bit"}
    if model_type != "gpt2":
        lora["target_modules"] = ["o_proj"]  # (a default exists for some families only)
    section = config.ModelSection.model_validate(
        {"pretrained": str(tmp_path), "lora": lora, "attn_implementation": ATTENTION.get(model_type, "sdpa")}
    )
    info = model.info(section, 97, 2)
    module = model.build(section, vocab_size=97, eos_id=2, seq_len=32, ds_config={"bf16": {"enabled": True}})
    n = quantized_layers(module)
    assert n > 0 and n == len(info.quantized.sizes), (n, info.quantized)
    q = info.quantized.elements
    params = list(module.parameters())
    quant = [p for p in params if getattr(p, "quant_state", None) is not None]
    dense = [p for p in params if getattr(p, "quant_state", None) is None]
    measured = _storage_bytes(p.data for p in quant) + _storage_bytes(quantization_state(module))
    measured += 2 * sum(p.numel() for p in dense)  # as DeepSpeed holds them in bf16
    planned = 2 * (info.params - q) + info.quantized.packed * q + info.quantized.state_bytes()
    assert measured == pytest.approx(planned, rel=0.01), (measured, planned)
    ids, labels, pos = matrix_rows()[1:2].unbind(1)
    out = module(input_ids=ids, labels=labels, position_ids=pos)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    adapters = [
        (name, p) for name, p in module.named_parameters() if "lora_B" in name
    ]  # (A has none while B is 0)
    assert adapters and all(p.grad is not None and p.grad.abs().sum() > 0 for _, p in adapters), model_type


def test_quantization_without_a_pretrained_model_or_bitsandbytes_is_refused_with_the_fix(monkeypatch):
    """A config model quantized would be a random initialisation in 4 bits: refused at load, naming
    model.pretrained. Without bitsandbytes: the error names the install (exit 2 through bin/train)."""
    import importlib.util

    from helpers import TINY

    from trainer.common.errors import ConfigError, UserError
    from trainer.model.quantized import quantization

    with pytest.raises(ConfigError, match="give model.pretrained"):
        config.load(TINY, ["model.lora={r: 4, quantization: 4bit}"])
    section = config.ModelSection.model_validate(
        {"pretrained": "some/model", "lora": {"r": 4, "quantization": "4bit"}}
    )
    q = quantization(section, torch.bfloat16)["quantization_config"]
    assert (
        q.bnb_4bit_quant_type == "nf4"
        and q.bnb_4bit_use_double_quant
        and q.bnb_4bit_compute_dtype == torch.bfloat16
    )
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a)
    )
    with pytest.raises(UserError, match=r"pip install -e '\.\[qlora\]'"):
        quantization(section, torch.bfloat16)


def test_a_checkpoint_stored_quantized_is_refused_unless_the_experiment_says_so(tmp_path):
    """A bnb-4bit upload loads quantized whatever the experiment says: full fine-tuning of it (which
    trained only its norms and embeddings, silently) and LoRA that calls it unquantized or another
    4-bit type are refused, naming the setting; model.lora.quantization: 4bit with its own type loads."""
    from helpers import matrix_config
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from trainer.common.errors import UserError

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(matrix_config("llama")).save_pretrained(tmp_path / "fp32")
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)  # fmt: skip
    AutoModelForCausalLM.from_pretrained(
        tmp_path / "fp32", quantization_config=quant, device_map={"": "cpu"}
    ).save_pretrained(tmp_path / "bnb4")

    def section(lora):
        return config.ModelSection.model_validate({"pretrained": str(tmp_path / "bnb4"), "lora": lora})

    cases = {
        "quantized weights cannot be trained in full; add model.lora": None,
        "set model.lora.quantization: 4bit": {"r": 4},
        "set model.lora.quant_type: nf4": {"r": 4, "quantization": "4bit", "quant_type": "fp4"},
    }
    for message, lora in cases.items():
        with pytest.raises(UserError, match=message):
            model.hf_config(section(lora), 97, 2)
    assert model.hf_config(section({"r": 4, "quantization": "4bit"}), 97, 2).quantization_config
