"""LoRA adapters (trainer/model/adapters.py): which modules get them, what is trainable, and the
verification every checkpoint's adapter passes before the checkpoint becomes visible."""

import pytest
import torch

from trainer import config, model
from trainer.common.errors import UserError
from trainer.model import adapters

GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 64, "vocab_size": 64}
LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 64}  # fmt: skip


def build(cfg, **lora):
    section = config.ModelSection.model_validate({"config": cfg, "lora": {"r": 4, **lora}})
    return model.build(section, vocab_size=None, eos_id=None, seq_len=32)


@pytest.mark.parametrize("cfg, per_layer", [(GPT2, 4 * (32 + 96) + 4 * 64 + 4 * (32 + 128) + 4 * (128 + 32)),
                                            (LLAMA, 2 * 4 * (32 + 32) + 2 * 4 * (32 + 16) + 3 * 4 * (32 + 64))])  # fmt: skip
def test_the_default_targets_are_the_attention_and_mlp_projections(cfg, per_layer):
    m = build(cfg)
    trainable, total = adapters.trainable(m)
    assert trainable == 2 * per_layer
    assert all(("lora_" in n) == p.requires_grad for n, p in m.named_parameters())
    assert model.param_groups(m, 0.1)[0]["params"] and len(model.param_groups(m, 0.1)) == 1  # adapters only
    # The planner counts the same without allocating a weight.
    section = config.ModelSection.model_validate({"config": cfg, "lora": {"r": 4}})
    info = model.info(section)
    assert (info.trainable, info.params) == (trainable, total)


def test_a_target_that_matches_nothing_names_the_modules_there_are():
    with pytest.raises(
        UserError, match=r"model.lora.target_modules: 'q_proj' matches no module of this gpt2; .*c_attn"
    ):
        build(GPT2, target_modules=["q_proj"])
    with pytest.raises(UserError, match=r"model.lora.train_modules: 'head' matches no module"):
        build(GPT2, train_modules=["head"])


def test_train_modules_train_in_full_beside_the_adapters():
    """GPT-2 ties its LM head to the embedding: one trained copy, still tied (peft's ensure_weight_tying)."""
    m = build(GPT2, train_modules=["lm_head"])
    full = [n for n, p in m.named_parameters() if p.requires_grad and "lora_" not in n]
    assert full == ["base_model.model.transformer.wte.modules_to_save.default.weight"]
    assert adapters.trainable(m)[0] == 4096 + 64 * 32
    head, wte = m.base_model.model.lm_head, m.base_model.model.transformer.wte
    assert head.weight is wte.weight is wte.modules_to_save["default"].weight


def sound(m, stepped=True):
    state = {n: p.detach().clone() for n, p in m.named_parameters() if p.requires_grad}
    if stepped:
        for n, t in state.items():
            if "lora_B" in n:
                t.normal_()
    return state


def test_the_verification_passes_a_sound_adapter_and_names_every_fault():
    m = build(GPT2)
    expected = adapters.expected_shapes(m)
    assert adapters.verify(sound(m, stepped=False), expected, stepped=False) == []  # B is zero before a step
    assert adapters.verify(sound(m), expected, stepped=True) == []
    # B still zero after training steps: the adapter did not learn, or was not gathered.
    zero_b = [p for p in adapters.verify(sound(m, stepped=False), expected, stepped=True)]
    assert len(zero_b) == 8 and all("lora_B" in p and "all zero after training steps" in p for p in zero_b)
    # ZeRO-3's failure in other trainers: a rank's partition or an empty placeholder saved as the tensor.
    state = sound(m)
    name = next(iter(state))
    state[name] = torch.empty(0)
    bad = adapters.verify(state, expected, stepped=True)
    assert bad == [f"{name}: shape (0,), expected {expected[name]} (a partition, not gathered)"]
    del state[name]
    assert adapters.verify(state, expected, stepped=True) == [f"{name}: missing"]
    state = sound(m)
    state[name][0, 0] = float("nan")
    assert adapters.verify(state, expected, stepped=True) == [f"{name}: not finite"]


def test_a_failed_verification_fails_the_save_and_writes_nothing(tmp_path):
    m = build(GPT2)
    with pytest.raises(adapters.AdapterError, match="failed its verification, so the save fails: .*lora_B"):
        adapters.save(tmp_path / "adapter", m, zero3=False, is_main=True, stepped=True, base_name=None)
    assert not (tmp_path / "adapter").exists()
    for n, p in m.named_parameters():
        if "lora_B" in n:
            p.data.normal_()
    assert (
        adapters.save(tmp_path / "adapter", m, zero3=False, is_main=True, stepped=True, base_name="base") > 0
    )
    from peft import PeftModel

    base = model.build(
        config.ModelSection.model_validate({"config": GPT2}), vocab_size=None, eos_id=None, seq_len=32
    )
    base.load_state_dict({k.replace("base_model.model.", "").replace(".base_layer", ""): v
                          for k, v in m.state_dict().items() if "lora_" not in k})  # fmt: skip
    reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, m.eval()(input_ids=ids).logits)


@pytest.mark.parametrize("kernels", ["fused", "peft"])
def test_a_tied_head_trained_in_full_saves_and_loads_in_stock_peft(tmp_path, kernels):
    """model.lora.train_modules: [lm_head] with tie_word_embeddings (the Llama-3.2-1B/3B shape): peft wraps the
    head and the embedding around one trained weight, which named_parameters() lists once; the save gathers
    it under both names (peft's state dict asks for each wrapper's), and stock peft loads the adapter to the
    same logits. It raised KeyError 'modules_to_save.default.weight' at the first save."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tied = {**LLAMA, "tie_word_embeddings": True}
    base = model.build(config.ModelSection.model_validate({"config": tied}), vocab_size=None, eos_id=None,
                       seq_len=32)  # fmt: skip
    base.save_pretrained(tmp_path / "base")
    section = config.ModelSection.model_validate(
        {"config": tied, "lora": {"r": 4, "train_modules": ["lm_head"], "kernels": kernels}}
    )
    m = model.build(section, vocab_size=None, eos_id=None, seq_len=32)
    trained = [p for p in m.parameters() if p.requires_grad]
    with torch.no_grad():
        m.get_base_model().model.embed_tokens.original_module.weight.copy_(base.model.embed_tokens.weight)
        for n, p in m.named_parameters():
            if not p.requires_grad and "base_layer" in n:
                p.copy_(base.get_parameter(n.removeprefix("base_model.model.").replace(".base_layer", "")))
        for p in trained:
            p.add_(0.1 * torch.randn_like(p))
    head = m.get_base_model().lm_head
    assert head.weight is m.get_base_model().model.embed_tokens.weight  # still tied
    assert adapters.save(tmp_path / "adapter", m, zero3=False, is_main=True, stepped=True, base_name=None) > 0
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                         tmp_path / "adapter").eval()  # fmt: skip
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, m.eval()(input_ids=ids).logits)
