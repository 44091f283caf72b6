"""data.packing by the project's own check (trainer/model/packing.py), not a hand list: a small model
of each family trains one packed row as its two examples one by one (fp32), and the families whose
layers carry state across positions are refused with the measured difference."""

import json

import pytest
import torch

from trainer.model.packing import TOLERANCE, shrunk, verdict

# The families the issue names, from transformers' own defaults for each (the shapes of the published
# models: Gemma 3's sliding and global layers, Phi-3's fused projections, Granite's multipliers...);
# SmolLM2 is a Llama with tied embeddings and its own widths.
PACKING = {
    "gemma3_text": {},
    "phi3": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {"sliding_window": 4096},
    "olmo2": {},
    "granite": {},
    "llama": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
              "num_key_value_heads": 3, "tie_word_embeddings": True, "vocab_size": 49152},  # SmolLM2-135M
}  # fmt: skip


def config(model_type, **fields):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **fields)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", list(PACKING))
def test_these_families_pack(model_type, attn, tmp_path):
    v = verdict(config(model_type, **PACKING[model_type]), attn, tmp_path)
    assert v["packs"], v["why"]
    assert v["loss"] <= 1e-6 and v["grads"] <= 1e-5, v  # fp32: packed = one by one, to rounding
    assert v["crossed"] > 1e-2, v  # without restarting positions the second example sees the first
    assert (
        f"model type '{model_type}' with {attn} attention: a packed row trains as its examples one by one"
        in v["why"]
    )


@pytest.mark.parametrize("model_type", ["jamba", "qwen3_next"])
def test_families_with_state_across_positions_are_refused(model_type, tmp_path):
    """Mamba layers (Jamba) and gated delta-rule linear attention (Qwen3-Next) carry a state from the
    first example into the second: the gradients differ beyond the tolerance."""
    v = verdict(config(model_type), "sdpa", tmp_path)
    assert not v["packs"] and v["grads"] > 10 * TOLERANCE["grads"], v
    assert "does not train as its examples one by one" in v["why"]


def test_the_verdict_is_cached_per_family_and_kernel(tmp_path):
    cfg = config("qwen3")
    first = verdict(cfg, "sdpa", tmp_path)
    (path,) = (tmp_path / "packing").iterdir()
    assert json.loads(path.read_text()) == first
    path.write_text(json.dumps({**first, "why": "from the cache"}))
    assert verdict(cfg, "sdpa", tmp_path)["why"] == "from the cache"  # not measured again
    verdict(cfg, "eager", tmp_path)
    assert len(list((tmp_path / "packing").iterdir())) == 2


def test_a_kernel_the_family_lacks_is_a_reason_not_a_crash(tmp_path):
    v = verdict(config("gemma2"), "sdpa", tmp_path)
    assert not v["packs"] and "the check could not run" in v["why"]


def test_the_small_model_keeps_what_the_masks_depend_on():
    cfg = config("gemma3_text")
    small = shrunk(cfg)
    assert small.hidden_size == 64 and small.vocab_size == 96 and small.num_hidden_layers == 8
    assert small.layer_types == cfg.layer_types[:8] and "full_attention" in small.layer_types
    assert small.sliding_window == 6  # bites inside the 11- and 7-token examples
    assert cfg.hidden_size != 64  # the caller's config is untouched


def test_a_batch_needs_only_its_rows_longest_last_target():
    """Fine-tuning batches (here one example a row, data.packing: false) are cut to their longest row's
    last target (stream._collate): what follows is padding or an untrained tail, which nothing before it
    attends to; the loss is the same. And the rows end to end in one row (what the engine feeds
    flash_attention_2, which keeps packed examples apart only in a batch of one row) give it too."""
    from transformers import AutoModelForCausalLM

    from trainer.data.chat import Example
    from trainer.data.pack import IGNORE, pack_examples
    from trainer.data.stream import _collate

    g = torch.Generator().manual_seed(0)
    exs = [Example(torch.randint(3, 96, (n,), generator=g).tolist(), [False] * 3 + [True] * (n - 6) + [False] * 3)
           for n in (20, 9, 14)]  # fmt: skip
    packed = pack_examples(exs, 32, pad_id=0, one_per_row=True)
    rows = __import__("numpy").stack([packed["input_ids"], packed["labels"], packed["position_ids"]], axis=1)
    batch = _collate(rows)
    assert batch.shape == (3, 3, 17)  # the longest example's last target: position 16 of 20
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(shrunk(config("llama")), attn_implementation="sdpa").float()
    full = torch.from_numpy(rows.astype("int64"))
    cut = model(input_ids=batch[:, 0], labels=batch[:, 1], position_ids=batch[:, 2], use_cache=False).loss
    whole = model(input_ids=full[:, 0], labels=full[:, 1], position_ids=full[:, 2], use_cache=False).loss
    assert (full[:, 1, 17:] == IGNORE).all() and cut.item() == pytest.approx(whole.item(), rel=1e-6)
    from trainer.engine import as_one_row

    row = as_one_row(batch)
    assert row.shape == (1, 3, 3 * 17) and (row[0, :, 17:34] == batch[1]).all()
    flat = model(input_ids=row[:, 0], labels=row[:, 1], position_ids=row[:, 2], use_cache=False).loss
    assert flat.item() == pytest.approx(whole.item(), rel=1e-6)
    with torch.no_grad():  # without the positions the rows would attend to each other: another loss
        crossed = model(input_ids=row[:, 0], labels=row[:, 1], use_cache=False).loss
    assert abs(crossed.item() - whole.item()) > 1e-4
