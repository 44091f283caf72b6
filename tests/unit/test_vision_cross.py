"""Llama 3.2 Vision (trainer/model/vision_cross.py, trainer/data/cross_mask.py): an image one token, its tiles
attended by cross-attention layers. Packed rows and batches give each example its logits alone (the tokens before
its first image attend its own images only; an example without an image skips the cross-attention layers), and
each of the two fixes is needed (the packing check fails without it); data.max_images bounds a row's images (the
plan's bound: an example with more is refused, packing starts a new row); --plan says the image budget with the
cross-attention layers'; its template's refusal of an image in an answer is said."""

import json
import re

import pytest
import torch
from helpers import TINY, yaml_value
from transformers import AutoConfig, AutoModelForImageTextToText

from tests.vision_helpers import model_config, opened, processor_dir, shapes_data
from trainer import config
from trainer.common.errors import UserError
from trainer.data.examples import build_rows
from trainer.data.sources import load_raw
from trainer.data.tokenizer import load_tokenizer
from trainer.model import vision, vision_cross
from trainer.model.vision_packing import measure

VOCAB = 128257


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("cross")


def tiny_config():
    fields = model_config("mllama", VOCAB)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def rows_of(proc_dir, data, **kw):
    sets = {"data.tokenizer": str(proc_dir), "data.train.files": str(data), "data.train.kind": "chat",
            "data.seq_len": 128, "data.eval_fraction": 0, "data.packing": False, "train.eval_every": 0, **kw}  # fmt: skip
    s = config.load(TINY, [f"{k}={yaml_value(v)}" for k, v in sets.items()]).data
    return build_rows(
        load_raw(s.train, "data.train"), load_tokenizer(str(proc_dir)), s, s.train, "data.train"
    )


def test_packed_rows_are_each_example_alone_and_each_fix_is_needed(monkeypatch):
    """A packed row of two examples with an image and one without: loss and gradients those of the three alone
    (~1e-7). Without the mask's SEES_ALL (the first example's tokens before its image then see the second's
    image too) or without the skip at the example without an image (its tokens then attend the others' images),
    the check fails."""
    got = measure(tiny_config(), "sdpa")
    assert got["loss"] < 1e-6 and got["grads"] < 1e-5 and got["crossed"] > 0.1, got
    with monkeypatch.context() as m:
        from transformers.models.mllama import modeling_mllama

        now = modeling_mllama._prepare_cross_attention_mask  # (installed by a test before: its original)
        m.setattr(modeling_mllama, "_prepare_cross_attention_mask", getattr(now, "original", now))
        m.setattr(vision_cross, "install", lambda: None)
        without = measure(tiny_config(), "sdpa")
    assert without["grads"] > 1e-4, without
    with monkeypatch.context() as m:
        m.setattr(vision_cross, "skip_hook", lambda state: lambda module, args, output: output)
        unskipped = measure(tiny_config(), "sdpa")
    assert unskipped["grads"] > 1e-4, unskipped
    print(f"packed: {got}; without SEES_ALL: {without}; without the skip: {unskipped}")


def test_a_batch_gives_each_row_its_logits_alone():
    """Rows of a micro batch with 2, 0 and 1 images (padded to 2 image slots): each row's logits are its own alone
    (the loss split-invariant across micro batches); transformers' own batch gives the text-only row other logits
    (its tokens attend the padded images)."""
    torch.manual_seed(0)
    model = opened(AutoModelForImageTextToText.from_config(tiny_config())).eval()
    inputs = vision.Inputs(model, vision.family("mllama"), {}, None, 128256)
    inputs.install()
    g = torch.Generator().manual_seed(1)

    def example(images, before=3, after=5):
        ids = torch.randint(10, 1000, (before,), generator=g).tolist()
        for _ in range(images):
            ids += [128256] + torch.randint(10, 1000, (2,), generator=g).tolist()
        ids += torch.randint(10, 1000, (after,), generator=g).tolist()
        pics = {"pixel_values": torch.randn(images, 2, 3, 28, 28, generator=g),
                "aspect_ratio_ids": torch.tensor([2] * images, dtype=torch.long),
                "aspect_ratio_mask": torch.ones(images, 2, dtype=torch.long)}  # fmt: skip
        return ids, pics

    def logits(rows):
        width = max(len(r[0]) for r in rows)
        ids = torch.tensor([r[0] + [0] * (width - len(r[0])) for r in rows])
        pos = torch.tensor([list(range(len(r[0]))) + list(range(width - len(r[0]))) for r in rows])
        images = {k: torch.cat([r[1][k] for r in rows]) for k in rows[0][1]}
        images = images if len(images["pixel_values"]) else {}
        kw = inputs.kwargs(torch.stack([ids, torch.zeros_like(ids), pos], dim=1), images)
        with torch.no_grad():
            return model(input_ids=ids, position_ids=pos, use_cache=False, **kw).logits

    rows = [example(2), example(0), example(1)]
    batch = logits(rows)
    for k, r in enumerate(rows):
        alone = logits([r])[0]
        assert torch.allclose(batch[k, : len(r[0])], alone, atol=1e-5), k
    inputs.skip = None  # transformers' own batch: the processor's mask, no skip
    ids = torch.tensor([rows[1][0]])
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits[0]
    assert torch.allclose(batch[1, : len(rows[1][0])], plain, atol=1e-5)


def test_max_images_bounds_a_row_refusing_more_and_packing_apart(root, tmp_path):
    """data.max_images (null: 1 for Llama 3.2 Vision): an example with 2 images is refused with the file:line and
    the fix; with 2, it trains; packing puts two one-image examples that fit in one row in two rows at 1. Set, it
    bounds another family's rows too."""
    d = processor_dir("mllama", root)
    shapes_data(tmp_path / "shapes.jsonl", rows=3)
    two = {"messages": [{"role": "user", "content": "<image>This and <image>that?"},
                        {"role": "assistant", "content": "Two squares."}],
           "images": ["pictures/red-square.png", "pictures/red-square.png"]}  # fmt: skip
    path = tmp_path / "two.jsonl"
    path.write_text(json.dumps(two) + "\n")
    with pytest.raises(UserError, match=r"two.jsonl:1: the row has 2 images, more than data.max_images \(null: 1 "
                       r"for Llama 3.2 Vision.*\); set data.max_images: 2"):  # fmt: skip
        rows_of(d, path)
    # the bound is every family's: Qwen2-VL's rows too (by default its images' tokens bound them)
    qwen = processor_dir("qwen2_vl", root)
    assert rows_of(qwen, path)[1]["vision"]["images"] == 2
    with pytest.raises(UserError, match=r"the row has 2 images, more than data.max_images \(1\); set"):
        rows_of(qwen, path, **{"data.max_images": 1})
    rows, stats = rows_of(d, path, **{"data.max_images": 2})
    assert stats["vision"]["images"] == 2 and len(rows) == 1
    data = shapes_data(tmp_path / "four.jsonl", rows=4, forms=("images",))
    packed, _ = rows_of(d, data, **{"data.packing": True, "data.seq_len": 256})
    assert len(packed) == 4  # each example's image alone in a row (they would fit in one)
    both, _ = rows_of(d, data, **{"data.packing": True, "data.seq_len": 256, "data.max_images": 2})
    assert len(both) == 2 and all(int((r[0] == 128256).sum()) == 2 for r in both)


def test_an_image_in_an_answer_is_refused_with_the_reason(root, tmp_path):
    """Llama 3.2 Vision's template renders the system header (with the date) only when no message has an image:
    the prompt rendered alone is not the start of the conversation with an image in its answer. Refused (file:line),
    not trained on a shifted answer; a system message beside an image, which the template refuses, too."""
    d = processor_dir("mllama", root)
    shapes_data(tmp_path / "shapes.jsonl", rows=1)
    row = {"messages": [{"role": "user", "content": "Draw a square."},
                        {"role": "assistant", "content": [{"type": "text", "text": "Here:"},
                                                          {"type": "image", "path": "pictures/red-square.png"}]}]}  # fmt: skip
    path = tmp_path / "answer.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(
        UserError, match=r"answer.jsonl:1: the chat template renders the prompt of assistant turn 1"
    ):
        rows_of(d, path)
    # a system message beside an image: the template raises; said with the file and line (was a traceback)
    row = {"messages": [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": [{"type": "image", "path": "pictures/red-square.png"},
                                                     {"type": "text", "text": "What?"}]},
                        {"role": "assistant", "content": "A square."}]}  # fmt: skip
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(UserError, match=r"answer.jsonl:1: the chat template cannot render this conversation "
                       r"\(TemplateError: Prompting with images is incompatible with system messages.\)"):  # fmt: skip
        rows_of(d, path)


def test_plan_says_the_images_and_the_cross_attention_layers(tmp_path, capsys):
    """--plan's line for Llama 3.2 Vision: its images in tiles, one token each, data.max_images a row (1 when
    null), the cross-attention layers' bytes; the budget grows with data.max_images."""
    from trainer.run.cli import main

    overrides = [f"model.config={yaml_value(model_config('mllama', VOCAB))}", "data.seq_len=64",
                 "train.micro_batch_size=2", "train.precision=fp32", f"run_dir={tmp_path}/run"]  # fmt: skip
    lines = {}
    for n in (None, 3):
        extra = [] if n is None else [f"--set=data.max_images={n}"]
        main([str(TINY), "--plan", *(f"--set={o}" for o in overrides), *extra])
        out = capsys.readouterr().out
        lines[n] = next(x for x in out.splitlines() if "images (Llama 3.2 Vision" in x)
    assert "up to 2 images a micro batch (data.max_images a row)" in lines[None], lines[None]
    assert "up to 6 images a micro batch" in lines[3] and "1 cross-attention layers" in lines[3], lines[3]
    patches = [int(x.split("a row), ")[1].split(" patches")[0].replace(",", "")) for x in lines.values()]
    assert patches[1] == 3 * patches[0] > 0  # 2 images of 2 tiles of 4 patches and a class token, padded to 8


@pytest.mark.parametrize("family,token", [("mllama", "<|image|>"), ("qwen2_vl", "<|image_pad|>")])
def test_review_the_image_token_written_in_the_text_is_refused(root, tmp_path, family, token):
    """Review finding: the tokenizer reads the text "<|image|>" as Llama 3.2 Vision's image token. In a row without
    an image it reached the rows (from an answer, as a target): training stopped with a traceback (the micro
    batch's image tokens outnumbering its images, or a target past the LM head); Qwen2-VL's <|image_pad|> trained
    as a target. Refused now with the file and line; in a row with an image too (it said the template left one
    out)."""
    d = processor_dir(family, root)
    shapes_data(tmp_path / "shapes.jsonl", rows=1)
    text = {
        "messages": [{"role": "user", "content": "Write the token."}, {"role": "assistant", "content": token}]
    }
    path = tmp_path / "literal.jsonl"
    path.write_text(json.dumps(text) + "\n")
    with pytest.raises(UserError, match=rf"literal.jsonl:1: the text holds {re.escape(token)} \(the model's image "
                       r"token\) 1 time\(s\) but the row has no image"):  # fmt: skip
        rows_of(d, path)
    both = {"messages": [{"role": "user", "content": f"<image>What is {token}?"},
                         {"role": "assistant", "content": "A square."}], "images": ["pictures/red-square.png"]}  # fmt: skip
    path.write_text(json.dumps(both) + "\n")
    with pytest.raises(UserError, match=rf"literal.jsonl:1: the chat template placed 2 image tokens for the row's 1 "
                       rf"images; the text itself holds {re.escape(token)}: remove it"):  # fmt: skip
        rows_of(d, path)


def test_review_model_info_never_builds_a_vision_language_models_whole_text_model(monkeypatch):
    """Review finding: model-info's Ulysses check built a small model of the config that packing.shrunk shrinks at
    its top level only: a vision-language model's text model whole (18.5 GB for Llama-3.2-11B-Vision's; --plan
    killed for memory on 24 GB). Its verdict is said without building anything (sequence parallelism with images is
    refused at build)."""
    from transformers import AutoModelForCausalLM

    from trainer.model.sequence import ulysses_verdict

    def built(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr(AutoModelForCausalLM, "from_config", built)
    for model_type in ("mllama", "gemma3"):
        got = ulysses_verdict(AutoConfig.for_model(model_type), "sdpa")
        assert "is a vision-language model: sequence parallelism with its images is not verified" in got, got


def test_review_flash_attention_2_and_a_custom_tiling_are_handled():
    """Review suspicions, confirmed by reading: flash_attention_2 trains a micro batch's rows as one row, which the
    image inputs (a row's each) are not made for: refused with images (exit 2, the fix); a config whose aspect
    ratios hold no 2 x 2 arrangement of its 4 tiles made the tower's measure raise ("[2, 2] is not in list"): it
    measures the widest arrangement there is."""
    from types import SimpleNamespace

    from trainer.model.vision_count import measure as measure_tower
    from trainer.run.build_model import vision_inputs

    model = SimpleNamespace(config=SimpleNamespace(model_type="mllama"))
    section = SimpleNamespace(attn_implementation="flash_attention_2")
    planned = SimpleNamespace(plan=SimpleNamespace(pp=1, tp=1, sp=1, ep=1), model=section)
    exp = SimpleNamespace(train=SimpleNamespace(objective="sft"), model=section)
    with pytest.raises(
        UserError, match=r"model.attn_implementation: flash_attention_2 .* Llama 3.2 Vision.* use sdpa"
    ):
        vision_inputs(exp, planned, model, SimpleNamespace(images=object(), idle_image=None, vision={}))
    cfg = AutoConfig.for_model("mllama", vision_config={
        "num_hidden_layers": 2, "num_global_layers": 1, "hidden_size": 32, "intermediate_size": 64,
        "attention_heads": 2, "image_size": 56, "vision_output_dim": 192,
        "supported_aspect_ratios": [[1, 1], [1, 2], [2, 1], [1, 3], [3, 1]]}, text_config={
        "hidden_size": 64, "num_hidden_layers": 2, "cross_attention_layers": [1], "intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "pad_token_id": 0})  # fmt: skip
    v = measure_tower(cfg, ("vision_tower",))
    assert v.layers == 3 and v.layer[0] > 0 and v.cross_layers == 1
