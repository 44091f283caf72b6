"""model.lora.kernels: fused (issue 55 item 2): a LoRA layer's adapter branch as one autograd function.
The number of kernels a LoRA layer launches in a forward and backward is held here (a test fails if it
grows), against peft's modules; the fused layer computes peft's values (bitwise in fp32, dropout's mask
drawn alike), at every dropout, over the families' projections (Llama's seven, GPT-2's Conv1D), with a
4-bit base; and the layers fall back to peft where the branch does not apply (ZeRO-3's placeholders,
several adapters, disabled adapters)."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM

from trainer.model.lora_kernels import fused_layers, install

# operators that launch no kernel: views, transposes, autograd's bookkeeping, the harness's sum
NO_KERNEL = {"t", "view", "_unsafe_view", "detach", "expand", "ones_like", "sum", "transpose", "reshape",
             "as_strided", "alias", "unsqueeze", "squeeze", "permute"}  # fmt: skip
# kernels of one LoRA linear layer's forward and backward (the base's included), fused: the base's product
# and its input's gradient, A's product, one addmm for B's product with the scaling and the sum; backward's
# four small products, two in-place scalings and autograd's sum of the input's two gradients; dropout adds
# its kernel and two of its backward's (peft: 12 and 17)
FUSED_KERNELS = {0.0: 11, 0.05: 14}


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    @property
    def kernels(self):
        return [o for o in self.ops if o not in NO_KERNEL]


class One(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(128, 128, bias=False)

    def forward(self, x):
        return self.proj(x)


def pair(dropout, dtype=torch.bfloat16):
    torch.manual_seed(0)
    peft = get_peft_model(
        One(), LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout, target_modules=["proj"])
    )
    peft = peft.to(dtype)
    fused = copy.deepcopy(peft)
    assert install(fused) == 1 and fused_layers(fused) == 1 and fused_layers(peft) == 0
    return peft, fused


@pytest.mark.parametrize("dropout", [0.0, 0.05])
def test_a_lora_layer_launches_no_more_kernels_than_held(dropout):
    counts = {}
    for name, m in zip(("peft", "fused"), pair(dropout), strict=True):
        m.train()
        x = torch.randn(2, 64, 128, dtype=torch.bfloat16, requires_grad=True)
        with Count() as c:
            m(x).sum().backward()
        counts[name] = c.kernels
    print(
        f"dropout {dropout}: peft {len(counts['peft'])} kernels, fused {len(counts['fused'])}: {counts['fused']}"
    )
    assert len(counts["fused"]) <= FUSED_KERNELS[dropout], counts["fused"]
    assert len(counts["fused"]) < len(counts["peft"])


def family(model_type):
    torch.manual_seed(0)
    if model_type == "gpt2":
        cfg = AutoConfig.for_model("gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=96, resid_pdrop=0,
                                   embd_pdrop=0, attn_pdrop=0)  # fmt: skip
        targets, fan = ["c_attn", "c_proj", "c_fc"], True
    else:
        cfg = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=96)  # fmt: skip
        targets, fan = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False
    return AutoModelForCausalLM.from_config(cfg).float(), targets, fan


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "mistral", "gpt2"])
def test_the_fused_branch_computes_peft_s_values(model_type, dropout):
    """fp32: the same loss and gradients as peft's modules, bit for bit, dropout included (its mask drawn
    from the same generator in the same order); in eval mode no dropout on either."""
    base, targets, fan = family(model_type)
    a = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=targets,
                                        fan_in_fan_out=fan))  # fmt: skip
    for n, p in a.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    b = copy.deepcopy(a)
    assert install(b) == fused_layers(b) > 0
    ids = torch.randint(3, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    out = []
    for m in (a, b):
        m.train()
        torch.manual_seed(2)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in m.parameters() if p.grad is not None]))
    assert torch.equal(out[0][0], out[1][0])
    for ga, gb in zip(out[0][1], out[1][1], strict=True):
        assert torch.equal(ga, gb)
    a.eval(), b.eval()
    with torch.no_grad():
        assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)


def test_bf16_differs_from_peft_only_in_the_rounding_of_the_sum():
    """bf16: addmm rounds the scaled product and the sum once, peft three times: within a unit or two in the
    last place of the layer's output."""
    peft, fused = pair(0.0)
    for n, p in peft.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.5)
    fused.load_state_dict(peft.state_dict())
    x = torch.randn(2, 64, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        a, b = peft(x).float(), fused(x).float()
    assert ((a - b).abs() <= 2 * torch.finfo(torch.bfloat16).eps * a.abs().clamp(min=1)).all()


def test_the_fused_branch_over_a_4bit_base_is_peft_s():
    bnb = pytest.importorskip("bitsandbytes")
    from trainer.model.quantized import quiet_bitsandbytes

    quiet_bitsandbytes()
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 128, bias=False)
    q = bnb.nn.Linear4bit(128, 128, bias=False, compute_dtype=torch.float32, quant_type="nf4")
    q.weight = bnb.nn.Params4bit(lin.weight.data.clone(), requires_grad=False, quant_type="nf4")
    q = q.to("cpu")

    class Q(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = q

        def forward(self, x):
            return self.proj(x)

    a = get_peft_model(Q(), LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["proj"]))
    for n, p in a.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    b = copy.deepcopy(a)
    assert install(b) == 1
    x = torch.randn(4, 128, requires_grad=True)
    ya, yb = a(x), b(x)
    assert torch.allclose(ya, yb, rtol=1e-6, atol=1e-6)


def test_peft_s_own_forward_where_the_branch_does_not_apply():
    """Disabled adapters (the reference of DPO with LoRA), several active adapters, a ZeRO-3 placeholder:
    peft's forward, call by call."""
    peft, fused = pair(0.0, torch.float32)
    for n, p in fused.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 8, 128)
    with torch.no_grad():
        on = fused(x)
        with fused.disable_adapter():
            off = fused(x)
        assert torch.equal(off, fused.base_model.model.proj.base_layer(x)) and not torch.equal(on, off)
    layer = fused.base_model.model.proj
    layer.lora_A["default"].weight.ds_id = 0  # as ZeRO-3 marks its placeholders
    calls = []
    original = type(layer).__mro__[1].forward
    type(layer).__mro__[1].forward = lambda self, *a, **k: calls.append(1) or original(self, *a, **k)
    try:
        fused(x)
    finally:
        type(layer).__mro__[1].forward = original
        del layer.lora_A["default"].weight.ds_id
    assert calls == [1]


def test_a_lora_b_bias_falls_back_to_peft_s_module():
    """peft's lora_bias=True gives lora_B a bias, which the fused branch does not compute: such a layer runs
    peft's own forward, so its output is peft's and the bias gets its gradient (the branch had ignored it:
    outputs off by the bias, no gradient)."""

    class Biased(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(128, 128, bias=True)

        def forward(self, x):
            return self.proj(x)

    torch.manual_seed(0)
    peft = get_peft_model(Biased(), LoraConfig(r=8, lora_alpha=16, target_modules=["proj"], lora_bias=True))
    for n, p in peft.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.5)
    fused = copy.deepcopy(peft)
    install(fused)
    x = torch.randn(2, 8, 128)
    want, got = peft(x), fused(x)
    torch.testing.assert_close(got, want)
    got.sum().backward()
    bias = fused.base_model.model.proj.lora_B["default"].bias
    assert bias.grad is not None and bias.grad.abs().sum() > 0


def test_a_fused_model_pickles_and_torch_saves(tmp_path):
    """copy.deepcopy, pickle and torch.save of a model with fused layers (the class is made at run time): the
    copy is fused too and computes the same values, also where the class has to be made again (a fresh
    process, here the cache emptied)."""
    import pickle

    from trainer.model import lora_kernels

    _, fused = pair(0.0, torch.float32)
    for n, p in fused.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 8, 128)
    want = fused(x)
    data = pickle.dumps(fused)
    torch.save(fused, tmp_path / "model.pt")
    # as in a new process: no fused class made yet
    made = [k for k, v in vars(lora_kernels).items() if isinstance(v, type) and k.startswith("Fused")]
    for k in made:
        delattr(lora_kernels, k)
    lora_kernels._fused_class.cache_clear()
    for copy_ in (pickle.loads(data), torch.load(tmp_path / "model.pt", weights_only=False)):
        assert fused_layers(copy_) == 1
        torch.testing.assert_close(copy_(x), want)
