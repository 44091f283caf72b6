"""model.attn_implementation: varlen (issue 55 item 2; trainer/model/varlen.py): a packed row's examples
kept apart in one attention call per layer, with no mask; packed = one by one, over the families it is
verified for (with grouped key/value heads and a sliding window), on the CPU path here, with a padding mask
too (the CUDA kernel: tests/unit/test_gpu_finetune.py and bench/finetune.py check); the engine's lengths equal the
position ids'; families it is not verified for are refused by name; auto picks it on CUDA only."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from trainer import config
from trainer.common.errors import UserError
from trainer.model import create, spec, varlen
from trainer.model.varlen import lengths_from_positions

FAMILIES = {
    "llama": {},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "mistral": {"sliding_window": 6},
}


def models(model_type, extra):
    varlen.register()
    cfg = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=96, **extra)  # fmt: skip
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()
    var = AutoModelForCausalLM.from_config(cfg, attn_implementation="varlen").float()
    var.load_state_dict(ref.state_dict())
    return ref, var


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_a_packed_row_trains_as_its_examples_one_by_one(model_type):
    ref, var = models(model_type, FAMILIES[model_type])
    lengths = [9, 1, 14]
    ids = torch.randint(3, 96, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    cu, longest = lengths_from_positions(pos)
    assert cu.tolist() == [0, 9, 10, 24] and longest == 14
    packed = var(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest,
                 max_length_k=longest).logits  # fmt: skip
    packed.sum().backward()
    g_packed = torch.cat([p.grad.flatten() for p in var.parameters()])
    alone, start = [], 0
    for n in lengths:
        alone.append(ref(input_ids=ids[:, start : start + n]).logits)
        start += n
    alone = torch.cat(alone, 1)
    alone.sum().backward()
    g_alone = torch.cat([p.grad.flatten() for p in ref.parameters()])
    assert torch.allclose(packed, alone, atol=1e-5), (packed - alone).abs().max()
    assert torch.allclose(g_packed, g_alone, atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # without the lengths, the position ids say the same (a synchronisation on CUDA)
        assert torch.allclose(var(input_ids=ids, position_ids=pos).logits, alone, atol=1e-5)
        crossed = var(input_ids=ids).logits  # one sequence: the examples see each other
    assert not torch.allclose(crossed, alone, atol=1e-3)


def test_one_attention_call_per_layer_for_a_packed_row(monkeypatch):
    """The examples of a row are kept apart inside one call of the attention a layer (no call per example)."""
    _, var = models("llama", {})
    calls = []
    original = varlen.varlen_attention_forward

    def counted(*a, **k):
        calls.append(1)
        return original(*a, **k)

    from transformers import AttentionInterface

    AttentionInterface.register("varlen", counted)
    try:
        pos = torch.cat([torch.arange(n) for n in (5, 7, 4)])[None]
        var(input_ids=torch.randint(3, 96, (1, 16)), position_ids=pos)
    finally:
        varlen.register()
    assert len(calls) == 2  # two layers


def test_the_engine_s_lengths_are_the_position_ids_rows_end_to_end():
    from trainer.engine import varlen_lengths

    batch = torch.zeros(2, 3, 8, dtype=torch.long)
    batch[0, 2] = torch.tensor(
        [0, 1, 2, 0, 1, 0, 0, 1]
    )  # examples of 3, 2, 1 and 2 tokens (the last padding)
    batch[1, 2] = torch.arange(8)
    kw = varlen_lengths(batch, torch.device("cpu"))
    assert kw["cu_seq_lens_q"].tolist() == [0, 3, 5, 6, 8, 16] and kw["max_length_q"] == 8
    assert varlen_lengths(torch.zeros(2, 8, dtype=torch.long), torch.device("cpu")) is None  # token blocks


def test_varlen_is_refused_for_a_family_it_is_not_verified_for():
    exp = config.load("configs/experiments/tiny.yaml", ["model.attn_implementation=varlen"])
    with pytest.raises(
        UserError, match="varlen attention is verified for llama, mistral, qwen2, qwen3, not 'gpt2'"
    ):
        create.info(exp.model, 257, None)


@pytest.mark.parametrize("device,precision,expected", [("cuda", "bf16", "varlen"), ("cuda", "fp32", None),
                                                       ("cpu", "bf16", "eager"), ("cpu", "fp32", None)])  # fmt: skip
def test_auto_picks_varlen_on_cuda_in_16_bits_for_its_families(device, precision, expected):
    llama = config.load(
        "configs/experiments/tiny.yaml",
        [
            'model.config={"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}'
        ],
    )
    assert spec.attention(llama.model, seq_len=128, precision=precision, device_type=device) == expected
    gpt2 = config.load("configs/experiments/tiny.yaml")
    assert spec.attention(gpt2.model, seq_len=1024, precision="bf16", device_type="cuda") is None


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_padding_mask_keeps_a_packed_row_s_examples_apart(side):
    """A 2-D padding mask beside a packed row (positions restarting at each example): the fallback keeps the
    examples apart and leaves the padding out, so each example's logits are its own run alone (it had dropped
    the examples' mask whenever a padding mask came, and they saw each other)."""
    ref, var = models("llama", {})
    lengths, pad = [9, 5], 3
    ids = torch.randint(3, 96, (1, sum(lengths) + pad), generator=torch.Generator().manual_seed(2))
    real = torch.cat([torch.arange(n) for n in lengths])
    fill = torch.ones(pad, dtype=torch.long)  # generate's positions of padding
    mask = torch.ones(1, sum(lengths) + pad, dtype=torch.long)
    if side == "right":
        pos, mask[0, -pad:], tokens = torch.cat([real, fill])[None], 0, slice(0, sum(lengths))
    else:
        pos, mask[0, :pad], tokens = torch.cat([fill, real])[None], 0, slice(pad, None)
    with torch.no_grad():
        packed = var(input_ids=ids, position_ids=pos, attention_mask=mask).logits[:, tokens]
        alone, start = [], tokens.start
        for n in lengths:
            alone.append(ref(input_ids=ids[:, start : start + n]).logits)
            start += n
    torch.testing.assert_close(packed, torch.cat(alone, 1), atol=1e-5, rtol=1e-5)
