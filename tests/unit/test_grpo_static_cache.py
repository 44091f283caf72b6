"""train.rl.generation_cache: static (issue 62, lease 2: on a GPU the decode step compiled and graphed).

On CPU nothing is compiled, and the property is that the cache changes nothing a run draws: the same
completions, token for token, as the dynamic cache, over the model families (GPT-2's learned positions,
Llama, Qwen3, Qwen3's MoE layers, Mistral's and Gemma 3's sliding windows narrower than the rows), with
completions that end at a stop token and ones that run to max_new_tokens, in one call and in calls of a group.
And it is refused where it cannot hold: at ZeRO-3 (the weights gathered for every forward), by the config
when zero_stage is 3 and by the planner's table when the stage is chosen.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import ROOT

EXP = ROOT / "configs" / "experiments" / "tiny-grpo.yaml"
BASE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256, "vocab_size": 257}  # fmt: skip
FAMILIES = {
    "gpt2": {
        "model_type": "gpt2",
        "n_layer": 2,
        "n_embd": 32,
        "n_head": 4,
        "n_positions": 256,
        "vocab_size": 257,
    },
    "llama": {"model_type": "llama", **BASE},
    "qwen3": {"model_type": "qwen3", "head_dim": 8, **BASE},
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "head_dim": 8,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        **BASE,
    },  # fmt: skip
    "mistral_window": {"model_type": "mistral", "head_dim": 8, "sliding_window": 6, **BASE},
    "gemma3_window": {"model_type": "gemma3_text", "head_dim": 8, "sliding_window": 6, **BASE},
}


def sampler(model, cache: str, batch: int, stop: tuple[int, ...], new: int = 12):  # noqa: ANN001, ANN201
    from trainer.rl.generate import ModelSampler, Sampling

    engine = SimpleNamespace(ds=SimpleNamespace(module=model), device=torch.device("cpu"))
    return ModelSampler(engine, Sampling(max_new_tokens=new, stop=stop, pad=256, width=9), synced=False,
                        batch=batch, cache=cache)  # fmt: skip


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_static_cache_draws_the_dynamic_caches_completions(family):
    import transformers.cache_utils as cache_utils
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(FAMILIES[family])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg)).eval()
    prompts = [[65 + (i * 7 + j) % 50 for j in range(3 + i % 5)] for i in range(8)]  # widths 3-7, padded to 9
    streams = list(range(100, 108))
    free = sampler(model, "dynamic", 8, ()).sample(prompts, streams)
    # stop at a token the free run drew mid-way in some rows: some completions end early, others run on
    stop = (free[0][0][4], free[3][0][7])
    dynamic = sampler(model, "dynamic", 8, stop).sample(prompts, streams)
    assert any(ended for _, ended in dynamic) and not all(ended for _, ended in dynamic), dynamic
    made = []
    real = cache_utils.StaticCache.__init__

    def spy(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        made.append(type(self).__name__)
        return real(self, *a, **k)

    cache_utils.StaticCache.__init__ = spy
    try:
        for batch in (8, 2):  # one call, and calls of a group of 2
            static = sampler(model, "static", batch, stop).sample(prompts, streams)
            assert static == dynamic, (batch, static, dynamic)
    finally:
        cache_utils.StaticCache.__init__ = real
    assert made == ["StaticCache"] * 5  # a cache a call: the static path was taken
    assert sampler(model, "static", 8, ()).sample(prompts, streams) == free


def test_the_planner_refuses_zero3_with_a_static_cache():
    from trainer import config
    from trainer.run.plan import make_plan

    def plan(sets):  # noqa: ANN001, ANN202
        exp = config.load(str(EXP), sets)
        return make_plan(exp, world_size=2, gpus_per_node=2, device_type="cpu", device_memory=None,
                         vocab_size=257, eos_id=None, force=False)  # fmt: skip

    for cache, refused in (("dynamic", False), ("static", True)):
        p = plan([f"train.rl.generation_cache={cache}"])
        table = {e.candidate.name: e for e in p.plan.estimates}
        assert ("generation_cache static" in table["zero3"].refused) is refused, table["zero3"].refused
        assert not table["zero2"].refused and p.plan.candidate.stage == 0


def test_a_run_with_the_static_cache_is_the_dynamic_caches_step_for_step(tmp_path):
    """bin/train on tiny-grpo, 6 steps, fp32 on CPU: the same completions, rewards, losses and gradient norms."""
    import json

    from helpers import bin_train, data_cache

    rows = {}
    for cache in ("dynamic", "static"):
        run = tmp_path / cache
        p = bin_train(EXP, "--set", "train.max_steps=6", "--set", "train.log_every=1", "--set", "checkpoint.every_steps=0",
                      "--set", "checkpoint.save_final=false", "--set", f"run_dir={run}", "--set", f"data.cache_dir={data_cache()}",
                      "--set", f"train.rl.generation_cache={cache}", "--set", "train.rl.max_new_tokens=8")  # fmt: skip
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        assert f"{cache} cache; from the trained weights" in p.stdout + p.stderr
        got = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        keys = ("step", "loss", "grad_norm", "reward", "completion_length")
        rows[cache] = [{k: r.get(k) for k in keys} for r in got if "reward" in r]
    assert len(rows["static"]) == 6 and rows["static"] == rows["dynamic"], rows
    assert any(r["grad_norm"] for r in rows["static"])  # something was learned from what was drawn


LLAMA_8B = ('{"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, '
            '"num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 512}')  # fmt: skip


def test_the_planner_neither_advises_nor_blames_around_the_refused_rung():
    """The review's: where the static cache rules out ZeRO-3 (an 8B shape on 8 x 26 GB), the decision carried
    "set model.chunked_loss: true (-10.51 MB less per rank) and zero3 fits", and with offload none the error
    named memory alone, not the cache that refuses the rung that fits."""
    from trainer import config
    from trainer.common.errors import UserError
    from trainer.run.plan import make_plan

    def plan(*sets):  # noqa: ANN002, ANN202
        exp = config.load(str(EXP), [f"model.config={LLAMA_8B}", "train.rl.generation_cache=static",
                                     "strategy.device_memory=26GB", "strategy.host_memory=1TB", *sets])  # fmt: skip
        return make_plan(exp, world_size=8, gpus_per_node=8, device_type="cuda", device_memory=None,
                         vocab_size=257, eos_id=None, force=False)  # fmt: skip

    p = plan()
    assert p.plan.candidate.name == "zero2+cpu" and "chunked_loss" not in p.plan.reason, p.plan.reason
    with pytest.raises(UserError) as e:
        plan("strategy.offload=none")
    assert "zero3 would fit, but is refused: train.rl.generation_cache static" in str(e.value), str(e.value)[
        :600
    ]
