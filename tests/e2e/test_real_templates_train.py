"""Training on the published templates (tests/e2e/test_real_templates.py checks the data): each family
trains packed, masking learns fixed answers where training on the prompts cannot, Gemma 3 without
packing pads each micro batch only to its longest example."""

import re

import pytest
from helpers import (
    EXPECTED,
    FAMILIES,
    TINY,
    bin_train,
    data_for,
    family_sets,
    real_chat_data,
    sets_for,
    train,
    yaml_value,
)

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_trains_packed(name, tmp_path):
    """bin/train on the family's tokenizer and template, packed: the banner names the strategy and why,
    and the project's own packing check for the family; the loss falls. In fp32: precision is not what
    this proves, and on an AVX2-only host a bf16 step over a 150k-262k vocabulary costs many fp32 ones;
    the tiled loss, the faster loss over such a vocabulary (the same loss: tests/unit/test_family_matrix.py)."""
    path = data_for(name, tmp_path, rows=40)
    sets = sets_for(
        name, path, tmp_path, **{"train.max_steps": 12, "train.log_every": 4, "model.chunked_loss": True}
    )
    r = train(tmp_path, sets, debug=False)
    assert f"chat template: multi_turn {EXPECTED[name][2]} (auto: " in r.output, r.output[-3000:]
    model_type = FAMILIES[name]["model_type"]
    verdict = rf"packing: model type '{model_type}' with (eager|sdpa) attention: a packed row trains as its examples"
    assert re.search(verdict, r.output), r.output[-3000:]
    steps = sorted(r.losses)
    print(name, {k: round(v, 3) for k, v in r.losses.items()})
    assert r.losses[steps[-1]] < r.losses[steps[0]] - 2, r.losses  # from ln(vocab), about 12


def test_masking_learns_fixed_answers_to_random_questions_and_train_on_prompt_cannot(tmp_path):
    """A black box: user turns of random letters, every answer the same, Qwen3 (one example per turn,
    with its <think> block). With the answers as targets the loss falls below 0.1; training on the
    random prompts too, it stays above 1. In fp32 (family_sets' precision), as the test above."""
    path = real_chat_data(tmp_path / "b.jsonl", rows=120, system=True, random_users=True)
    sets = family_sets("qwen3", path, **{"train.max_steps": 48, "train.micro_batch_size": 2, "data.seq_len": 128,
                                         "train.log_every": 4,
                                         "model.config.hidden_size": 64, "model.config.intermediate_size": 128,
                                         "optim.schedule": "constant", "model.chunked_loss": True,
                                         "data.cache_dir": str(tmp_path / "cache")})  # fmt: skip
    masked = train(tmp_path / "masked", sets, debug=False)
    everything = train(tmp_path / "all", {**sets, "data.train_on_prompt": True}, debug=False)
    print("answers only:", {k: round(v, 3) for k, v in masked.losses.items()})
    print("train_on_prompt:", {k: round(v, 3) for k, v in everything.losses.items()})
    assert masked.losses[max(masked.losses)] < 0.1, masked.losses
    assert min(everything.losses.values()) > 1, everything.losses


def test_gemma3_without_packing_pads_each_micro_batch_to_its_longest(tmp_path):
    """data.packing: false on Gemma 3's chat data: each example alone in a row of seq_len, but a micro
    batch is only as wide as its longest example (and data.group_by_length makes them alike): the
    banner reports the padding share both ways, the run trains on the narrower batches."""
    path = data_for("gemma3", tmp_path, rows=48)
    sets = sets_for("gemma3", path, tmp_path, **{"data.packing": False, "train.micro_batch_size": 4,
                                                 "train.max_steps": 4, "train.log_every": 2})  # fmt: skip
    args = [TINY, *[x for k, v in sets.items() for x in ("--set", f"{k}={yaml_value(v)}")]]
    p = bin_train(*args, "--set", f"run_dir={tmp_path / 'p'}", "--preview-data", "0")
    plain = re.search(
        r"padding: ([\d.]+)% of the first epoch's tokens padded to seq_len, ([\d.]+)% as fed", p.stdout
    )
    assert p.returncode == 0 and plain, p.stdout + p.stderr
    r = train(tmp_path, {**sets, "data.group_by_length": True}, debug=False)
    grouped = re.search(
        r"padding: ([\d.]+)% of an epoch's tokens padded to seq_len 192, ([\d.]+)% as fed", r.output
    )
    assert grouped, r.output[-3000:]
    print(
        f"padding: to seq_len {plain[1]}%, to the micro batch's longest {plain[2]}%, grouped by length {grouped[2]}%"
    )
    assert float(plain[1]) > 50 and float(grouped[1]) == float(plain[1])
    assert float(grouped[2]) < float(plain[2]) < float(plain[1]) and float(grouped[2]) < 25
    # throughput and MFU count the tokens fed: the batches were narrower than seq_len
    lines = [m for m in r.metrics if "tokens_per_s" in m]
    assert lines[-1]["tokens"] < 4 * 4 * 192 * 0.75 and lines[-1]["tokens_per_step"] < 4 * 192 * 0.75
    for m in lines:
        assert m["tokens_per_s"] * m["step_time_s"] == pytest.approx(m["tokens_per_step"], rel=0.01)
