"""The activation levers' run-time pieces that need no second rank (trainer/model/sequence.py): the
tiled MLP computes what the MLP does (1e-6 in fp32, loss and every gradient), the packed-aware sdpa
core keeps packed examples apart without a mask, and the per-family Ulysses check takes the families
whose attention goes through transformers' attention functions and refuses the others. (Sequence
parallelism itself: tests/dist/test_sequence_parallel.py; the tiled loss: test_loss.py.)"""

import copy
import types

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from trainer.errors import UserError
from trainer.model import sequence

SHAPES = {
    "llama": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256),
    "qwen3": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=256),
    "gpt2": dict(n_layer=2, n_embd=32, n_head=4, n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
}  # fmt: skip


def tiny(model_type):
    cfg = AutoConfig.for_model(
        model_type, vocab_size=97, bos_token_id=0, eos_token_id=0, **SHAPES[model_type]
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()


def loss_and_grads(model, ids):
    model.zero_grad()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", list(SHAPES))
def test_the_tiled_mlp_computes_what_the_mlp_does(model_type):
    model = tiny(model_type)
    ids = torch.randint(1, 97, (2, 200), generator=torch.Generator().manual_seed(1))
    want, want_grads = loss_and_grads(model, ids)
    tiled = copy.deepcopy(model)
    assert sequence.tile_mlps(tiled, 200) == 2  # 200 tokens in shards of about 32: 7 a row
    got, grads = loss_and_grads(tiled, ids)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    assert grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=1e-6, msg=name)


def test_a_model_without_mlps_to_tile_is_refused_with_the_key():
    with pytest.raises(UserError, match=r"model.tiled_mlp: .* set it to false"):
        sequence.tile_mlps(torch.nn.Sequential(torch.nn.Linear(2, 2)), 8)


def test_the_packed_core_keeps_packed_examples_apart():
    """Ulysses hands the core the whole sequence with no mask: where the position ids restart, each
    example attends within itself, as it would alone; with no restart, the plain causal attention."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 10, 8) for _ in range(3))
    module = types.SimpleNamespace(is_causal=True, training=False, num_key_value_groups=1)
    attend = sequence.packed_sdpa(sdpa_attention_forward)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])
    got, _ = attend(module, q, k, v, None, position_ids=pos)
    first, _ = sdpa_attention_forward(module, q[:, :, :6], k[:, :, :6], v[:, :, :6], None)
    second, _ = sdpa_attention_forward(module, q[:, :, 6:], k[:, :, 6:], v[:, :, 6:], None)
    torch.testing.assert_close(got, torch.cat([first, second], dim=1), rtol=1e-6, atol=1e-6)
    whole, _ = attend(module, q, k, v, None, position_ids=torch.arange(10)[None])
    plain, _ = sdpa_attention_forward(module, q, k, v, None)
    torch.testing.assert_close(whole, plain, rtol=0, atol=0)
    assert not torch.allclose(got, plain, atol=1e-3)  # the mask changed what the second example saw


def test_shards_cut_after_the_labels_are_shifted():
    rows = torch.stack([torch.arange(8), torch.tensor([-100, -100, 2, 3, 4, -100, 6, 7]), torch.arange(8)])[
        None
    ]
    ids, pos, labels = sequence.shard(rows, 2, 0)
    assert ids.tolist() == [[0, 1, 2, 3]] and pos.tolist() == [[0, 1, 2, 3]]
    assert labels.tolist() == [
        [-100, 2, 3, 4]
    ]  # the first shard's last token is trained on the second's first
    assert sequence.shard(rows, 2, 1)[2].tolist() == [[-100, 6, 7, -100]]  # the row's last has no next


HYBRID = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, layer_types=["conv", "full_attention"])  # fmt: skip


@pytest.mark.parametrize(
    ("model_type", "fields", "why"),
    [
        ("llama", SHAPES["llama"], None),
        ("qwen3", SHAPES["qwen3"], None),
        ("gpt2", SHAPES["gpt2"], None),  # learned positions, and it reads the attention output as 4-D
        ("mixtral", dict(SHAPES["llama"], num_local_experts=4), None),  # experts: rounding, not mixing
        ("falcon", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4), "attention functions"),
        ("lfm2", HYBRID, "layers other than its attention mix positions"),  # a convolution beside attention
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_the_family_check_takes_the_families_whose_attention_ulysses_can_replace(model_type, fields, why):
    cfg = AutoConfig.for_model(model_type, vocab_size=97, bos_token_id=0, eos_token_id=0, **fields)
    problem = sequence.ulysses_verdict(cfg, "sdpa")
    if why is None:
        assert problem is None, problem
    else:
        assert why in (problem or ""), problem
