"""The plan's model shapes against measurements (issue 68; trainer/strategy/planning/layers.py): for every family
of the family matrix, with its own head size, windows, norms and experts, what a layer keeps for backward
against a census of what autograd saves (the project's own probe, TRAINER_DEBUG_ACTIVATIONS' SavedActivations:
saved-tensor hooks, each storage once, weights left out), in bf16 and fp32, with sdpa and eager attention, rows
whole and packed, with LoRA's frozen norms; the key/value cache against transformers' own cache object; the
FLOPs a token against torch's FlopCounterMode.

The shapes are the published configs' proportions, narrowed to run in a second on a CPU: Qwen3-0.6B's (hidden
1024, 16 heads of 128: twice the hidden size in queries) and Qwen3-4B's (2560, 32 of 128), Gemma-3-1B's (1152, 4
heads of 256, one key/value head, 5 sliding layers of 6), Mixtral's and Qwen3-30B-A3B's experts, gpt-oss's
sinks and alternating windows, DeepSeek-V3's latent attention and dense first layer. Before this census the
plan counted every layer as Llama's with head_dim = hidden / heads and an MoE layer as GPT-2's 34h: saved
activations at 0.67 (Qwen3-0.6B shape), 0.79 (Qwen3-4B), 0.71 (Gemma 3), 0.35-0.54 (the MoE families) of the
measured, in bf16."""

import json

import pytest
import torch
from helpers import TINY, yaml_value
from transformers import AutoConfig, AutoModelForCausalLM

from trainer import config, model
from trainer.run.consistency import SavedActivations
from trainer.strategy import activations, flops_per_token
from trainer.strategy.planning.activations import layer_bytes_per_token
from trainer.strategy.planning.generation import kv_cache_bytes
from trainer.strategy.planning.layers import rotary, saved

BASE = {"vocab_size": 512, "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
        "num_hidden_layers": 2, "tie_word_embeddings": False}  # fmt: skip
SHAPES = {
    "llama": {"model_type": "llama", "hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 8,
              "num_key_value_heads": 2},
    "mistral": {"model_type": "mistral", "hidden_size": 256, "intermediate_size": 896, "num_attention_heads": 8,
                "num_key_value_heads": 2, "sliding_window": 64},
    "qwen2": {"model_type": "qwen2", "hidden_size": 224, "intermediate_size": 1216, "num_attention_heads": 7,
              "num_key_value_heads": 1},
    "qwen3": {"model_type": "qwen3", "hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 128},
    "qwen3-4b": {"model_type": "qwen3", "hidden_size": 320, "intermediate_size": 1216, "num_attention_heads": 4,
                 "num_key_value_heads": 1, "head_dim": 128},
    "gemma3_text": {"model_type": "gemma3_text", "hidden_size": 288, "intermediate_size": 1728,
                    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "sliding_window": 64,
                    "num_hidden_layers": 6, "query_pre_attn_scalar": 64},
    "phi3": {"model_type": "phi3", "hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 8,
             "num_key_value_heads": 8, "sliding_window": 64},
    "gpt2": {"model_type": "gpt2", "activation_function": "gelu_new", "n_embd": 256, "n_head": 4, "n_layer": 2,
             "n_positions": 512, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "olmo2": {"model_type": "olmo2", "hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 8,
              "num_key_value_heads": 8},
    "qwen3_moe": {"model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 8,
                  "num_key_value_heads": 1, "head_dim": 64, "num_experts": 16, "num_experts_per_tok": 8,
                  "moe_intermediate_size": 96},
    "mixtral": {"model_type": "mixtral", "hidden_size": 256, "intermediate_size": 896, "num_attention_heads": 8,
                "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 2},
    "gpt_oss": {"model_type": "gpt_oss", "hidden_size": 360, "intermediate_size": 360, "num_attention_heads": 8,
                "num_key_value_heads": 1, "head_dim": 64, "num_local_experts": 16, "num_experts_per_tok": 2,
                "sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]},
    "deepseek_v3": {"model_type": "deepseek_v3", "hidden_size": 448, "intermediate_size": 1152,
                    "num_attention_heads": 8, "num_key_value_heads": 8, "n_routed_experts": 16,
                    "num_experts_per_tok": 8, "moe_intermediate_size": 128, "n_shared_experts": 1,
                    "first_k_dense_replace": 1, "q_lora_rank": 96, "kv_lora_rank": 32, "qk_rope_head_dim": 16,
                    "qk_nope_head_dim": 32, "v_head_dim": 32, "n_group": 1, "topk_group": 1},
}  # fmt: skip
ONLY_EAGER = {"gpt_oss"}  # transformers has no sdpa path for its attention sinks
DTYPES = {"bf16": (torch.bfloat16, 2), "fp32": (torch.float32, 4)}


def shape(name: str) -> dict:
    fields = {**BASE, **SHAPES[name]}
    if name == "gpt2":  # GPT-2's own names
        del fields["num_hidden_layers"], fields["max_position_embeddings"]
    return fields


def info_and_model(name, attn, dtype, **extra):
    fields = {**shape(name), **extra}
    exp = config.load(TINY, [f"model.config={yaml_value(fields)}", f"model.attn_implementation={attn}"])
    info = model.info(exp.model, fields["vocab_size"], None)
    fields.pop("model_type")
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(AutoConfig.for_model(SHAPES[name]["model_type"], **fields),
                                         attn_implementation=attn, dtype=dtype)  # fmt: skip
    return info, m.train()


def census(tmp_path, m, ids, **inputs) -> dict:
    """What the project's probe counts in a training forward: bytes saved inside the decoder layers and outside."""
    probe = SavedActivations(str(tmp_path), 0, m)
    with probe():
        m(input_ids=ids, labels=ids, use_cache=False, **inputs)  # as the engine calls it
    return json.loads((tmp_path / "activations_rank0.json").read_text())


CASES = [
    (n, p, a)
    for n in SHAPES
    for p in DTYPES
    for a in ("sdpa", "eager")
    if a == "eager" or n not in ONLY_EAGER
]


@pytest.mark.parametrize("name,precision,attn", CASES, ids=["-".join(c) for c in CASES])
def test_what_each_familys_layers_keep_is_planned(tmp_path, name, precision, attn):
    """The layers' bytes (the rotary tables counted once) within 3% of the census, either way (measured
    0.986-1.004); and the whole forward's, the loss's term counted at its peak (logits, their fp32 copy and
    gradients), at least the census's."""
    dtype, lp = DTYPES[precision]
    seq = 256
    info, m = info_and_model(name, attn, dtype)
    got = census(tmp_path, m, torch.randint(3, 512, (1, seq), generator=torch.Generator().manual_seed(0)))
    kept = saved(info, lp, seq, device="cpu")
    planned = seq * (sum(kept.layers) + rotary(info, lp))
    print(f"{name} {precision} {attn}: layers {got['layers'] / 2**20:.2f} MiB, planned {planned / 2**20:.2f} "
          f"({planned / got['layers']:.3f})")  # fmt: skip
    assert planned == pytest.approx(got["layers"], rel=0.03)
    whole = activations(info, 1, seq, lp, False, device="cpu")
    assert got["layers"] + got["other"] <= whole <= 1.5 * (got["layers"] + got["other"])


PACKED = ["llama", "mistral", "qwen3", "gemma3_text", "qwen3_moe", "gpt2"]


@pytest.mark.parametrize("name", PACKED)
def test_packed_rows_give_sdpa_a_mask_on_every_layer_and_it_is_planned(tmp_path, name):
    """Two rows of two packed examples each (position ids restarting): transformers builds a mask for every
    layer, sdpa copies it to the compute precision in each call and keeps the copy, and repeats grouped key/value
    heads for every query head; the plan with masks (packed or padded rows) against the census, within 3%."""
    seq = 256
    info, m = info_and_model(name, "sdpa", torch.bfloat16)
    positions = torch.cat([torch.arange(100), torch.arange(seq - 100)]).repeat(2, 1)
    ids = torch.randint(3, 512, (2, seq), generator=torch.Generator().manual_seed(0))
    got = census(tmp_path, m, ids, position_ids=positions)
    kept = saved(info, 2, seq, packed=True, device="cpu")
    planned = 2 * seq * (sum(kept.layers) + rotary(info, 2))
    unmasked = 2 * seq * (sum(saved(info, 2, seq, device="cpu").layers) + rotary(info, 2))
    print(f"{name} packed: layers {got['layers'] / 2**20:.2f} MiB, planned {planned / 2**20:.2f}, "
          f"{unmasked / 2**20:.2f} without the masks")  # fmt: skip
    assert planned == pytest.approx(got["layers"], rel=0.03)


ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
LORA = [("llama", ALL), ("llama", ATTENTION), ("qwen3", ALL), ("gemma3_text", ALL), ("gemma3_text", ATTENTION),
        ("olmo2", ALL), ("qwen3_moe", ATTENTION), ("mixtral", ATTENTION), ("gpt2", ["c_attn"])]  # fmt: skip


@pytest.mark.parametrize("name,targets", LORA, ids=[f"{n}-{len(t)}" for n, t in LORA])
def test_loras_frozen_weights_keep_no_input_and_its_frozen_norms_no_normalised_value(tmp_path, name, targets):
    """LoRA r 8 on the named projections, no dropout, bf16: a frozen projection keeps no input for its weight's
    gradient unless an adapter reads it (the MLP's with adapters on the attention alone; a mixture's experts and
    router, whose weights stay frozen), the frozen norms (their weights, and the query/key norms') keep no
    normalised value, the adapters their A-products; the embeddings frozen, the first norm keeps no copy of its
    input. The plan's layer count against the census, within 3% (review of issue 68: with adapters on the
    attention alone Qwen3-MoE and Mixtral were planned at 1.39x and 1.33x the census, Llama at 1.27x)."""
    from trainer.config import ModelSection
    from trainer.model import adapters
    from trainer.strategy.planning.activations import frozen_input_bytes

    seq = 256
    info, m = info_and_model(name, "sdpa", torch.bfloat16)
    lora = ModelSection.model_validate({"config": {"model_type": "llama"}, "lora": {
        "r": 8, "dropout": 0.0, "target_modules": targets, "kernels": "peft"}}).lora  # fmt: skip
    m = adapters.apply(m, lora).to(
        torch.bfloat16
    )  # the adapters in bf16 too, as DeepSpeed's bf16 engine holds them
    got = census(tmp_path, m, torch.randint(3, 512, (1, seq), generator=torch.Generator().manual_seed(0)))
    per_layer = layer_bytes_per_token(info, 2, seq_len=seq, lora=lora, device="cpu")
    planned = seq * (per_layer * info.layers - frozen_input_bytes(info, lora, 2))
    print(
        f"{name} LoRA on {', '.join(targets)}: layers {got['layers'] / 2**20:.2f} MiB, planned {planned / 2**20:.2f}"
    )
    assert planned == pytest.approx(got["layers"], rel=0.03)


@pytest.mark.parametrize("name", ["mistral", "gemma3_text"])
def test_a_window_as_long_as_the_sequence_still_gets_a_mask(tmp_path, name):
    """transformers builds a sliding layer's mask unless the sequence is shorter than the window (masking_utils
    skips it only then): at a window of exactly the sequence, sdpa still copies it and repeats grouped key/value
    heads. Review of issue 68: planned at 0.908 of the census for Mistral (window = seq counted as unmasked)."""
    seq = 256
    info, m = info_and_model(name, "sdpa", torch.bfloat16, sliding_window=seq)
    got = census(tmp_path, m, torch.randint(3, 512, (1, seq), generator=torch.Generator().manual_seed(0)))
    planned = seq * (sum(saved(info, 2, seq, device="cpu").layers) + rotary(info, 2))
    print(
        f"{name} window {seq} at {seq} tokens: layers {got['layers'] / 2**20:.2f} MiB, planned {planned / 2**20:.2f}"
    )
    assert planned == pytest.approx(got["layers"], rel=0.03)


def test_a_multimodal_configs_text_layers_are_counted_from_its_text_config(tmp_path):
    """Gemma 3 as published for its 4B-27B models (model_type gemma3: a text config and a vision tower): the gated
    MLP's width is the text config's, the layers counted as Gemma 3's, a text token's FLOPs without the vision
    tower (it runs no image here). Review of issue 68: its MLP was counted as GPT-2's 4h (0.68 of the census)
    and MFU counted the vision tower's parameters."""
    from torch.utils.flop_counter import FlopCounterMode

    text = {k: v for k, v in shape("gemma3_text").items() if k != "model_type"}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 28, "patch_size": 14}  # fmt: skip
    fields = {"model_type": "gemma3", "text_config": text, "vision_config": vision, "mm_tokens_per_image": 4}
    exp = config.load(TINY, [f"model.config={yaml_value(fields)}", "model.attn_implementation=eager"])
    info = model.info(exp.model, 512, None)
    assert info.intermediate == text["intermediate_size"] and info.model_type == "gemma3_text"
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("gemma3", text_config=text, vision_config=vision, mm_tokens_per_image=4)
    m = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").train()
    seq = 256
    ids = torch.randint(3, 512, (1, seq), generator=torch.Generator().manual_seed(0))
    got = census(tmp_path, m, ids)
    planned = seq * (sum(saved(info, 4, seq, device="cpu").layers) + rotary(info, 4))
    assert planned == pytest.approx(got["layers"], rel=0.03), (planned, got["layers"])
    m.zero_grad()
    with FlopCounterMode(display=False) as counted:
        m(input_ids=ids, labels=ids).loss.backward()
    measured = counted.get_total_flops() / seq
    print(f"gemma3 multimodal: layers {got['layers'] / 2**20:.2f} MiB of {planned / 2**20:.2f} planned; "
          f"{measured / 1e6:.2f} MFLOP a token of {flops_per_token(info, seq) / 1e6:.2f}")  # fmt: skip
    assert 0.99 <= measured / flops_per_token(info, seq) <= 1.0


def storage_bytes(cache) -> int:
    """Bytes of the storages a cache's layers hold (a view holds its whole storage: a sliding layer's trimmed
    keys right after a prompt are a view of the prompt's)."""
    seen = {}
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


CACHE = ["llama", "mistral", "qwen3", "qwen3-4b", "gemma3_text", "phi3", "gpt2", "olmo2", "qwen3_moe", "mixtral",
         "gpt_oss", "deepseek_v3"]  # fmt: skip


@pytest.mark.parametrize("name", CACHE)
def test_the_generation_cache_is_transformers_own(name):
    """transformers' DynamicCache for 4 rows of a 96-token prompt, right after its forward and after 8 sampled
    tokens: every layer's keys and values at the config's head sizes (Qwen3's 128; DeepSeek's latent attention
    caches its compressed keys/values and rotary keys), a sliding layer's only for its window once decoding
    began (after the prompt it still holds a view of the prompt's storage); within 1%."""
    info, m = info_and_model(name, "eager" if name in ONLY_EAGER else "sdpa", torch.float32)
    m.eval()
    rows, prompt, new = 4, 96, 8
    ids = torch.randint(3, 512, (rows, prompt), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        after_prompt = storage_bytes(m(ids, use_cache=True).past_key_values)
        out = m.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                         min_new_tokens=new, return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
    decoded = storage_bytes(out.past_key_values)
    planned_prompt = kv_cache_bytes(info, rows, prompt, 4, windowed=False)
    # the cache holds every token but the last sampled one (its keys are never needed)
    planned = kv_cache_bytes(info, rows, prompt + new - 1, 4)
    print(f"{name}: after the prompt {after_prompt} bytes (planned {planned_prompt}), after {new} tokens {decoded} "
          f"(planned {planned})")  # fmt: skip
    assert planned_prompt == pytest.approx(after_prompt, rel=0.01)
    assert planned == pytest.approx(decoded, rel=0.01)


FLOPS = ["llama", "qwen3", "qwen3-4b", "gemma3_text", "gpt2", "olmo2", "qwen3_moe", "mixtral", "gpt_oss",
         "deepseek_v3"]  # fmt: skip


@pytest.mark.parametrize("name", FLOPS)
def test_flops_a_token_are_what_torch_counts(name):
    """A forward and backward at 512 tokens, eager attention and eager experts (the operators torch's
    FlopCounterMode counts): the plan's FLOPs a token (the parameters a token multiplies by: a mixture's top-k
    experts, no embedding that is only looked up; attention at the config's head sizes) within 1% and never
    under. Counted as 6 x every parameter and 12 L h s, Qwen3 was 1.14x under and Mixtral and gpt-oss 1.8-2x
    over (4 x active + 2 x all parameters, as the time model had it)."""
    from torch.utils.flop_counter import FlopCounterMode

    seq = 512
    experts = (
        {"experts_implementation": "eager"}
        if name in ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3")
        else {}
    )
    info, m = info_and_model(name, "eager", torch.float32)
    if experts:
        m = AutoModelForCausalLM.from_config(m.config, attn_implementation="eager", **experts).float().train()
    ids = torch.randint(3, 512, (1, seq), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counted:
        m(input_ids=ids, labels=ids).loss.backward()
    measured = counted.get_total_flops() / seq
    print(
        f"{name}: measured {measured / 1e6:.2f} MFLOP a token, planned {flops_per_token(info, seq) / 1e6:.2f}"
    )
    assert 0.99 <= measured / flops_per_token(info, seq) <= 1.0
