"""Building the model (trainer/model/create.py)."""

import pytest
from helpers import TINY

from trainer import config, model


@pytest.mark.parametrize("source", ["config", "pretrained"])
def test_the_built_model_is_in_training_mode(tmp_path, source):
    """from_pretrained returns a model in eval mode: without model.train() in build, a fine-tuning run
    trained without dropout until its first eval switched it on (found as a 50% slowdown of tiny-sft
    after its first eval, with other losses than a run without that eval)."""
    from transformers import AutoModelForCausalLM, GPT2Config

    cfg = {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 64, "vocab_size": 64}
    if source == "pretrained":
        AutoModelForCausalLM.from_config(
            GPT2Config(**{k: v for k, v in cfg.items() if k != "model_type"})
        ).save_pretrained(tmp_path)
        section = config.ModelSection.model_validate({"pretrained": str(tmp_path)})
    else:
        section = config.ModelSection.model_validate({"config": cfg})
    m = model.build(section, vocab_size=None, eos_id=None, seq_len=32)
    assert all(mod.training for mod in m.modules())


def test_liger_kernels_are_refused_without_cuda_and_for_factories(tmp_path):
    """model.kernels: liger runs Triton kernels: a machine without CUDA is told so (exit 2 through
    UserError), and a factory's model is refused at config time."""
    import torch

    from trainer import config
    from trainer.common.errors import ConfigError, UserError
    from trainer.model import kernels

    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="model.kernels: liger .* CUDA"):
            kernels.apply(torch.nn.Linear(2, 2), fused_loss=True, zero3=False)
    with pytest.raises(ConfigError, match="model.kernels"):
        config.load(TINY, ["model.config=null", "model.chunked_loss=false", "model.factory=pkg.mod:fn",
                           "model.kernels=liger"])  # fmt: skip


def test_auto_attention_is_eager_on_cpu_in_bf16_at_short_sequences_only(tmp_path):
    """model.attn_implementation: auto (the default) decides per run: eager where it was measured
    faster (CPU, bf16, data.seq_len <= 256), else the model's default; a named kernel and null are
    kept. make_plan's model section and its count follow (the planner then counts eager's attention
    scores), and the model built from it runs eager."""
    from trainer.run.plan import make_plan

    cfg = {
        "model_type": "gpt2",
        "n_layer": 1,
        "n_embd": 32,
        "n_head": 2,
        "n_positions": 512,
        "vocab_size": 64,
    }
    section = config.ModelSection.model_validate({"config": cfg})
    assert section.attn_implementation == "auto"

    def decide(sec, seq_len=128, precision="bf16", device_type="cpu"):
        return model.attention(sec, seq_len=seq_len, precision=precision, device_type=device_type)

    assert decide(section) == "eager"
    assert decide(section, seq_len=256) == "eager"
    assert decide(section, seq_len=257) is None
    assert decide(section, precision="fp32") is None
    assert decide(section, device_type="cuda") is None
    for named in ("sdpa", "eager", None):
        assert decide(section.model_copy(update={"attn_implementation": named}), device_type="cuda") == named
        assert decide(section.model_copy(update={"attn_implementation": named})) == named

    def planned(precision):
        exp = config.load(str(TINY), [f"train.precision={precision}", f"data.cache_dir={tmp_path}"])
        return make_plan(exp, world_size=1, gpus_per_node=1, device_type="cpu", device_memory=None,
                         vocab_size=257, eos_id=0, force=False)  # fmt: skip

    bf16, fp32 = planned("bf16"), planned("fp32")
    assert (bf16.model.attn_implementation, bf16.info.attn_implementation) == ("eager", "eager")
    assert (fp32.model.attn_implementation, fp32.info.attn_implementation) == (None, "sdpa")
    built = model.build(bf16.model, vocab_size=257, eos_id=0, seq_len=128, ds_config=bf16.ds_config)
    assert built.config._attn_implementation == "eager"


def test_eager_and_sdpa_attention_train_alike_in_bf16():
    """What auto switches on CPU in bf16 changes kernels, not the model: one forward and backward of
    the same weights and batch give the same loss and gradients to bf16's precision."""
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    batch = torch.randint(0, 64, (2, 96), generator=torch.Generator().manual_seed(0))
    for cfg in (
        GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=64, n_positions=128, attn_pdrop=0.0,
                   resid_pdrop=0.0, embd_pdrop=0.0),
        LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=64, max_position_embeddings=128),
    ):  # fmt: skip
        out = {}
        for attn in ("sdpa", "eager"):
            torch.manual_seed(0)
            m = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).to(torch.bfloat16).train()
            loss = m(input_ids=batch, labels=batch).loss
            loss.backward()
            out[attn] = loss.float().item(), torch.cat([p.grad.float().flatten() for p in m.parameters()])
        (ls, gs), (le, ge) = out["sdpa"], out["eager"]
        assert le == pytest.approx(ls, rel=1e-2)
        assert torch.nn.functional.cosine_similarity(gs, ge, dim=0) > 0.99
