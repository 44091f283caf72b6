"""Images in chat data (trainer/data/images.py, image_rows.py), over the verified families (Qwen2-VL, Gemma 3) with
their real processors, the published tokenizers and templates: the three forms of data make the same rows; the ids
and pixels are the model maker's processor's and TRL's collator's; no image token is ever a target (TRL's collator
trains them); a cut inside an image drops the example, counted; bad input names the file and line."""

import json

import numpy as np
import pytest
import torch
from helpers import TINY, yaml_value

from tests.vision_helpers import VISION_FAMILIES, draw, model_config, opened, processor_dir, shapes_data
from trainer import config
from trainer.common.errors import UserError
from trainer.data.examples import build_rows
from trainer.data.image_rows import image_tokens as data_image_tokens
from trainer.data.images import load_processor
from trainer.data.pack import IGNORE
from trainer.data.sources import load_raw
from trainer.data.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("vision")


def section(proc_dir, data, **kw):
    sets = {"data.tokenizer": str(proc_dir), "data.train.files": str(data), "data.train.kind": "chat",
            "data.seq_len": 128, "data.eval_fraction": 0, "data.packing": False, "train.eval_every": 0, **kw}  # fmt: skip
    return config.load(TINY, [f"{k}={yaml_value(v)}" for k, v in sets.items()]).data


def rows_of(proc_dir, data, **kw):
    s = section(proc_dir, data, **kw)
    return build_rows(
        load_raw(s.train, "data.train"), load_tokenizer(str(proc_dir)), s, s.train, "data.train"
    )


def image_tokens(stats):
    """The rows' image token ids (the processor's image token, its per-token types' marks)."""
    from types import SimpleNamespace

    return data_image_tokens(SimpleNamespace(vision=stats["vision"]))


def one_row(path, row):
    path.write_text(json.dumps(row) + "\n")
    return path


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_the_three_forms_make_the_same_rows_and_no_image_token_is_a_target(root, tmp_path, family):
    """Content parts, an images column with <image>, a single image column: the same ids, targets and pixels for
    the same conversation; the answer's tokens (and its end of turn) are the targets, and no token of an image is
    one -- even an image in the assistant's own turn."""
    d = processor_dir(family, root)
    data = shapes_data(tmp_path / "shapes.jsonl", rows=3, forms=("parts", "images", "image"))
    lines = [json.loads(x) for x in data.read_text().splitlines()]
    same = [{**lines[k], "messages": [dict(m) for m in lines[k]["messages"]]} for k in range(3)]
    for k in range(3):  # the same picture and answer in each form
        pic = "pictures/red-square.png"
        if k == 0:
            same[k]["messages"][0]["content"][0]["path"] = pic
        else:
            same[k]["images" if k == 1 else "image"] = [pic] if k == 1 else pic
        same[k]["messages"][1]["content"] = "A red square."
    data.write_text("".join(json.dumps(r) + "\n" for r in same))
    rows, stats = rows_of(d, data)
    assert stats["vision"]["images"] == 3 and stats["kept"] == 3
    assert (rows[0] == rows[1]).all() and (rows[0] == rows[2]).all()
    store = stats["vision"]["store"]
    for key in store.arrays:
        assert np.array_equal(store.batch([0])[key], store.batch([1])[key])
    tok = load_tokenizer(str(d))
    ids, labels = rows[0, 0], rows[0, 1]
    image = set(image_tokens(stats))
    assert any(int(i) in image for i in ids)
    assert not any(int(i) in image for i in labels[labels != IGNORE])
    assert tok.decode(labels[labels != IGNORE]).strip().startswith("A red square.")
    if (
        family == "mllama"
    ):  # Llama 3.2 Vision's template drops its system header once any message has an image:
        return  # an image in the answer changes the prompt before it (refused, test_vision_cross.py)
    # an image in the answer: its tokens, and the special tokens around them, are never targets
    ans = {"messages": [{"role": "user", "content": "Draw a circle."},
                        {"role": "assistant", "content": [{"type": "text", "text": "Here:"},
                                                          {"type": "image", "path": "pictures/red-square.png"}]}]}  # fmt: skip
    rows, stats = rows_of(d, one_row(tmp_path / "answer.jsonl", ans))
    ids, labels = rows[0, 0], rows[0, 1]
    targets = [tok.convert_ids_to_tokens(int(i)) for i in labels[labels != IGNORE]]
    assert targets and not any(
        ("image" in t or "vision" in t or t == "<image_soft_token>") for t in targets
    ), targets
    assert stats["vision"]["image_tokens"] > 0


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_ids_and_pixels_are_the_model_makers_processors_and_trls_collators(root, tmp_path, family):
    """Our ids and pixel values for a conversation with an image equal the processor's apply_chat_template (images
    included) and TRL's DataCollatorForVisionLanguageModeling; TRL's labels train the image tokens (shown), ours
    never do and otherwise train the answer; the loss through the engine's inputs equals a plain transformers
    forward of the processor's batch with our labels."""
    from transformers import AutoConfig, AutoModelForImageTextToText
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    from trainer.model.vision import Inputs
    from trainer.model.vision import family as family_of

    d = processor_dir(family, root)
    data = shapes_data(tmp_path / "shapes.jsonl", rows=1, forms=("images",))
    rows, stats = rows_of(d, data)
    proc = load_processor(str(d))
    img = draw("square", "red")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "A red square."}]}]  # fmt: skip
    ref = proc.apply_chat_template(messages, images=[img], tokenize=True, return_dict=True, return_tensors="pt",
                                   processor_kwargs={"add_special_tokens": False})  # fmt: skip
    n = int(ref["input_ids"].shape[1])
    ids, labels = (
        torch.from_numpy(rows[0, 0, :n].astype(np.int64)),
        torch.from_numpy(rows[0, 1, :n].astype(np.int64)),
    )
    assert torch.equal(ids, ref["input_ids"][0])
    ours = stats["vision"]["store"].batch([0])
    trl = DataCollatorForVisionLanguageModeling(proc)([{"images": [img], "messages": [
        {"role": "user", "content": "What is this?"}, {"role": "assistant", "content": "A red square."}]}])  # fmt: skip
    assert torch.equal(trl["input_ids"][0], ids)
    image = list(image_tokens(stats))
    trained_by_trl = int(torch.isin(trl["labels"][0], torch.tensor(image)).sum())
    assert trained_by_trl > 0 and not torch.isin(labels[labels != IGNORE], torch.tensor(image)).any()
    print(f"{family}: TRL's collator trains {trained_by_trl} image tokens of one image; ours none")
    # the loss: the engine's inputs (rows, their positions, the image tensors) against transformers' own forward
    fields = model_config(family, len(proc.tokenizer))
    torch.manual_seed(0)
    model = opened(
        AutoModelForImageTextToText.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    ).eval()
    inputs = Inputs(
        model, family_of(family), stats["vision"]["token_types"], None, stats["vision"]["image_token"]
    )
    row = torch.from_numpy(rows[:1, :, :n].astype(np.int64))
    kw = inputs.kwargs(row, {k: torch.from_numpy(np.asarray(v)) for k, v in ours.items()})
    for key in set(ref) - {"input_ids", "attention_mask"}:  # every processor output reaches the model as made
        if (
            key == "cross_attention_mask"
        ):  # the tokens before the image: 2 where the processor's 0 (vision_cross.py)
            assert (kw[key] == 2).any() and torch.equal(kw[key] == 1, ref[key] == 1), key
            continue
        assert torch.equal(kw[key], ref[key]), key
    with torch.no_grad():
        got = model(input_ids=ids[None], labels=labels[None], use_cache=False, **kw).loss
        plain = {k: v for k, v in ref.items() if k != "attention_mask"}
        want = model(**plain, labels=labels[None], use_cache=False).loss
    assert got.item() == pytest.approx(want.item(), rel=1e-6)


def test_a_cut_inside_an_image_drops_the_example_and_images_alone_past_seq_len_are_refused(root, tmp_path):
    """truncation: right keeps an example's start, but never cuts an image's tokens: such an example is dropped and
    counted; a row whose images alone take data.seq_len is refused (file:line, the fix)."""
    d = processor_dir("qwen2_vl", root)
    pic = "pictures/red-square.png"
    shapes_data(tmp_path / "shapes.jsonl", rows=1)
    long = {"messages": [{"role": "user", "content": "word " * 40 + "<image><image>"},
                         {"role": "assistant", "content": "Two squares."}], "images": [pic, pic]}  # fmt: skip
    ok = {"messages": [{"role": "user", "content": "<image>What is this?"}, {"role": "assistant", "content": "A square."}],
          "images": [pic]}  # fmt: skip
    path = tmp_path / "cut.jsonl"
    path.write_text(json.dumps(long) + "\n" + json.dumps(ok) + "\n")
    rows, stats = rows_of(d, path, **{"data.seq_len": 64})
    assert stats["kept"] == 1 and stats["vision"]["cut"] == 1 and stats["dropped_too_long"] == 1
    many = {"messages": [{"role": "user", "content": "<image>" * 12}, {"role": "assistant", "content": "Squares."}],
            "images": [pic] * 12}  # fmt: skip
    with pytest.raises(
        UserError, match=r"many.jsonl:1: the row's images alone take 72 tokens, data.seq_len is 64"
    ):
        rows_of(d, one_row(tmp_path / "many.jsonl", many), **{"data.seq_len": 64})


BAD = {
    "missing": ({"messages": [{"role": "user", "content": [{"type": "image", "path": "nowhere.png"}]},
                              {"role": "assistant", "content": "x"}]}, r"bad.jsonl:1: image 0: cannot read .*nowhere.png"),
    "not an image": ({"messages": [{"role": "user", "content": [{"type": "image", "path": "bad.jsonl"}]},
                                   {"role": "assistant", "content": "x"}]}, r"bad.jsonl:1: image 0 is not an image"),
    "more placeholders": ({"messages": [{"role": "user", "content": "<image><image>"}, {"role": "assistant", "content": "x"}],
                           "images": ["pictures/red-square.png"]}, r"bad.jsonl:1: 2 <image> placeholder\(s\) .* but 1 image"),
    "fewer placeholders": ({"messages": [{"role": "user", "content": "<image>"}, {"role": "assistant", "content": "x"}],
                            "images": ["pictures/red-square.png"] * 2}, r"bad.jsonl:1: 1 <image> placeholder\(s\) .* but 2 image"),
    "a part naming no image": ({"messages": [{"role": "user", "content": [{"type": "image"}]},
                                             {"role": "assistant", "content": "x"}]}, r"bad.jsonl:1: message 0: image part 0 names no image"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_images_are_refused_with_the_file_and_line(root, tmp_path, case):
    d = processor_dir("gemma3", root)
    shapes_data(tmp_path / "shapes.jsonl", rows=1)
    row, message = BAD[case]
    with pytest.raises(UserError, match=message):
        rows_of(d, one_row(tmp_path / "bad.jsonl", row))


def test_images_for_a_text_model_are_refused(tmp_path):
    """A tokenizer without an image processor (a text model's) and a row with an image: exit 2 at its line."""
    shapes_data(tmp_path / "shapes.jsonl", rows=1)
    row = {"messages": [{"role": "user", "content": "<image>What?"}, {"role": "assistant", "content": "x"}],
           "images": ["pictures/red-square.png"]}  # fmt: skip
    with pytest.raises(
        UserError,
        match=r"text.jsonl:1: the row has images but data.tokenizer \(byte\) has no image processor",
    ):
        rows_of("byte", one_row(tmp_path / "text.jsonl", row))


def test_image_max_pixels_bounds_the_image_tokens(root, tmp_path):
    """A 224 x 224 image under Qwen2-VL's processor (at most 16 merged tokens here) takes fewer tokens once
    data.image_max_pixels scales it to 56 x 56 (4 tokens)."""
    d = processor_dir("qwen2_vl", root)
    draw("circle", "blue", size=224).save(tmp_path / "big.png")
    row = {"messages": [{"role": "user", "content": "<image>What?"}, {"role": "assistant", "content": "A circle."}],
           "images": ["big.png"]}  # fmt: skip
    path = one_row(tmp_path / "big.jsonl", row)
    _, full = rows_of(d, path)
    _, bounded = rows_of(d, path, **{"data.image_max_pixels": 56 * 56})
    assert full["vision"]["image_tokens"] == 16 + 2 and bounded["vision"]["image_tokens"] == 4 + 2


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packing_images_is_checked_per_family(attn):
    """Every verified family packs rows with images: packed = one by one (loss and gradients, measured ~1e-7;
    Qwen2-VL with each example's own multimodal positions, Gemma 3 with its sliding layers' masks fixed:
    trainer/model/vision_masks.py, Llama 3.2 Vision with each example's cross-attention its own: vision_cross.py;
    an example without an image in the row too), and the check can fail (the second example run after the first without
    restarting positions differs)."""
    from transformers import AutoConfig

    from trainer.model.vision_packing import verdict

    vocabs = {"qwen2_vl": 151669, "qwen2_5_vl": 151669, "gemma3": 262145, "llava": 32002, "idefics3": 128296,
              "mllama": 128257}  # fmt: skip
    for family in VISION_FAMILIES:
        vocab = vocabs[family]
        fields = model_config(family, vocab)
        got = verdict(AutoConfig.for_model(fields.pop("model_type"), **fields), attn)
        print(family, got["why"])
        assert got["packs"] and got["loss"] < 1e-6 and got["grads"] < 1e-5 and got["crossed"] > 0.1, got


def test_review_an_image_the_template_drops_is_refused_not_shifted(root, tmp_path):
    """Review finding 1: Gemma 3's template renders a system message's first text part only; an image there was
    dropped and the user's image slot trained on the system image's pixels (exit 0). Refused now (file:line), as
    the maker's processor refuses it; Qwen2-VL renders it and trains both."""
    shapes_data(tmp_path / "shapes.jsonl", rows=9)
    row = {"messages": [{"role": "system", "content": [{"type": "text", "text": "Reference:"},
                                                       {"type": "image", "path": "pictures/red-square.png"}]},
                        {"role": "user", "content": [{"type": "image", "path": "pictures/blue-circle.png"},
                                                     {"type": "text", "text": "Same?"}]},
                        {"role": "assistant", "content": "No."}]}  # fmt: skip
    path = one_row(tmp_path / "system.jsonl", row)
    with pytest.raises(
        UserError,
        match=r"system.jsonl:1: the chat template placed 1 image tokens for the row.s 2 images; move the image to a user message",
    ):
        rows_of(processor_dir("gemma3", root), path)
    assert rows_of(processor_dir("qwen2_vl", root), path)[1]["vision"]["images"] == 2


def test_review_bare_base64_images_of_any_length_are_read(root, tmp_path):
    """Review finding 2: a bare base64 JPEG (it starts with '/9j/') or a short PNG was read as a path."""
    import base64
    import io

    d = processor_dir("qwen2_vl", root)
    for fmt, size in (("JPEG", 56), ("PNG", 8)):
        buf = io.BytesIO()
        draw("square", "red", size=size).save(buf, format=fmt)
        b64 = base64.b64encode(buf.getvalue()).decode()
        row = {"messages": [{"role": "user", "content": "<image>What?"}, {"role": "assistant", "content": "A square."}],
               "images": [b64]}  # fmt: skip
        assert rows_of(d, one_row(tmp_path / f"{fmt}.jsonl", row))[1]["vision"]["images"] == 1, fmt


def test_review_placeholders_without_images_are_refused_for_a_vision_model(root, tmp_path):
    """Review finding 3: <image> in the text with no images column (another column name, or images_field unset)
    trained the placeholder as text and no image (exit 0). With a vision-language processor it is refused."""
    d = processor_dir("qwen2_vl", root)
    row = {"messages": [{"role": "user", "content": "<image>What is this?"}, {"role": "assistant", "content": "A square."}],
           "pictures": ["pictures/red-square.png"]}  # fmt: skip
    shapes_data(tmp_path / "shapes.jsonl", rows=1)
    with pytest.raises(
        UserError, match=r"other.jsonl:1: 1 <image> placeholder\(s\) in the messages but no images"
    ):
        rows_of(d, one_row(tmp_path / "other.jsonl", row))
    assert (
        rows_of(d, tmp_path / "other.jsonl", **{"data.train.images_field": "pictures"})[1]["vision"]["images"]
        == 1
    )


def test_review_a_decompression_bomb_is_refused_with_the_line(root, tmp_path):
    """Review finding 7: an image over PIL's decompression-bomb limit raised a traceback."""
    from PIL import Image

    Image.new("1", (14000, 14000)).save(tmp_path / "huge.png")
    row = {"messages": [{"role": "user", "content": "<image>What?"}, {"role": "assistant", "content": "x"}],
           "images": ["huge.png"]}  # fmt: skip
    with pytest.raises(UserError, match=r"huge.jsonl:1: image 0 has 196,000,000 pixels, more than PIL opens"):
        rows_of(
            processor_dir("qwen2_vl", root),
            one_row(tmp_path / "huge.jsonl", row),
            **{"data.image_max_pixels": 4096},
        )


def test_review_image_min_pixels_above_max_is_refused():
    """Review finding 6: min above max was accepted (min won: 3x the image tokens the max allowed)."""
    from trainer.common.errors import ConfigError

    with pytest.raises(
        ConfigError, match=r"data.image_min_pixels: 100000 is above data.image_max_pixels \(1000\)"
    ):
        config.load(TINY, ["data.image_min_pixels=100000", "data.image_max_pixels=1000"])


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_preview_says_where_each_images_tokens_stand(root, tmp_path, family):
    """--preview-data's line for an example with two images: each image once, its tokens and where they stand
    (Idefics3's tiles and global view one image: "in 5 tiles"; before, each tile was an image)."""
    from types import SimpleNamespace

    from trainer.data.preview import _images, examples_of

    d = processor_dir(family, root)
    shapes_data(tmp_path / "shapes.jsonl", rows=1)
    row = {"messages": [{"role": "user", "content": "<image>What is this? And this: <image>"},
                        {"role": "assistant", "content": "A red square twice."}],
           "images": ["pictures/red-square.png", "pictures/red-square.png"]}  # fmt: skip
    rows, stats = rows_of(
        d, one_row(tmp_path / "two.jsonl", row), **{"data.seq_len": 256, "data.max_images": 2}
    )
    data = SimpleNamespace(vision=stats["vision"], tokenizer=load_tokenizer(str(d)))
    (line,) = _images(examples_of(rows[0])[0], data)
    print(family, line)
    assert line.startswith("images: image 0: ") and "; image 1: " in line and "image 2" not in line
    per_image = stats["vision"]["image_tokens"] // 2
    assert line.endswith("(never targets)") and ("in 5 tiles" in line) == (family == "idefics3")
    assert per_image >= int(line.split("image 0: ")[1].split(" tokens")[0]) > 0
