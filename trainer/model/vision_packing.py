"""data.packing for a vision-language model, checked as trainer/model/packing.py checks a text family: a small
model of the family (the run's config with its text model shrunk as packing.shrunk shrinks one, a one-layer vision
tower) trains on one packed row of three examples, two with an image and one without, through the inputs the engine gives it
(trainer/model/vision.py `Inputs`: each example's own multimodal positions); the loss and gradients must equal
those of the two examples run one by one, and the second example's logits after the first without restarting
positions must differ (the check can fail)."""

from __future__ import annotations

import copy
from typing import Any

from trainer.model.packing import VOCAB, shrunk
from trainer.model.packing import verdict as packing_verdict

# token ids of the small model's image tokens (at the end of its vocabulary; the text's are drawn below them)
IMAGE, START, END = VOCAB - 1, VOCAB - 2, VOCAB - 3


def _small(config: Any) -> Any:
    cfg = copy.deepcopy(config)
    cfg.text_config = shrunk(cfg.text_config)
    rope = getattr(cfg.text_config, "rope_parameters", None)
    if isinstance(rope, dict) and rope.get("mrope_section"):  # its sections sum to half the shrunk head (16)
        rope["mrope_section"] = [2, 3, 3]
    v = cfg.vision_config
    for name, value in (("depth", 1), ("num_hidden_layers", 1), ("embed_dim", 16), ("num_heads", 2),
                        ("num_attention_heads", 2), ("intermediate_size", 32)):  # fmt: skip
        if isinstance(getattr(v, name, None), int):
            setattr(v, name, value)
    if cfg.model_type == "gemma3":
        v.hidden_size, v.image_size, v.patch_size, cfg.mm_tokens_per_image = 16, 28, 14, 4
        cfg.image_token_index, cfg.boi_token_index, cfg.eoi_token_index = IMAGE, START, END
    elif cfg.model_type == "idefics3":  # a 28 x 28 tile of 4 patches, shuffled 2 x 2 into one token
        v.hidden_size, v.image_size, v.patch_size, cfg.scale_factor, cfg.image_token_id = 16, 28, 14, 2, IMAGE
    elif cfg.model_type == "mllama":  # 28 x 28 tiles, 2 an image, one cross-attention layer in the text's
        for name, value in (("num_global_layers", 1), ("image_size", 28), ("patch_size", 14), ("max_num_tiles", 2),
                            ("supported_aspect_ratios", [[1, 1], [1, 2], [2, 1]]), ("vision_output_dim", 32),
                            ("intermediate_layers_indices", [0]), ("hidden_size", 16)):  # fmt: skip
            setattr(v, name, value)
        layers = cfg.text_config.num_hidden_layers
        cfg.text_config.cross_attention_layers = [
            i for i in cfg.text_config.cross_attention_layers if i < layers
        ] or [1]
        cfg.image_token_index = IMAGE
    elif cfg.model_type == "llava":  # a 28 x 28 image of 4 patches (the class token dropped: 4 tokens)
        v.hidden_size, v.image_size, v.patch_size, v.projection_dim = 16, 28, 14, 16
        cfg.image_token_index, cfg.vision_feature_layer = IMAGE, -1
        cfg.vision_feature_select_strategy = "default"
    elif hasattr(v, "out_hidden_size"):  # Qwen2.5-VL: the tower's own width, its merger's output the text's
        v.hidden_size, v.out_hidden_size = 16, cfg.text_config.hidden_size
        cfg.image_token_id, cfg.vision_start_token_id, cfg.video_token_id = IMAGE, START, END
    else:  # Qwen2-VL: hidden_size is the merger's output
        v.hidden_size = cfg.text_config.hidden_size
        cfg.image_token_id, cfg.vision_start_token_id, cfg.video_token_id = IMAGE, START, END
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(cfg, name, None), int) and getattr(cfg, name) >= VOCAB:
            setattr(cfg, name, 0)
    return cfg


def _image(cfg: Any) -> tuple[dict[str, Any], int]:
    """A random image's tensors for the small model, and the tokens it takes."""
    import torch

    v = cfg.vision_config
    if cfg.model_type == "gemma3":
        return {"pixel_values": torch.randn(1, 3, v.image_size, v.image_size)}, cfg.mm_tokens_per_image
    if cfg.model_type == "llava":
        side = v.image_size // v.patch_size
        return {"pixel_values": torch.randn(1, 3, v.image_size, v.image_size)}, side * side
    if cfg.model_type == "mllama":  # an image of two tiles (aspect ratio 1 x 2): 1 token
        return {"pixel_values": torch.randn(1, 2, 3, 28, 28), "aspect_ratio_ids": torch.tensor([2]),
                "aspect_ratio_mask": torch.ones(1, 2, dtype=torch.long)}, 1  # fmt: skip
    if cfg.model_type == "idefics3":  # two tiles (a split image's one and its global view): 2 tokens
        side = v.image_size
        return {"pixel_values": torch.randn(2, 3, side, side),
                "pixel_attention_mask": torch.ones(2, side, side, dtype=torch.bool)}, 2  # fmt: skip
    m = v.spatial_merge_size
    dim = 3 * v.temporal_patch_size * v.patch_size**2
    return {
        "pixel_values": torch.randn(4 * m * m, dim),
        "image_grid_thw": torch.tensor([[1, 2 * m, 2 * m]]),
    }, 4


def measure(config: Any, attn: str | None) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForImageTextToText

    from trainer.model.vision import Inputs, family

    torch.manual_seed(0)
    cfg = _small(config)
    kwargs = {"attn_implementation": attn} if attn else {}
    model = AutoModelForImageTextToText.from_config(cfg, **kwargs).float().train()
    with torch.no_grad():  # Llama 3.2 Vision's cross-attention gates open (at 0, those layers change nothing)
        for name, p in model.named_parameters():
            if name.endswith("_gate"):
                p.fill_(0.5)
    g = torch.Generator().manual_seed(0)
    examples = []
    for before, after, image in ((3, 6, True), (2, 5, True), (4, 3, False)):  # the last one without an image
        pixels, n = _image(cfg) if image else ({}, 0)
        ids = torch.randint(3, END, (before,), generator=g).tolist()
        ids += [START] + [IMAGE] * n + [END] if image else []
        ids += torch.randint(3, END, (after,), generator=g).tolist()
        prompt = before + n + 2 if image else before
        examples.append((ids, [-100] * prompt + ids[prompt:], pixels))
    fam = family(cfg.model_type)
    types = {} if fam.cross else {"mm_token_type_ids": IMAGE} if fam.mrope else {"token_type_ids": IMAGE}
    inputs = Inputs(model, fam, types, None, IMAGE)
    inputs.install()  # (Llama 3.2 Vision: the cross-attention layers skipped at an example without an image)

    def run(parts: list[Any], restart: bool = True) -> Any:
        ids = torch.tensor([sum((p[0] for p in parts), [])])
        labels = torch.tensor([sum((p[1] for p in parts), [])])
        pos = torch.tensor([sum((list(range(len(p[0]))) for p in parts), [])]) if restart else None
        if pos is None:
            pos = torch.arange(ids.shape[1])[None]
        images = {
            k: torch.cat([p[2][k] for p in parts if p[2]]) for k in examples[0][2] if any(p[2] for p in parts)
        }
        kw = inputs.kwargs(torch.stack([ids, labels, pos], dim=1), images)
        # the rows' positions, as the engine gives them (multimodal RoPE: its own)
        kw.setdefault("position_ids", pos)
        return model(input_ids=ids, labels=labels, use_cache=False, **kw)

    def grads() -> Any:
        out = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        model.zero_grad()
        return out

    packed = run(examples).loss
    packed.backward()
    g_packed = grads()
    counts = [sum(x != -100 for x in e[1][1:]) for e in examples]
    alone = sum(run([e]).loss * n for e, n in zip(examples, counts, strict=True)) / sum(counts)
    alone.backward()
    g_alone = grads()
    with torch.no_grad():
        second = run([examples[1]]).logits[0]
        crossed = run(examples[:2], restart=False).logits[0, len(examples[0][0]) :]
    return {
        "kernel": getattr(model.config, "_attn_implementation", attn),
        "loss": abs(packed.item() - alone.item()) / abs(alone.item()),
        "grads": ((g_packed - g_alone).abs().max() / g_alone.abs().max()).item(),
        "crossed": ((crossed - second).abs().max() / second.abs().max()).item(),
    }


# the packing check's, in its cache's key: 3 packs an example without an image too (2: two with; 1 measured without
# the rows' positions)
VERSION = 3


def verdict(config: Any, attn: str | None, cache_dir: Any = None) -> dict[str, Any]:
    """{"packs", "why", the differences} for a vision-language family (see the module docstring): judged and
    cached as packing.verdict judges and caches a text family's."""
    text = config.get_text_config()
    window, block = getattr(text, "sliding_window", None), getattr(config, "mm_tokens_per_image", None)
    if (
        config.model_type == "gemma3" and window and block and block > window
    ):  # vision_masks.py mends no such block
        return {"packs": False, "why": f"model type 'gemma3' with images: an image's {block} tokens attend to each "
                f"other both ways across more than the sliding window ({window}), where packed rows' masks are "
                "not mended (trainer/model/vision_masks.py)"}  # fmt: skip
    return packing_verdict(config, attn, cache_dir, measure_fn=measure, label="with images", version=VERSION)
