"""QLoRA (`model.lora.quantization: 4bit`): LoRA adapters over a base loaded from model.pretrained with
bitsandbytes' NF4 weights (double quantization, computing in bf16, stored in bf16 so that ZeRO-3 can
partition them), on 2 ranks through the real launchers at ZeRO 0, 2 and 3: it trains, resumes bit for
bit from a checkpoint that holds the adapters and the optimizer and never the base, and the adapter
loads with peft's PeftModel over the 4-bit base."""

import pytest
import torch
from helpers import K, NODROP, assert_same_continuation, check_memory, falling, resume_sets, train

from trainer.files import file_lock

pytestmark = pytest.mark.dist
pytest.importorskip("bitsandbytes")

QLORA = {"model.lora": {"r": 4, "alpha": 8, "dropout": 0.0, "quantization": "4bit"}, "optim.lr": 1e-2,
         "optim.warmup_steps": 0, "train.precision": "bf16", "strategy.justification": "test"}  # fmt: skip
CASES = {"zero0": (0, "deepspeed"), "zero2": (2, "torchrun"), "zero3": (3, "deepspeed")}


def base_dir(shared_dir):
    """A Llama of the byte tokenizer's vocabulary, saved as a from_pretrained directory once a session:
    12.6M parameters in its linear layers (25 MB in bf16, 6.3 MB packed in 4 bits), enough for the
    planner's packed bytes and quantization state to be told apart from the rest."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = shared_dir / "qlora-base-512"
    with file_lock(shared_dir / "qlora-base.lock"):
        if not (out / "config.json").exists():
            torch.manual_seed(0)
            cfg = AutoConfig.for_model("llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                                       vocab_size=257, bos_token_id=256, eos_token_id=256)  # fmt: skip
            AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out


def sets_for(data, shared_dir, stage):
    model = {"model.config": None, "model.pretrained": str(base_dir(shared_dir))}
    return resume_sets(data, stage, **NODROP, **QLORA, **model)


@pytest.mark.parametrize("name", list(CASES))
def test_qlora_trains_resumes_bit_for_bit_and_its_adapter_loads_over_the_4bit_base(
    tmp_path, shared_dir, small_data, name
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    stage, launcher = CASES[name]
    sets = sets_for(small_data, shared_dir, stage)
    a = train(tmp_path / "a", sets, launcher=launcher)
    assert f"ZeRO stage {stage}" in a.output
    assert "base weights: 4bit nf4, double quantization, 28 linear layers quantized" in a.output, a.output[
        -3000:
    ]
    first, last = falling(a.losses)
    assert last < first * 0.97, (first, last)
    ckpt = a.run_dir / "checkpoints" / f"step_{2 * K:08d}"
    names = {p.name for p in ckpt.rglob("*") if p.is_file()}
    assert "adapter_model.safetensors" in names and not any("model.safetensors" == n for n in names)
    b = train(tmp_path / "b", sets, launcher="torchrun", extra_args=["--resume", str(a.run_dir / "checkpoints" /
                                                                                   f"step_{K:08d}")])  # fmt: skip
    assert_same_continuation(a, b)
    check_memory(a, name)  # the packed weights and their quantization state as planned, within 10%
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)  # fmt: skip
    base = AutoModelForCausalLM.from_pretrained(base_dir(shared_dir), quantization_config=quant,
                                                dtype=torch.bfloat16, device_map={"": "cpu"})  # fmt: skip
    model = PeftModel.from_pretrained(base, str(ckpt / "adapter")).eval()
    trained = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert trained and all(p.abs().sum() > 0 for p in trained)  # every B moved
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()
