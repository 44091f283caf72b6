"""Building the model (trainer/model/create.py)."""

import pytest

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
