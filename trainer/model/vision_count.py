"""The vision tower as the planner counts it (trainer/strategy/planning/images.py's `Vision`): what one of its
layers keeps for backward a patch, and its stem and projector, measured by running the model's own tower code
at its real width, one layer deep, on two small images (a second, in fp32 and bf16), with the model's freezing.

The model is built with its weights on the meta device and its buffers real (accelerate's
`init_empty_weights(include_buffers=False)`: rotary tables and position ids as the model makes them); only the
tower's and projector's parameters are made, one layer of them. What autograd keeps is counted by saved-tensor
hooks, each storage once, parameters left out (as the census, trainer/run/consistency.py's SavedActivations).
Measured with sdpa: eager attention's scores are the planner's (they grow with the square of an image's patches).
"""

from __future__ import annotations

import copy
import math
from typing import Any

from trainer.model import vision
from trainer.strategy.planning.images import Vision


def _get(cfg: Any, *names: str, default: Any = None) -> Any:
    return next((getattr(cfg, n) for n in names if getattr(cfg, n, None) is not None), default)


def measure(cfg: Any, parts: tuple[str, ...]) -> Vision | None:
    """The tower's record for a vision-language model's config (None for a text model or one not verified);
    `parts`: model.freeze's parts frozen."""
    fam = vision.family(getattr(cfg, "model_type", None))
    if fam is None:
        return None
    vc = cfg.vision_config
    depth_key = "depth" if hasattr(vc, "depth") else "num_hidden_layers"
    layers, heads = int(getattr(vc, depth_key)), int(_get(vc, "num_heads", "num_attention_heads"))
    patch, frames = int(vc.patch_size), int(_get(vc, "temporal_patch_size", default=1))
    channels = int(_get(vc, "in_channels", "num_channels", default=3))
    small = copy.deepcopy(cfg)
    setattr(small.vision_config, depth_key, 1)
    if (
        fam.cross
    ):  # Llama 3.2 Vision: its global layers too; an image is its tiles of patches and a class token
        layers += int(vc.num_global_layers)
        small.vision_config.num_global_layers = 1
        small.vision_config.intermediate_layers_indices = [0] * len(vc.intermediate_layers_indices)
        tiles, per_tile = (
            int(vc.max_num_tiles),
            -(-((int(vc.image_size) // patch) ** 2 + 1) // 8) * 8,
        )  # padded to 8
        per_token = fixed = tiles * per_tile  # one token an image
        window = full = 0
        side = (
            6  # small tiles of 6 x 6 patches and the class token, padded to 40 (as 1,601 to 1,608: few pads)
        )
        small.vision_config.image_size = side * patch
    elif fam.mrope:  # images of any size: merged tokens of merge x merge patches
        merge = int(vc.spatial_merge_size)
        per_token, fixed, side = merge * merge, 0, 2 * merge
        window = int(getattr(vc, "window_size", 0) or 0) // patch
        full = len(getattr(vc, "fullatt_block_indexes", None) or ())
    else:  # images of one size; Gemma 3's tokens the average of kernel x kernel patches, LLaVA's one a patch
        side_patches = int(vc.image_size) // patch
        tokens, shuffle = getattr(cfg, "mm_tokens_per_image", None), getattr(cfg, "scale_factor", None)
        kernel = max(1, side_patches // int(math.isqrt(int(tokens)))) if tokens else int(shuffle or 1)
        per_token, fixed, window, full = kernel * kernel, side_patches**2, 0, 0
        # LLaVA's class token a 65th of 8 x 8 patches (at 2 x 2: a quarter); Idefics3's tiles shuffled 2 x 2
        side = kernel if tokens else 8
        small.vision_config.image_size = side * patch
        if tokens:
            small.mm_tokens_per_image = 1
    trains = "vision_tower" not in parts
    measured = {}
    for lp in (2, 4):
        measured[lp] = _saved(small, fam, parts, lp, side, patch, frames, channels)
    n = 2 * (
        -(-(side * side + 1) // 8) * 8 * int(vc.max_num_tiles) if fam.cross else side * side
    )  # two images: a batch's copies (LLaVA's features without the class token) counted
    return Vision(
        family=fam.name, layers=layers, heads=heads, width=int(_get(vc, "embed_dim", "hidden_size")), patch=patch, pixel_bytes=channels * frames * patch * patch * 4,
        patches_per_token=per_token, image_patches=fixed,
        layer=(_per_layer(measured[2][0], cfg) / n, _per_layer(measured[4][0], cfg) / n),
        rest=(measured[2][1] / n, measured[4][1] / n),
        trains=trains, window_patches=window * window, full_layers=full, unit="tile" if fam.stacked else "image",
        cross=(_cross(cfg, 2), _cross(cfg, 4)) if fam.cross else (0.0, 0.0),
        cross_width=int(cfg.text_config.hidden_size) if fam.cross else 0,
        cross_heads=int(cfg.text_config.num_attention_heads) if fam.cross else 0,
        cross_layers=len(cfg.text_config.cross_attention_layers) if fam.cross else 0,
    )  # fmt: skip


def _saved(cfg: Any, fam: Any, parts: tuple[str, ...], lp: int, side: int, patch: int, frames: int,
           channels: int) -> tuple[list[int], int]:  # fmt: skip
    """(bytes each of the tower's layers keeps with every tower weight training, bytes the rest keeps as frozen) for two
    images of side x side patches."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForImageTextToText

    dtype = torch.bfloat16 if lp == 2 else torch.float32
    with init_empty_weights(include_buffers=False):
        model = AutoModelForImageTextToText.from_config(cfg, attn_implementation="sdpa", dtype=dtype)
    prefixes = fam.vision_tower + fam.projector
    gen = torch.Generator().manual_seed(0)
    for name, module in model.named_modules():
        for key, p in list(module._parameters.items()):
            full = f"{name}.{key}" if name else key
            if p is not None and full.startswith(prefixes):
                module._parameters[key] = torch.nn.Parameter(
                    (torch.randn(p.shape, generator=gen) * 0.02).to(dtype)
                )
    model.train()
    inner = model.model
    tower = next(m for n, m in model.named_modules() if f"{n}." in fam.vision_tower)
    lists = [m for m in tower.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    kind = type(max(lists, key=len)[0])  # (Llama 3.2 Vision: its one layer and its one global layer)
    layer = [each for m in lists for each in m if type(each) is kind]
    if fam.mrope:
        pixels = torch.randn(2 * side * side, channels * frames * patch * patch, generator=gen)
        inputs = {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, side, side]] * 2)}
    else:
        inputs = {"pixel_values": torch.randn(2, channels, side * patch, side * patch, generator=gen)}
    if fam.cross:  # Llama 3.2 Vision: (1, images, tiles, C, H, W), every tile real
        tiles, size = int(cfg.vision_config.max_num_tiles), side * patch
        ratio, real = _widest(cfg.vision_config.supported_aspect_ratios, tiles)
        inputs = {"pixel_values": torch.randn(1, 2, tiles, channels, size, size, generator=gen),
                  "aspect_ratio_ids": torch.tensor([[ratio, ratio]]),
                  "aspect_ratio_mask": (torch.arange(tiles) < real).long().expand(1, 2, tiles)}  # fmt: skip
    if fam.stacked:  # Idefics3: (1, tiles, C, H, W) and the pixels' mask
        size = side * patch
        inputs = {"pixel_values": inputs["pixel_values"][None],
                  "pixel_attention_mask": torch.ones(1, 2, size, size, dtype=torch.bool)}  # fmt: skip
    out = []
    for tower_trains in (True, False):
        for name, p in model.named_parameters():
            if name.startswith(prefixes) and p.device.type != "meta":
                frozen = vision.freeze_part(fam, name) in parts
                p.requires_grad_(not frozen or (tower_trains and name.startswith(fam.vision_tower)
                                                and not name.startswith(fam.projector)))  # fmt: skip
        out.append(_count(inner, layer, {"pixel_values": inputs["pixel_values"].to(dtype), **{
            k: v for k, v in inputs.items() if k != "pixel_values"}}))  # fmt: skip
    return out[0][0], out[1][1]


def _count(inner: Any, layers: list[Any], inputs: dict[str, Any]) -> tuple[list[int], int]:
    """(bytes kept inside each of the layers, bytes kept elsewhere) by get_image_features."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in inner.parameters() if p.device.type != "meta"}
    seen: dict[int, tuple[int, int]] = {}
    inside = [-1]
    handles = [h for k, layer in enumerate(layers) for h in (
        layer.register_forward_pre_hook(lambda *_, k=k: inside.__setitem__(0, k)),
        layer.register_forward_hook(lambda *_: inside.__setitem__(0, -1)))]  # fmt: skip

    def pack(t: Any) -> Any:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params and ptr not in seen:
            seen[ptr] = (inside[0], storage.nbytes())
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            image_features(inner, inputs)
    finally:
        for h in handles:
            h.remove()
    each = [sum(n for i, n in seen.values() if i == k) for k in range(len(layers))]
    return each, sum(n for i, n in seen.values() if i < 0)


def image_features(inner: Any, inputs: dict[str, Any]) -> Any:
    """The projected features of the images (the model's get_image_features; Llama 3.2 Vision, which has none:
    its vision model's output through its projector, as its forward does)."""
    if hasattr(inner, "get_image_features"):
        return inner.get_image_features(**inputs)
    return inner.multi_modal_projector(inner.vision_model(**inputs).last_hidden_state)


def _widest(ratios: Any, tiles: int) -> tuple[int, int]:
    """(the aspect ratio id, its tiles) of the supported arrangement with the most tiles within `tiles` (the
    tower runs every image as `tiles` tiles, the rest padding)."""
    sizes = [int(r[0]) * int(r[1]) for r in ratios]
    best = max((k for k, n in enumerate(sizes) if n <= tiles), key=lambda k: sizes[k])
    return best + 1, sizes[best]


def _cross(cfg: Any, lp: int) -> float:
    """Bytes one of Llama 3.2 Vision's cross-attention layers keeps for backward a patch of the images it attends
    (the keys and values made from the projected features, their norms; the features themselves, which every
    such layer keeps as one tensor, apart: Vision.cross_width): its own code at the text model's width
    (its MLP, which runs on the text's tokens only, narrowed), run on 1 text token against 8 and 16 patches."""
    import torch
    from transformers.models.mllama.modeling_mllama import MllamaCrossAttentionDecoderLayer

    text = copy.deepcopy(cfg.text_config)
    text.intermediate_size = 8
    dtype = torch.bfloat16 if lp == 2 else torch.float32
    torch.manual_seed(0)
    layer = MllamaCrossAttentionDecoderLayer(text, layer_idx=0).to(dtype).train()
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    got = []
    for patches in (8, 16):
        seen: dict[int, int] = {}

        def pack(t: Any, seen: dict[int, int] = seen) -> Any:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                seen.setdefault(ptr, t.untyped_storage().nbytes())
            return t

        x = torch.randn(1, 1, text.hidden_size, dtype=dtype, requires_grad=True)
        states = torch.randn(1, patches, text.hidden_size, dtype=dtype, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            params.add(states.untyped_storage().data_ptr())
            layer(x, cross_attention_states=states, cross_attention_mask=None, attention_mask=None,
                  full_text_row_masked_out_mask=None)  # fmt: skip
        got.append(sum(seen.values()))
    return (got[1] - got[0]) / 8


def _per_layer(each: list[int], cfg: Any) -> float:
    """A layer's bytes on average over the tower's: Llama 3.2 Vision's local and (gated) global layers weighted by
    how many of each it has; another family's one layer."""
    if len(each) == 1:
        return float(each[0])
    local, glob = int(cfg.vision_config.num_hidden_layers), int(cfg.vision_config.num_global_layers)
    return (local * each[0] + glob * each[1]) / (local + glob)
