"""The activation levers' run-time pieces that need no second rank (trainer/model/sequence.py): the
tiled MLP computes what the MLP does (1e-6 in fp32, loss and every gradient), the packed-aware sdpa
core keeps packed examples apart without a mask, and the per-family Ulysses check takes the families
whose attention goes through transformers' attention functions and refuses the others. (Sequence
parallelism itself: tests/dist/test_sequence_parallel.py; the tiled loss: test_loss.py.)"""

import copy
import importlib
import types

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from trainer.common.errors import UserError
from trainer.model import sequence

activations = importlib.import_module(
    "trainer.strategy.planning.activations"
)  # the module (a function shares its name)

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


def _reference(q, k, v, window=None):
    """Each position's attention over the keys a causal (windowed) mask allows, the long way."""
    n = q.shape[2]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allowed = (j <= i) & ((i - j < window) if window else True)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v


@pytest.mark.parametrize("window", [None, 3, 600])
def test_the_sequence_parallel_core_keeps_examples_apart_and_windows_without_a_dense_mask(
    window, monkeypatch
):
    """Ulysses hands the core the whole sequence with no mask: where the position ids restart, each
    example attends within itself, as it would alone, within the layer's sliding window where it passes
    one (in blocks of WINDOW_BLOCK queries: set to 4 here so that windows cross blocks); with no
    restart, the plain causal attention."""
    monkeypatch.setattr(activations, "WINDOW_BLOCK", 4)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 14, 8, requires_grad=True) for _ in range(3))
    module = types.SimpleNamespace(is_causal=True, training=False, num_key_value_groups=1)
    pos = torch.tensor([[*range(14)], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6, 7]])
    got, _ = sequence.sequence_sdpa(module, q, k, v, None, position_ids=pos, sliding_window=window)
    assert got.shape == (2, 14, 4, 8)  # (batch, sequence, heads, size), as transformers' attention functions
    want = torch.stack([
        _reference(q[:1], k[:1], v[:1], window)[0],
        torch.cat([_reference(q[1:, :, :6], k[1:, :, :6], v[1:, :, :6], window)[0],
                   _reference(q[1:, :, 6:], k[1:, :, 6:], v[1:, :, 6:], window)[0]], dim=1),
    ]).transpose(1, 2)  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    weights = torch.randn_like(got)  # and the gradients towards q, k and v
    mine = torch.autograd.grad((got * weights).sum(), (q, k, v))
    theirs = torch.autograd.grad((want * weights).sum(), (q, k, v))
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    q, k, v = q.detach(), k.detach(), v.detach()
    kv = sequence.sequence_sdpa(module, q, k[:, :2], v[:, :2], None, position_ids=pos, sliding_window=window)[
        0
    ]
    torch.testing.assert_close(kv, sequence.sequence_sdpa(  # grouped key/value heads: repeated
        module, q, k[:, :2].repeat_interleave(2, 1), v[:, :2].repeat_interleave(2, 1), None, position_ids=pos,
        sliding_window=window)[0])  # fmt: skip


@pytest.mark.parametrize(("kwarg", "why"), [("s_aux", "sinks"), ("softcap", "softcaps")])
def test_the_sequence_parallel_core_refuses_what_it_cannot_honour(kwarg, why):
    q = torch.randn(1, 2, 4, 8)
    module = types.SimpleNamespace(is_causal=True)
    with pytest.raises(sequence.UnsupportedAttention, match=why):
        sequence.sequence_sdpa(
            module, q, q, q, None, position_ids=torch.arange(4)[None], **{kwarg: torch.ones(2)}
        )


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
        # sliding windows (the check's small model: a window of 6 in rows of 16), honoured by the core
        ("mistral", dict(SHAPES["llama"], sliding_window=16), None),
        (
            "qwen2",
            dict(SHAPES["llama"], use_sliding_window=True, sliding_window=16, max_window_layers=0),
            None,
        ),
        (
            "gemma3_text",
            dict(SHAPES["qwen3"], sliding_window=16, layer_types=["sliding_attention", "full_attention"]),
            None,
        ),
        ("phi3", dict(SHAPES["llama"], sliding_window=16, pad_token_id=0), None),
        # sinks (gpt-oss) and softcapping (Gemma 2): transformers has no sdpa path for them (the core
        # refuses both too: test_the_sequence_parallel_core_refuses_what_it_cannot_honour)
        (
            "gpt_oss",
            dict(
                SHAPES["qwen3"],
                num_local_experts=4,
                num_experts_per_tok=2,
                sliding_window=16,
                layer_types=["sliding_attention", "full_attention"],
            ),
            "could not be built with sdpa",
        ),
        ("gemma2", dict(SHAPES["qwen3"], sliding_window=16), "could not be built with sdpa"),
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


def test_the_family_check_drops_the_masks_as_the_run_does(monkeypatch):
    """A core that ignored the layer's sliding window (as the mask-only one did: transformers' sdpa path
    applies windows through the mask alone, which Ulysses drops) is caught: Mistral's logits past the
    window differ, and the family is refused with the measured difference."""
    real = sequence.sequence_sdpa

    def windowless(module, q, k, v, mask, *args, sliding_window=None, **kwargs):
        return real(module, q, k, v, mask, *args, **kwargs)

    monkeypatch.setattr(sequence, "sequence_sdpa", windowless)
    cfg = AutoConfig.for_model("mistral", vocab_size=97, bos_token_id=0, eos_token_id=0, sliding_window=16,
                               **SHAPES["llama"])  # fmt: skip
    problem = sequence.ulysses_verdict(cfg, "sdpa")
    assert "differ from its own by" in (problem or ""), problem


MEMORY = """
import sys, types, torch
from trainer.model import sequence
torch.set_num_threads(1)
n, window = int(sys.argv[1]), (None if sys.argv[2] == "none" else int(sys.argv[2]))
def status(key):
    return next(int(x.split()[1]) * 1024 for x in open("/proc/self/status") if x.startswith(key))
pos = torch.cat([torch.arange(n // 4)] * 4)[None]  # a row of 4 packed examples
m = types.SimpleNamespace(is_causal=True)
small = [torch.randn(1, h, 64, 16, requires_grad=True) for h in (4, 2, 2)]  # the kernels' one-off allocations
sequence.sequence_sdpa(m, *small, None, position_ids=pos[:, :64], sliding_window=window)[0].sum().backward()
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) from here
base = status("VmRSS:")
q = torch.randn(1, 4, n, 16, requires_grad=True)  # the gathered query, key and value: a rank's 4 heads of 16
k, v = (torch.randn(1, 2, n, 16, requires_grad=True) for _ in range(2))  # (2 key/value heads)
out, _ = sequence.sequence_sdpa(m, q, k, v, None, position_ids=pos, sliding_window=window)
out.sum().backward()
print(status("VmHWM:") - base)
"""


@pytest.mark.parametrize("window", [None, 1024])
def test_the_attentions_memory_at_a_long_length_is_the_planned_one(window):
    """One layer's attention over 32,768 tokens (a rank's 4 heads at sequence parallel 2, a row of 4
    packed examples, fp32), its gathered query, key and value, forward and backward, in a process of
    its own (its peak resident memory): within the plan's count (sequence_attention_bytes, and the
    output the layers' count holds: 2 contexts) and above 60% of it; a dense mask of the whole row, as
    the core built before, was 1 GiB (bool) by itself."""
    import subprocess
    import sys

    from trainer.strategy import ModelInfo

    n = 32768
    p = subprocess.run([sys.executable, "-c", MEMORY, str(n), str(window or "none")], capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    measured = int(p.stdout.split()[-1])
    info = ModelInfo(params=0, largest_layer=0, hidden=128, heads=8, kv_heads=4, window=window)
    context = n * 4 * 16 * 4  # the rank's heads over every token, fp32
    planned = activations.sequence_attention_bytes(info, 1, n, 4, 2) + 2 * context
    print(f"window {window}: measured {measured / 2**20:.1f} MiB ({measured / context:.1f} contexts), planned "
          f"{planned / 2**20:.1f} MiB; a dense bool mask {n * n / 2**20:.0f} MiB")  # fmt: skip
    assert 0.6 * planned <= measured <= planned
