"""Vision-language models (trainer/model/vision.py): what trains (model.freeze, LoRA on the language model only,
QLoRA leaving the vision tower unquantized, each counted by the plan as built), the families refused with the reason,
and the data cache keyed by the processor's settings and the image files."""

import json
import os

import pytest
import torch
from helpers import TINY, yaml_value

from tests.vision_helpers import VISION_FAMILIES, model_config, processor_dir, shapes_data
from trainer import config, model
from trainer.common.errors import UserError
from trainer.model import vision

VOCAB = {
    "qwen2_vl": 151669,
    "qwen2_5_vl": 151669,
    "gemma3": 262145,
    "llava": 32002,
    "idefics3": 128296,
    "mllama": 128257,
}


def experiment(family, **kw):
    sets = {"model.config": model_config(family, VOCAB[family]), "train.eval_every": 0, **kw}
    return config.load(TINY, [f"{k}={yaml_value(v)}" for k, v in sets.items()])


def trained(module):
    return {n for n, p in module.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_the_vision_tower_is_frozen_by_default_and_freeze_names_the_parts(family):
    fam = vision.family(family)
    built = model.build(experiment(family).model, vocab_size=None, eos_id=None, seq_len=64)
    names = trained(built)
    tower = [n for n in names if n.startswith(fam.vision_tower) and not n.startswith(fam.projector)]
    assert not tower and any(n.startswith(fam.projector) for n in names)
    assert any(n.startswith(fam.language_model) for n in names)
    info = model.info(experiment(family).model)
    assert info.trainable == sum(p.numel() for n, p in built.named_parameters() if p.requires_grad)
    only_text = model.build(experiment(family, **{"model.freeze": ["vision_tower", "projector"]}).model,
                            vocab_size=None, eos_id=None, seq_len=64)  # fmt: skip
    assert all(n.startswith(fam.language_model) for n in trained(only_text))


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_lora_adapts_the_language_model_only_and_qlora_leaves_the_vision_tower_unquantized(family, tmp_path):
    from transformers import AutoConfig

    fam = vision.family(family)
    fields = model_config(family, VOCAB[family])
    AutoConfig.for_model(fields.pop("model_type"), **fields).save_pretrained(
        tmp_path
    )  # its config.json: counted
    built = model.build(experiment(family, **{"model.lora": {"r": 4}}).model, vocab_size=None, eos_id=None,
                        seq_len=64)  # fmt: skip
    adapters = [n for n, _ in built.named_parameters() if ".lora_" in n]
    assert adapters and not any(
        f".{p.rstrip('.')}." in n for n in adapters for p in fam.vision_tower + fam.projector
    )
    qlora = {
        "model.config": None,
        "model.pretrained": str(tmp_path),
        "model.lora": {"r": 4, "quantization": "4bit"},
    }
    info = model.info(config.load(TINY, [f"{k}={yaml_value(v)}" for k, v in qlora.items()]).model)
    # the language model's 2 layers x 7 projections (Llama 3.2 Vision's cross-attention layer's 7 too); not the tower's
    assert len(info.quantized.sizes) == (21 if family == "mllama" else 14)
    assert vision.unquantized(family)[-1] == "lm_head"


def test_unverified_vision_language_models_and_images_for_a_text_model_are_refused():
    with pytest.raises(UserError, match=r"Qwen3-VL \(qwen3_vl\) is a vision-language model"):
        vision.check("qwen3_vl", True)
    with pytest.raises(
        UserError,
        match=r"SmolVLM \(smolvlm\) .* the verified ones are Qwen2-VL, Qwen2.5-VL, Gemma 3, Idefics3, LLaVA, Llama 3.2 Vision",
    ):
        vision.check("smolvlm", False)
    with pytest.raises(
        UserError, match=r"the training data has images but the model \(llama\) is a text model"
    ):
        vision.check("llama", True)
    assert vision.check("llama", False) is None and vision.check("gemma3", True).name == "Gemma 3"
    with pytest.raises(
        UserError, match=r"model.freeze: \['vision_tower'\] names parts of a vision-language model"
    ):
        model.build(
            config.load(TINY, ["model.freeze=[vision_tower]"]).model, vocab_size=None, eos_id=None, seq_len=64
        )


def test_the_cache_keys_the_processor_and_rebuilds_when_an_image_file_changes(tmp_path):
    """Another processor setting (its image size bounds) is another key; an image file edited after the cache was
    built makes it again, saying which file."""
    import shutil

    from trainer.data import build
    from trainer.data.keys import cache_key
    from trainer.data.tokenizer import load_tokenizer

    proc = shutil.copytree(processor_dir("qwen2_vl", tmp_path / "made"), tmp_path / "proc")
    data = shapes_data(tmp_path / "shapes.jsonl", rows=3)
    sets = {"data.tokenizer": str(proc), "data.train.files": str(data), "data.train.kind": "chat",
            "data.eval_fraction": 0, "train.eval_every": 0, "data.cache_dir": str(tmp_path / "cache")}  # fmt: skip
    section = config.load(TINY, [f"{k}={yaml_value(v)}" for k, v in sets.items()]).data
    before = json.dumps(cache_key(section, load_tokenizer(str(proc))), sort_keys=True)
    path = proc / "preprocessor_config.json"
    cfg = json.loads(path.read_text())
    path.write_text(json.dumps({**cfg, "size": {**cfg["size"], "longest_edge": 28 * 28 * 4}}))
    assert json.dumps(cache_key(section, load_tokenizer(str(proc))), sort_keys=True) != before
    first = build(section, seed=0)
    assert first.built and build(section, seed=0).built is False
    assert first.images is not None and first.idle_image is not None
    picture = tmp_path / "pictures" / "red-square.png"
    from tests.vision_helpers import draw

    draw("circle", "red").save(picture)
    st = picture.stat()
    os.utime(picture, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    again = build(section, seed=0)
    assert again.built and again.rebuilt == f"the image file {picture.resolve()} changed"
    assert not torch.equal(torch.from_numpy(first.images.batch([0])["pixel_values"]),
                           torch.from_numpy(again.images.batch([0])["pixel_values"]))  # fmt: skip


def test_review_freezing_everything_or_freeze_with_lora_is_refused():
    """Review findings 4 and 5: freezing every part crashed in DeepSpeed's backward (no loss to train) after the run
    directory was written; model.freeze beside model.lora was ignored (peft trains its adapters only)."""
    from trainer.common.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model.freeze: every part of the model is frozen"):
        experiment("qwen2_vl", **{"model.freeze": ["vision_tower", "projector", "language_model"]})
    with pytest.raises(ConfigError, match=r"model.freeze: LoRA trains its adapters only"):
        experiment("qwen2_vl", **{"model.freeze": ["language_model"], "model.lora": {"r": 4}})


def test_review_a_resume_on_other_pixels_is_refused_and_a_damaged_image_cache_is_made_again(tmp_path):
    """Review finding 8: an image redrawn after a checkpoint resumed on other pixels (the rows' ids are the same);
    the fingerprint now holds the images' digest. Finding 9: a truncated or missing vision-*.npy crashed (or trained
    without images); such a cache is made again."""
    from tests.vision_helpers import draw
    from trainer.data import build, data_changes

    data = shapes_data(tmp_path / "shapes.jsonl", rows=3)
    sets = {"data.tokenizer": str(processor_dir("qwen2_vl", tmp_path / "made")), "data.train.files": str(data),
            "data.train.kind": "chat", "data.eval_fraction": 0, "train.eval_every": 0,
            "data.cache_dir": str(tmp_path / "cache")}  # fmt: skip
    section = config.load(TINY, [f"{k}={yaml_value(v)}" for k, v in sets.items()]).data
    first = build(section, seed=0)
    picture = tmp_path / "pictures" / "red-square.png"
    draw("square", "blue").save(picture)
    again = build(section, seed=0)
    assert again.fingerprint["train_digest"] == first.fingerprint["train_digest"]  # the same ids
    assert "the images' pixels differ" in " ".join(data_changes(first.fingerprint, again.fingerprint))
    cache = tmp_path / "cache" / again.cache_path.split("/")[-1]
    pixels = cache / "vision-train-pixel_values.npy"
    pixels.write_bytes(pixels.read_bytes()[:-100])
    fixed = build(section, seed=0)
    assert fixed.built and "damaged" in fixed.rebuilt and fixed.fingerprint == again.fingerprint
    (cache / "vision-train-image_grid_thw.npy").unlink()
    assert build(section, seed=0).built


def test_gemma3s_sliding_masks_of_packed_rows_with_images_are_the_examples_own():
    """transformers 5.24's Gemma 3 gives its sliding layers the image blocks as an or_mask_function that the packed
    rows' remapping calls with positions within each example: a packed second example's image tokens attend as the
    first example's blocks say (its logits differ from the example alone, shown). With the wrapper
    (trainer/model/vision_masks.py) a packed row's logits are each example's alone; rows that are not packed get
    transformers' own masks, equal."""
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.models.gemma3 import modeling_gemma3

    from trainer.model.vision_masks import install
    from trainer.model.vision_packing import END, IMAGE, START, _image, _small

    fields = model_config("gemma3", VOCAB["gemma3"])
    cfg = _small(AutoConfig.for_model(fields.pop("model_type"), **fields))
    torch.manual_seed(0)
    m = AutoModelForImageTextToText.from_config(cfg, attn_implementation="sdpa").eval()
    g = torch.Generator().manual_seed(0)
    examples = []
    for before, after in ((3, 6), (2, 5)):
        pixels, n = _image(cfg)
        ids = torch.randint(3, END, (before,), generator=g).tolist() + [START] + [IMAGE] * n + [END]
        examples.append((ids + torch.randint(3, END, (after,), generator=g).tolist(), pixels["pixel_values"]))

    def logits(parts):
        ids = torch.tensor([sum((p[0] for p in parts), [])])
        pos = torch.tensor([sum((list(range(len(p[0]))) for p in parts), [])])
        with torch.no_grad():
            return m(input_ids=ids, position_ids=pos, token_type_ids=(ids == IMAGE).long(), use_cache=False,
                     pixel_values=torch.cat([p[1] for p in parts])).logits[0]  # fmt: skip

    install()
    fixed = modeling_gemma3.create_masks_for_vision_model
    split = len(examples[0][0])
    alone = logits([examples[1]])
    modeling_gemma3.create_masks_for_vision_model = fixed.original  # transformers' own
    try:
        broken = (logits(examples)[split:] - alone).abs().max().item()
    finally:
        modeling_gemma3.create_masks_for_vision_model = fixed
    packed = (logits(examples)[split:] - alone).abs().max().item()
    print(
        f"a packed example's logits against alone: {broken:.3f} with transformers' masks, {packed:.1e} fixed"
    )
    assert broken > 1e-2 and packed < 1e-5
    # not packed: transformers' masks, unchanged
    ids = torch.tensor([examples[0][0] + examples[1][0]])
    blocks = modeling_gemma3.get_block_sequence_ids_for_mask((ids == IMAGE).long())
    embeds = torch.zeros(1, ids.shape[1], cfg.text_config.hidden_size)
    pos = torch.arange(ids.shape[1])[None]
    a = fixed(cfg.text_config, embeds, None, None, pos, blocks)
    b = fixed.original(cfg.text_config, embeds, None, None, pos, blocks)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_review_gemma3_images_longer_than_the_window_are_not_packed():
    """Review finding: with an image's tokens more than the sliding window (16 against 8) a packed row's logits
    differed from the examples alone by 1.34 while the packing check passed (its small model has 4 tokens an image
    and a window of 6): the check now refuses packing images for such a config, with the reason."""
    from transformers import AutoConfig

    from trainer.model.vision_packing import verdict

    fields = model_config("gemma3", VOCAB["gemma3"])
    fields["mm_tokens_per_image"], fields["text_config"]["sliding_window"] = 16, 8
    got = verdict(AutoConfig.for_model(fields.pop("model_type"), **fields), "sdpa")
    assert not got["packs"] and "16 tokens attend to each other both ways" in got["why"], got
