"""model.chunked_loss: the LM head and cross-entropy in chunks give transformers' causal LM loss and
its gradients, without the whole logits; the planner counts one chunk instead of them."""

import pytest
import torch
from helpers import TINY
from transformers import AutoConfig, AutoModelForCausalLM

from trainer import config, strategy
from trainer.common.errors import ConfigError, UserError
from trainer.model import loss

GiB = 2**30


def reference(hidden, weight, labels):
    """transformers' ForCausalLMLoss on the whole logits."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(hidden @ weight.t(), labels, vocab_size=weight.shape[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_and_gradients_match_the_whole_logits(dtype):
    torch.manual_seed(0)
    hidden = torch.randn(3, 17, 32, dtype=dtype, requires_grad=True)
    weight = (0.3 * torch.randn(101, 32, dtype=dtype)).requires_grad_()
    labels = torch.randint(0, 101, (3, 17))
    labels[0, 5] = labels[2, 9:] = -100  # ignored positions are not counted

    want = reference(hidden, weight, labels)
    want.backward()
    want_h, want_w = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    got = loss.linear_cross_entropy(hidden, weight, labels, rows=7)  # 51 rows: 8 chunks, the last short
    assert got.dtype == torch.float32
    (3 * got).backward()  # backward scales the saved gradients (DeepSpeed scales by 1/grad_accum)
    assert hidden.grad.dtype == dtype and weight.grad.dtype == dtype
    if dtype == torch.float32:
        assert got.item() == pytest.approx(want.item(), rel=1e-6)
        torch.testing.assert_close(hidden.grad, 3 * want_h, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(weight.grad, 3 * want_w, rtol=1e-5, atol=1e-7)
    else:  # bf16 operands, fp32 softmax in both; the head's gradient is summed over chunks in fp32
        assert got.item() == pytest.approx(want.item(), rel=1e-3)
        torch.testing.assert_close(hidden.grad, 3 * want_h, rtol=2e-2, atol=1e-3)
        torch.testing.assert_close(weight.grad, 3 * want_w, rtol=2e-2, atol=2e-3)

    with torch.no_grad():  # eval: the loss only, no gradients computed
        assert loss.linear_cross_entropy(hidden, weight, labels, rows=7).item() == pytest.approx(got.item())


def _old_chunks(hidden, weight, targets, rows, num_items=None):
    """The chunked loss as it was before the CPU products (torch.mm in the operands' precision): the
    native path must stay this, bit for bit."""
    from trainer.data.pack import IGNORE

    valid = targets != IGNORE
    denom = valid.sum().clamp(min=1).to(torch.float32)
    safe = torch.where(valid, targets, 0)[:, None]
    total = torch.zeros((), dtype=torch.float32)
    grad_h, grad_w = torch.empty_like(hidden), torch.zeros(weight.shape, dtype=torch.float32)
    for start in range(0, hidden.shape[0], rows):
        h, t, v = hidden[start : start + rows], safe[start : start + rows], valid[start : start + rows, None]
        logp = torch.log_softmax(torch.mm(h, weight.t()), dim=1, dtype=torch.float32)
        total = total - torch.where(v, logp.gather(1, t), 0.0).sum()
        g = logp.exp_().scatter_add_(1, t, torch.full_like(t, -1.0, dtype=logp.dtype)).to(h.dtype)
        grad_h[start : start + rows] = torch.mm(g, weight).float().mul_(v / denom).to(h.dtype)
        grad_w.add_(torch.mm(g.t(), h * v.to(h.dtype)))
    return total / denom, grad_h, grad_w.div_(denom)


def _bf16_case(vocab=3001, d=48, n=200):
    torch.manual_seed(1)
    hidden = torch.randn(n, d).to(torch.bfloat16)
    weight = (0.3 * torch.randn(vocab, d)).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (n,))
    targets[::7] = -100
    return hidden, weight, targets


def test_native_bf16_products_are_the_operands_own_mm_bit_for_bit(monkeypatch):
    """Where bf16 products are native (GPUs, AVX-512 hosts) the chunked loss is what it was: loss and
    both gradients equal the former implementation's bit for bit."""
    monkeypatch.setattr(loss, "native_bf16_matmul", lambda: True)
    hidden, weight, targets = _bf16_case()
    got = loss._chunks(hidden, weight, targets, rows=64, grads=True)
    want = _old_chunks(hidden, weight, targets, rows=64)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_without_native_bf16_products_the_same_math_runs_in_fp32(monkeypatch):
    """On a CPU without AVX-512 (make test-avx2) the three products of a bf16 chunk run in fp32 on the
    bf16 values and are rounded to bf16: the loss and gradients are the bf16 products' up to the order
    of fp32 sums (one bf16 rounding step at most), and fp32 runs are untouched."""
    hidden, weight, targets = _bf16_case()
    want = _old_chunks(hidden, weight, targets, rows=64)
    monkeypatch.setattr(loss, "native_bf16_matmul", lambda: False)
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: calls.append(a.dtype) or real_mm(a, b))
    got = loss._chunks(hidden, weight, targets, rows=64, grads=True)
    assert set(calls) == {torch.float32}, calls  # no bf16 product left
    assert got[0].item() == pytest.approx(want[0].item(), rel=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1.6e-2, atol=1e-6)  # bf16: one rounding step
    torch.testing.assert_close(got[2], want[2], rtol=1e-2, atol=1e-6)
    calls.clear()
    h32, w32 = hidden.float(), weight.float()
    got32 = loss._chunks(h32, w32, targets, rows=64, grads=True)
    assert set(calls) == {torch.float32}
    for a, b in zip(got32, _old_chunks(h32, w32, targets, rows=64), strict=True):
        assert torch.equal(a, b)


def test_native_bf16_products_follow_the_cpu_capability(monkeypatch):
    """AVX2 hosts, and AVX-512 hosts made to act as them (make test-avx2's environment), take the fp32
    products; an AVX-512 host with oneDNN uncapped keeps bf16's."""
    answers = {}
    for capability, isa in [("AVX512", None), ("AVX512", "AVX2"), ("AVX512", "AVX512_CORE_AMX"), ("AVX2", None),
                            ("DEFAULT", None)]:  # fmt: skip
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        if isa:
            monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
        else:
            monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
        loss.native_bf16_matmul.cache_clear()
        answers[(capability, isa)] = loss.native_bf16_matmul()
    loss.native_bf16_matmul.cache_clear()
    assert answers == {("AVX512", None): True, ("AVX512", "AVX2"): False, ("AVX512", "AVX512_CORE_AMX"): True,
                       ("AVX2", None): False, ("DEFAULT", None): False}  # fmt: skip


TINY_MODELS = {
    "gpt2": dict(n_layer=2, n_embd=64, n_head=4, n_positions=32),  # head tied to the embedding
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False),
    "gpt_neox": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     max_position_embeddings=32),  # its head is `embed_out`
}  # fmt: skip


def tiny(model_type):
    cfg = AutoConfig.for_model(
        model_type, vocab_size=300, bos_token_id=0, eos_token_id=0, **TINY_MODELS[model_type]
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("model_type", list(TINY_MODELS))
def test_attached_model_trains_as_the_standard_one(model_type):
    standard, chunked = tiny(model_type), loss.attach(tiny(model_type))
    assert chunked.chunked_loss_rows == 2**30 // (4 * 300)
    if model_type == "gpt2":
        assert chunked.lm_head.weight is chunked.transformer.wte.weight  # still tied
    x = torch.randint(0, 300, (2, 32))
    for m in (standard, chunked):
        m.eval()  # no dropout: the two forwards see the same numbers
        m(input_ids=x, labels=x).loss.backward()
    out = chunked(input_ids=x, labels=x)
    assert out.logits is None and out.loss.item() == pytest.approx(
        standard(input_ids=x, labels=x).loss.item()
    )
    for (name, p), q in zip(standard.named_parameters(), chunked.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
    # No labels: the original forward (logits for generation or evaluation by other tools).
    assert chunked(input_ids=x).logits.shape == (2, 32, 300)
    assert set(chunked.state_dict()) == set(standard.state_dict())


def test_unsupported_models_are_refused_with_the_key():
    cfg = AutoConfig.for_model(
        "gemma2", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, vocab_size=64,
    )  # fmt: skip
    with pytest.raises(UserError, match=r"model.chunked_loss: .*final_logit_softcapping .*set it to false"):
        loss.attach(AutoModelForCausalLM.from_config(cfg))  # Gemma 2's soft-capped logits
    cfg.final_logit_softcapping = None
    with pytest.raises(
        UserError, match=r"model.chunked_loss: not available for model_type 'gemma2'.*set it to false"
    ):
        loss.attach(AutoModelForCausalLM.from_config(cfg))
    moe = AutoConfig.for_model("qwen3_moe", hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                               vocab_size=64, num_experts=4, num_experts_per_tok=2, output_router_logits=True)  # fmt: skip
    with pytest.raises(UserError, match=r"output_router_logits .*adds the router's auxiliary loss"):
        loss.attach(AutoModelForCausalLM.from_config(moe))
    with pytest.raises(ConfigError) as e:
        config.load(TINY, ["model.chunked_loss=true", "model.config.model_type=gemma2"])
    assert "model.chunked_loss: not available for model_type 'gemma2'" in e.value.render()
    with pytest.raises(ConfigError) as e:
        config.load(TINY, ["model.chunked_loss=true", "model.config=null", "model.factory=pkg.mod:fn"])
    assert "model.chunked_loss: a factory's model computes its own loss" in e.value.render()


def test_a_frozen_head_gets_no_gradient_buffer_and_no_product(monkeypatch):
    """LoRA's LM head is frozen: the tiled loss keeps no fp32 (vocab x hidden) gradient for it (1.96 GiB at
    Llama-3-8B's 128,256 x 4,096) and runs no product for it, two products a chunk instead of three; the
    hidden states' gradient is the same as with a trained head. The plan drops the term with it."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 9, 16, requires_grad=True)
    weight = torch.randn(50, 16)
    labels = torch.randint(0, 50, (2, 9))
    calls = []
    real = loss._mm
    monkeypatch.setattr(loss, "_mm", lambda a, b: calls.append(1) or real(a, b))
    frozen = loss.linear_cross_entropy(hidden, weight, labels, rows=6)  # 18 rows: 3 chunks
    assert len(calls) == 3 * 2
    assert all(t is None or tuple(t.shape) != (50, 16) for t in frozen.grad_fn.saved_tensors)
    frozen.backward()
    frozen_grad, hidden.grad = hidden.grad.clone(), None
    loss.linear_cross_entropy(hidden, weight.clone().requires_grad_(), labels, rows=6).backward()
    assert torch.equal(frozen_grad, hidden.grad)

    from trainer.strategy.planning.activations import activations_for
    from trainer.strategy.planning.levers import Levers

    info = strategy.ModelInfo(params=8 * 10**9, largest_layer=1, hidden=4096, layers=32, heads=32, vocab=128256,
                              attn_implementation="sdpa", intermediate=14336, kv_heads=8)  # fmt: skip
    sets = ["data.seq_len=8192", "model.config.n_positions=8192", "model.lora={r: 8}"]
    frozen_exp = config.load(TINY, sets)
    trained_exp = config.load(TINY, sets + ["model.lora.train_modules=[lm_head]"])
    levers = Levers(chunked_loss=True, checkpointing=True)
    trained, planned = (activations_for(e, info, 2, levers) for e in (trained_exp, frozen_exp))
    assert trained - planned == 128256 * 4096 * 4


def test_planner_counts_one_chunk_instead_of_the_logits():
    """GPT-2 124M at micro 64 x 1024 in bf16: the whole logits are 3.3G values, 18 bytes each
    (59 GB, measured 17.2 on an H100); chunked, 3.2 GiB."""
    info = strategy.ModelInfo(params=124_475_904, largest_layer=50304 * 768, hidden=768, layers=12,
                              heads=12, vocab=50304, attn_implementation="sdpa")  # fmt: skip
    whole = strategy.activations(info, 64, 1024, 2, False)
    chunked = strategy.activations(info, 64, 1024, 2, False, chunked_loss=True)
    layers = strategy.activations(strategy.ModelInfo(**{**info.__dict__, "vocab": None}), 64, 1024, 2, False)
    assert whole - layers == 3 * 64 * 1024 * 50304 * 6
    rows = 2**30 // (4 * 50304)
    assert chunked - layers == 2 * rows * 50304 * 6 + 64 * 1024 * 768 * 2 + 50304 * 768 * 4
    assert chunked - layers < 3.3 * GiB < 55 * GiB < whole - layers


@pytest.mark.gpu
def test_on_a_gpu_in_bf16_the_chunked_loss_matches_and_holds_less():
    """GPT-2's head (768 x 50304) over 16K tokens in bf16 on CUDA, 3 chunks: loss and gradients as
    the whole logits give, compiled too, with a fraction of the memory."""
    torch.manual_seed(0)
    dev, dtype = "cuda", torch.bfloat16
    hidden = torch.randn(16, 1024, 768, device=dev, dtype=dtype, requires_grad=True)
    weight = (0.02 * torch.randn(50304, 768, device=dev, dtype=dtype)).requires_grad_()
    labels = torch.randint(0, 50304, (16, 1024), device=dev)

    def run(fn):
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        value = fn(hidden, weight, labels)
        value.backward()
        torch.cuda.synchronize()
        return (
            value.item(),
            hidden.grad.clone(),
            weight.grad.clone(),
            torch.cuda.max_memory_allocated() - base,
        )

    want, want_h, want_w, whole_mem = run(reference)
    for fn in (loss.linear_cross_entropy, torch.compile(loss.linear_cross_entropy)):
        got, got_h, got_w, mem = run(fn)
        assert got == pytest.approx(want, rel=1e-3)
        for got_g, want_g in ((got_h, want_h), (got_w, want_w)):  # relative error of the whole gradient
            assert ((got_g.float() - want_g.float()).norm() / want_g.float().norm()).item() < 1e-2
        assert mem < whole_mem / 2, f"chunked {mem / GiB:.2f} GiB, whole {whole_mem / GiB:.2f} GiB"
