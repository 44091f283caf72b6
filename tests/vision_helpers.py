"""Vision-language fixtures: a processor directory per family as a model's hub directory holds it (the published
tokenizer and chat template, the family's real processor classes with small images), a tiny model config of the
family, and chat data with images of shapes (drawn here, PNG files beside the JSONL)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.helpers import tokenizer_dir

TRL_TEMPLATES = "trl/chat_templates"
VISION_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "gemma3", "llava", "idefics3", "mllama")
# Llama-3.2-11B-Vision-Instruct's chat template (its tokenizer_config.json): images as <|image|>, none with a system
# message, the system header (with the date) only without images
LLAMA_VISION_TEMPLATE = (Path(__file__).resolve().parent / "templates" / "llama3_2_vision.jinja").read_text()
# Idefics3-8B-Llama3's tokens beside Llama 3's: the image's frame, its token, the end of a turn, the global view and
# each tile's place (HuggingFaceM4's tokenizer adds them; the processor inserts them)
IDEFICS3_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)
]
# llava-hf/llava-1.5-7b-hf's chat template (its chat_template.json; transformers' own LLaVA tests carry it): images
# first, then the text, the assistant's in generation markers, no end-of-turn token
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}{% for content in "
    "message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}{% endfor %}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{% generation %}"
    "{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ 'ASSISTANT:' }}{% endif %}"
)


def _script() -> Any:
    """scripts/make_tiny_vlm.py (the example's images and rows), imported by path."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "scripts" / "make_tiny_vlm.py"
    spec = importlib.util.spec_from_file_location("make_tiny_vlm", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY_VLM = _script()
SHAPES, COLOURS, draw = TINY_VLM.SHAPES, TINY_VLM.COLOURS, TINY_VLM.draw


def _trl_template(name: str) -> str:
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()


def processor_dir(family: str, root: Path) -> Path:
    """The family's processor files in `root/<family>-processor` (made once): Qwen2-VL's image processor (28 x 28
    patches merged 2 x 2, at most 16 merged tokens an image) with Qwen3's tokenizer (it holds Qwen-VL's vision
    tokens) and the published Qwen2.5-VL template (TRL's wheel ships it), saved as the hub has it (processor_class
    Qwen2VLProcessor, no video processor: torchvision is not installed); Gemma 3's processor (28 x 28 images, 4
    tokens an image) with the published Gemma 3 tokenizer and template; LLaVA-1.5's (CLIP's 28 x 28 images of 4
    patches, the class token dropped) with the published Llama 2 tokenizer, <image> and <pad> added as llava-hf's
    are, and llava-1.5-hf's template; Idefics3's (56 px images split into 28 x 28 tiles and a global view, 1 token a
    tile) with the published Llama 3 tokenizer (Llama 3.2's), Idefics3's tokens added, and Idefics3-8B-Llama3's
    template (TRL's wheel ships it)."""
    out = root / f"{family}-processor"
    if (out / "tokenizer.json").is_file():
        return out
    from transformers import AutoTokenizer

    if family in ("qwen2_vl", "qwen2_5_vl"):  # Qwen2.5-VL: the same image processor, its own processor class
        from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

        tok = AutoTokenizer.from_pretrained(tokenizer_dir("qwen3"))
        ip = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28 * 16)
        out.mkdir(parents=True)
        tok.save_pretrained(out)
        ip.save_pretrained(out)
        (out / "chat_template.jinja").write_text(_trl_template("qwen2_5_vl"))
        cfg = json.loads((out / "preprocessor_config.json").read_text())
        (out / "preprocessor_config.json").write_text(
            json.dumps(
                {
                    **cfg,
                    "processor_class": "Qwen2VLProcessor" if family == "qwen2_vl" else "Qwen2_5_VLProcessor",
                }
            )
        )
        return out
    if family == "idefics3":  # images up to 56 px split into 28 x 28 tiles and a global view: 1 token a tile
        from transformers.models.idefics3 import Idefics3ImageProcessorPil, Idefics3Processor

        tok = AutoTokenizer.from_pretrained(tokenizer_dir("llama3_2"))
        tok.add_special_tokens({"additional_special_tokens": IDEFICS3_TOKENS})
        tok.pad_token = "<|finetune_right_pad_id|>"  # Llama 3.2's own (TRL's collator pads)
        ip = Idefics3ImageProcessorPil(size={"longest_edge": 56}, max_image_size={"longest_edge": 28})
        Idefics3Processor(image_processor=ip, tokenizer=tok, image_seq_len=1,
                          chat_template=_trl_template("idefics3")).save_pretrained(out)  # fmt: skip
        return out
    if family == "mllama":  # 28 x 28 tiles, at most 2 an image; <|image|> 128256 as Meta's tokenizer has it
        from transformers.models.mllama import MllamaImageProcessorPil, MllamaProcessor

        tok = AutoTokenizer.from_pretrained(tokenizer_dir("llama3_2"))
        tok.add_special_tokens({"additional_special_tokens": ["<|image|>"]})
        tok.pad_token = "<|finetune_right_pad_id|>"
        ip = MllamaImageProcessorPil(size={"height": 28, "width": 28}, max_image_tiles=2)
        MllamaProcessor(image_processor=ip, tokenizer=tok,
                        chat_template=LLAMA_VISION_TEMPLATE).save_pretrained(out)  # fmt: skip
        return out
    if family == "llava":
        from transformers.models.clip import CLIPImageProcessorPil
        from transformers.models.llava import LlavaProcessor

        tok = AutoTokenizer.from_pretrained(tokenizer_dir("llama2"))
        tok.add_tokens(
            ["<image>"], special_tokens=True
        )  # as llava-hf's tokenizer: <image> 32000, <pad> 32001
        tok.add_special_tokens({"pad_token": "<pad>"})
        ip = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
        LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
                       num_additional_image_tokens=1, chat_template=LLAVA_TEMPLATE).save_pretrained(out)  # fmt: skip
        return out
    from transformers.models.gemma3 import Gemma3ImageProcessorPil, Gemma3Processor

    tok = AutoTokenizer.from_pretrained(tokenizer_dir("gemma3"))
    ip = Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
    Gemma3Processor(
        image_processor=ip, tokenizer=tok, chat_template=tok.chat_template, image_seq_length=4
    ).save_pretrained(out)
    return out


def model_config(family: str, vocab: int, **kw: Any) -> dict[str, Any]:
    """A tiny model of the family (text 2 layers of 32; a 1-layer vision tower)."""
    text = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": vocab, "max_position_embeddings": 1024}  # fmt: skip
    if family in ("qwen2_vl", "qwen2_5_vl"):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_dir("qwen3"))
        text["rope_scaling"] = {"type": "mrope", "mrope_section": [1, 1, 2]}
        tower = (
            {
                "depth": 1,
                "embed_dim": 16,
                "hidden_size": 32,
                "num_heads": 2,
                "mlp_ratio": 2,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
            }
            if family == "qwen2_vl"
            else {
                "depth": 2,
                "hidden_size": 16,
                "out_hidden_size": 32,
                "intermediate_size": 32,
                "num_heads": 2,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "window_size": 56,
                "fullatt_block_indexes": [1],
            }
        )  # Qwen2.5-VL: a windowed layer (4 x 4 patches) and a full one
        return {"model_type": family, "text_config": text, **kw, "vision_config": tower,
                "image_token_id": tok.convert_tokens_to_ids("<|image_pad|>"),
                "video_token_id": tok.convert_tokens_to_ids("<|video_pad|>"),
                "vision_start_token_id": tok.convert_tokens_to_ids("<|vision_start|>")}  # fmt: skip
    if (
        family == "idefics3"
    ):  # a SigLIP-like tower on 28 x 28 tiles (4 patches shuffled 2 x 2: 1 token) and a Llama
        return {"model_type": "idefics3", **kw, "image_token_id": 128257, "scale_factor": 2,
                "text_config": {**text, "model_type": "llama"},
                "vision_config": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                                  "num_attention_heads": 2, "image_size": 28, "patch_size": 14}}  # fmt: skip
    if (
        family == "mllama"
    ):  # a tower of 28 x 28 tiles (4 patches and a class token), one cross-attention layer
        return {"model_type": "mllama", **kw, "image_token_index": 128256,
                "text_config": {**text, "num_hidden_layers": 3, "cross_attention_layers": [1], "pad_token_id": 128004,
                                "vocab_size": 128256},
                "vision_config": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                                  "num_global_layers": 1, "attention_heads": 2, "image_size": 28, "patch_size": 14,
                                  "max_num_tiles": 2, "supported_aspect_ratios": [[1, 1], [1, 2], [2, 1]],
                                  "intermediate_layers_indices": [0], "vision_output_dim": 32}}  # fmt: skip
    if family == "llava":  # a CLIP tower (28 x 28 images of 4 patches: 4 tokens) and a Llama
        return {"model_type": "llava", **kw, "image_token_index": 32000, "vision_feature_layer": -1,
                "text_config": {**text, "model_type": "llama", "pad_token_id": 32001},
                "vision_config": {"model_type": "clip_vision_model", "hidden_size": 16, "intermediate_size": 32,
                                  "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28,
                                  "patch_size": 14, "projection_dim": 16}}  # fmt: skip
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir("gemma3"))
    return {"model_type": "gemma3", **kw, "mm_tokens_per_image": 4,
            "text_config": {**text, "head_dim": 8, "sliding_window": 64},
            "vision_config": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                              "num_attention_heads": 2, "image_size": 28, "patch_size": 14},
            "image_token_index": tok.convert_tokens_to_ids("<image_soft_token>"),
            "boi_token_index": tok.convert_tokens_to_ids("<start_of_image>"),
            "eoi_token_index": tok.convert_tokens_to_ids("<end_of_image>")}  # fmt: skip


def opened(model: Any) -> Any:
    """Llama 3.2 Vision's cross-attention gates opened (transformers initialises them to 0, where those layers
    change nothing; Meta's are trained): what a test of the image's path must see. Other families as they are."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("cross_attn_attn_gate", "cross_attn_mlp_gate")):
                p.fill_(0.5)
    return model


def shapes_data(path: Path, rows: int = 24, forms: tuple[str, ...] = ("parts", "images", "image"),
                text_rows: int = 0, alternate: bool = False) -> Path:  # fmt: skip
    """Chat rows asking what an image shows, in each form (content parts with a relative path, an `images` column
    with <image>, a single `image` column), and `text_rows` rows without an image: after them, or (`alternate`)
    one after each row with an image."""
    folder = path.parent / "pictures"
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(rows):
        shape, colour = SHAPES[i % 3], list(COLOURS)[(i // 3) % 3]
        name = f"{colour}-{shape}.png"
        if not (folder / name).exists():
            draw(shape, colour).save(folder / name)
        out.append(TINY_VLM.row(forms[i % len(forms)], f"pictures/{name}", f"A {colour} {shape}."))
    texts = []
    for i in range(text_rows):
        word = ("one", "two", "three", "four")[i % 4]
        texts.append({"messages": [{"role": "user", "content": f"Say {word}."},
                                   {"role": "assistant", "content": f"I say {word}."}]})  # fmt: skip
    if alternate:
        out = (
            [r for pair in zip(out, texts, strict=False) for r in pair]
            + out[len(texts) :]
            + texts[len(out) :]
        )
    else:
        out += texts
    path.write_text("".join(json.dumps(r) + "\n" for r in out))
    return path


def model_dir(family: str, root: Path, seed: int = 0) -> Path:
    """A tiny model of the family saved as a hub checkout holds it: its weights (random, seeded) beside the
    processor's files (`processor_dir`), so that model.pretrained and data.tokenizer name one directory and every
    ZeRO stage starts from the same weights."""
    out = root / f"{family}-model"
    if (out / "config.json").is_file():
        return out
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

    proc = processor_dir(family, root)
    fields = model_config(family, len(AutoTokenizer.from_pretrained(proc)))
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    tmp = root / f".{family}-model"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(proc, tmp)
    opened(AutoModelForImageTextToText.from_config(cfg)).save_pretrained(tmp)
    tmp.rename(out)
    return out
