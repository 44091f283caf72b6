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
    from trainer.errors import ConfigError, UserError
    from trainer.model import kernels

    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="model.kernels: liger .* CUDA"):
            kernels.apply(torch.nn.Linear(2, 2), fused_loss=True, zero3=False)
    with pytest.raises(ConfigError, match="model.kernels"):
        config.load(TINY, ["model.config=null", "model.chunked_loss=false", "model.factory=pkg.mod:fn",
                           "model.kernels=liger"])  # fmt: skip
