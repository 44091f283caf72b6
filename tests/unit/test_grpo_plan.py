"""The plan counts GRPO (issue 56 item 5; trainer/strategy/planning/generation.py): generation's key/value
cache against the cache transformers' generate actually holds (GPT-2 and a grouped-query Llama, within 10%), and the whole of
generation's term against the peak of malloc's live bytes while the sampler runs (prefill- and decode-bound),
the rows a micro step trains (its completions, a prompt and its completion within data.seq_len each: not a
preference objective's pairs), generation's bytes in the peak (the largest of activations, the optimizer step and generation, not
their sum), no reference model at beta 0 nor with LoRA's adapters off, and --plan's generation column and
line."""

import pytest
import torch

from trainer import config, model, strategy
from trainer.strategy.planning.activations import rows_per_micro
from trainer.strategy.planning.generation import generation_bytes, kv_cache_bytes, row_length

GiB = 2**30
EXP = "configs/experiments/tiny-grpo.yaml"


def measured_cache(cfg, groups, prompt, new):
    """Bytes of the key/value cache generate holds after sampling `new` tokens for `groups` rows."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(3, cfg.vocab_size, (groups, prompt))
    out = m.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=new,
                     min_new_tokens=new, return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
    cache = out.past_key_values
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


@pytest.mark.parametrize(
    "family",
    [
        dict(model_type="gpt2", n_layer=2, n_embd=64, n_head=4, n_positions=128, vocab_size=257),
        dict(model_type="llama", num_hidden_layers=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
             intermediate_size=128, vocab_size=300, max_position_embeddings=128),
    ],
    ids=["gpt2", "llama-gqa"],
)  # fmt: skip
def test_the_kv_cache_term_is_what_generate_holds(family):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(**family)
    info = model.info(config.ModelSection(config=family), cfg.vocab_size, 128)
    prompt, new, g = 20, 12, 8
    got = measured_cache(cfg, g, prompt, new)
    # the cache holds every token but the last sampled one (its keys are never needed)
    planned = kv_cache_bytes(info, g, prompt + new, 4)
    assert abs(planned - got) <= 0.1 * got, (planned, got)


GPT2 = dict(model_type="gpt2", n_layer=4, n_embd=256, n_head=4, n_positions=256)
LLAMA = dict(model_type="llama", num_hidden_layers=4, hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
             intermediate_size=704, max_position_embeddings=256)  # fmt: skip


# the shapes of issue 68: Qwen3's own head size (twice hidden / heads), Gemma 3's sliding layers (a window shorter
# than the prompt), Qwen3-MoE's experts
QWEN3 = dict(model_type="qwen3", num_hidden_layers=4, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
             head_dim=128, intermediate_size=768, max_position_embeddings=256)  # fmt: skip
GEMMA3 = dict(model_type="gemma3_text", num_hidden_layers=6, hidden_size=288, num_attention_heads=4,
              num_key_value_heads=1, head_dim=64, intermediate_size=1152, sliding_window=32, max_position_embeddings=256)  # fmt: skip
QWEN3_MOE = dict(model_type="qwen3_moe", num_hidden_layers=4, hidden_size=256, num_attention_heads=8, num_key_value_heads=1,
                 head_dim=64, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128,
                 max_position_embeddings=256)  # fmt: skip
FAMILIES = {"gpt2": GPT2, "llama": LLAMA, "qwen3": QWEN3, "gemma3": GEMMA3, "qwen3-moe": QWEN3_MOE}


def sampled_peak(peak, run, planned: int) -> int:
    """The peak of malloc's live bytes while `run(try)` runs, above what was live before. The sampling thread
    can miss a short peak when it is not scheduled (CI: three test workers on two cores), never see more than
    there was: where the peak seen is more than 10% under `planned`, it is run again, the highest of three kept."""
    best = 0
    for i in range(3):
        start = peak.reset()
        run(i)
        best = max(best, peak.since(start))
        if planned / best - 1 <= 0.10:
            break
    return best


@pytest.mark.parametrize(
    "family,new",
    [(FAMILIES[f], new) for f in FAMILIES for new in (56, 200)],
    ids=[f"{f}-{phase}" for f in FAMILIES for phase in ("prefill", "decode")],
)
def test_generation_s_term_is_the_measured_peak_of_sampling(family, new):
    """16 completions of a 256-token row (a prompt of 256 - new tokens), fp32 on CPU: the peak of malloc's
    live bytes while ModelSampler samples, above what was live before, against generation_bytes."""
    import json
    from types import SimpleNamespace

    from transformers import AutoConfig, AutoModelForCausalLM

    from bench.step_memory import Peak
    from trainer.rl.generate import ModelSampler, Sampling

    g, seq = 16, 256
    exp = config.load(EXP, ["model.config=" + json.dumps(family), f"train.rl.num_generations={g}",
                            f"train.micro_batch_size={g}", f"data.seq_len={seq}", f"train.rl.max_new_tokens={new}"])  # fmt: skip
    info = model.info(exp.model, 257, seq)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(AutoConfig.for_model(**family, vocab_size=257)).eval()
    engine = SimpleNamespace(ds=SimpleNamespace(module=m), device=torch.device("cpu"))
    sampler = ModelSampler(engine, Sampling(max_new_tokens=new, stop=(), pad=256), synced=False, batch=g)
    prompt = [[65 + i % 20 for i in range(seq - new)]] * g
    sampler.sample(prompt, list(range(g)))  # the allocator's arenas warmed
    planned = generation_bytes(exp, info, 4)
    outs = []
    measured = sampled_peak(
        Peak(), lambda i: outs.append(sampler.sample(prompt, list(range((i + 1) * g, (i + 2) * g)))), planned
    )
    assert all(
        len(c) == new for out in outs for c, _ in out
    )  # no stop token: every completion its full length
    print(
        f"{family['model_type']} new {new}: measured {measured / 2**20:.1f} MiB, planned {planned / 2**20:.1f} MiB"
    )
    assert abs(planned / measured - 1) <= 0.10, (measured, planned)


@pytest.mark.parametrize("sets", [(1.0, 0, 1.0, None), (0.7, 0, 1.0, None), (1.0, 50, 1.0, None), (1.0, 0, 0.9, None),
                                  (1.0, 0, 1.0, 0.05)], ids=["plain", "temperature", "top_k", "top_p", "min_p"])  # fmt: skip
def test_the_sampling_logits_term_is_the_measured_peak_at_a_large_vocabulary(sets):
    """32 rows of a 65,536-token vocabulary, one tiny layer (the logits are the peak): the Gumbel noise, the
    processed scores, top-p's sort, against logits_bytes (within 10%); and with the noise made 8 rows at a time."""
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.step_memory import Peak
    from trainer.rl.generate import ModelSampler, Sampling
    from trainer.strategy.planning.generation import logits_bytes

    (t, k, p, mp), vocab, rows = sets, 65536, 32
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=1, vocab_size=vocab, max_position_embeddings=64)).eval()  # fmt: skip
    engine = SimpleNamespace(ds=SimpleNamespace(module=m), device=torch.device("cpu"))
    sampler = ModelSampler(engine, Sampling(max_new_tokens=8, temperature=t, top_k=k, top_p=p, min_p=mp),
                           synced=False, batch=rows)  # fmt: skip
    prompts = [[5, 6, 7, 8]] * rows
    sampler.sample(prompts, list(range(rows)))  # the allocator's arenas warmed
    peak = Peak()
    planned = logits_bytes(SimpleNamespace(temperature=t, top_k=k, top_p=p, min_p=mp), rows, vocab)
    measured = sampled_peak(
        peak, lambda i: sampler.sample(prompts, list(range((i + 1) * rows, (i + 2) * rows))), planned
    )
    print(
        f"temperature {t} top_k {k} top_p {p} min_p {mp}: measured {measured / 2**20:.1f} MiB, planned {planned / 2**20:.1f}"
    )
    assert abs(planned / measured - 1) <= 0.10, (measured, planned)
    import trainer.rl.generate as generate

    was, generate.NOISE_ELEMENTS = generate.NOISE_ELEMENTS, 8 * vocab  # the noise in chunks of 8 rows
    try:
        planned = logits_bytes(SimpleNamespace(temperature=t, top_k=k, top_p=p, min_p=mp), rows, vocab)
        measured = sampled_peak(
            peak, lambda i: sampler.sample(prompts, list(range((i + 4) * rows, (i + 5) * rows))), planned
        )
    finally:
        generate.NOISE_ELEMENTS = was
    print(f"  the noise 8 rows at a time: measured {measured / 2**20:.1f} MiB, planned {planned / 2**20:.1f}")
    assert abs(planned / measured - 1) <= 0.10, (measured, planned)


def test_a_generate_call_samples_the_rank_s_groups_or_generation_batch_of_them():
    from trainer.strategy.planning.generation import generation_rows

    exp = config.load(EXP, ["train.rl.num_generations=4", "train.micro_batch_size=8", "train.grad_accum=2"])
    assert generation_rows(exp) == 16  # all of a rank's 4 prompts, 4 completions each
    few = config.load(EXP, ["train.rl.num_generations=4", "train.micro_batch_size=8", "train.grad_accum=2",
                            "train.rl.generation_batch=1"])  # fmt: skip
    assert generation_rows(few) == 4
    info = model.info(exp.model, 257, 256)
    assert generation_bytes(exp, info, 4) > generation_bytes(few, info, 4)


def plan(*sets, device=8):
    exp = config.load(EXP, list(sets))
    info = model.info(exp.model, 257, 256)
    p = strategy.plan(exp, info, world_size=1, gpus_per_node=1, device_type="cuda", device_memory=device * GiB,
                      host_memory=64 * GiB, precision="bf16")  # fmt: skip
    return exp, info, p


def test_a_micro_step_trains_its_completions_within_seq_len():
    exp, info, p = plan("train.rl.max_new_tokens=32")
    assert rows_per_micro(exp) == exp.train.micro_batch_size  # not 2 x (pairs)
    assert row_length(exp) == exp.data.seq_len
    longer = plan("train.rl.max_new_tokens=32", "data.seq_len=128")[2]
    assert longer.estimate.activations > p.estimate.activations
    assert longer.estimate.generation > p.estimate.generation > 0
    # a generate call samples all of a rank's completions of the step, or generation_batch prompts' groups
    more = plan("train.rl.max_new_tokens=32", f"train.grad_accum={2 * exp.train.grad_accum}")[2]
    assert more.estimate.generation > p.estimate.generation
    fewer = plan("train.rl.max_new_tokens=32", "train.rl.generation_batch=1")[2]
    assert 0 < fewer.estimate.generation < p.estimate.generation


def test_generation_is_in_the_peak_as_the_largest_term_not_a_sum():
    exp, info, p = plan(
        "train.rl.num_generations=64",
        "train.micro_batch_size=4",
        "train.grad_accum=16",
        "train.rl.max_new_tokens=60",
    )
    e = p.estimate
    assert e.generation == generation_bytes(exp, info, 2) > e.activations  # generation is this job's peak
    assert e.total == e.model_states + max(e.activations, e.step, e.generation) + e.buffers
    sft = config.load("configs/experiments/tiny.yaml", [])
    assert generation_bytes(sft, info, 2) == 0


@pytest.mark.parametrize(
    "sets", [[], ["train.rl.beta=0.04", "model.lora.r=8"]], ids=["beta0", "lora-reference"]
)
def test_no_reference_model_is_planned(sets):
    """beta 0 builds no reference; with LoRA the reference is the model with its adapters off: the plan's
    weights are the policy's alone, as an SFT plan of the same model."""
    exp, info, p = plan(*sets)
    sft_exp = config.load("configs/experiments/tiny.yaml", [f"model.config.{k}={v}" for k, v in
                                                             exp.model.config.items()] + [s for s in sets if "lora" in s])  # fmt: skip
    sft_info = model.info(sft_exp.model, 257, 256)
    assert info.params == sft_info.params
    assert p.estimate.params == strategy.plan(sft_exp, sft_info, world_size=1, gpus_per_node=1, device_type="cuda",
                                              device_memory=8 * GiB, host_memory=64 * GiB, precision="bf16").estimate.params  # fmt: skip


def test_plan_shows_the_generation_column_and_line(capsys):
    from trainer.run.cli import main

    assert main([EXP, "--plan"]) == 0
    out = capsys.readouterr().out
    assert "generation" in next(x for x in out.splitlines() if x.startswith("candidate")) and "seq 64" in out
    assert "generation:" in out and "no reference model (beta 0)" in out
    assert main(["configs/experiments/tiny.yaml", "--plan"]) == 0
    assert "generation" not in capsys.readouterr().out
