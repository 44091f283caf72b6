"""The image budget of a vision-language model: what a micro batch's images cost a rank beside the text layers'
activations (their tokens are the text layers' like any other: activations.py counts them).

- **pixel values**: the processor's float32 patches, every image of the micro batch, on the device;
- **the vision tower**: what each of its layers keeps for backward a patch, measured once a model by running one
  layer of the model's own tower at its real width on two small images (trainer/model/vision_count.py), times the
  layers where the tower trains; a frozen tower (the default) keeps nothing, but one layer's working set is alive
  at a time during its forward, counted once. Eager attention adds each head's scores a patch pair within an
  image (Qwen2.5-VL's windowed layers: within a window): the fp32 softmax and its copy in the compute precision;
- **the stem and the projector**: the patch embedding's and the projector's (measured with the tower, as the
  model's freezing leaves them).

How many patches a micro batch holds is the configuration's worst case, as the text plan's full rows are: every
token of a row an image token (the data refuses a row whose images alone are longer), in images of the largest
size the resolution bounds allow (`image_size`: the processor's `max_pixels`, below it `data.image_max_pixels`
as the processor rounds it), for a family whose
images take the tokens their size gives (Qwen2-VL); a fixed-size family (Gemma 3) as many of its images as a row
holds. The plan counts this for a vision-language model whether or not its data has images (it does not read
the data): text-only data costs less.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

F32 = 4
QWEN_MAX_PIXELS = 12845056  # Qwen2-VL's image processor's default max_pixels (16,384 tokens an image)


@dataclass(frozen=True)
class Vision:
    """What the planner knows of a vision-language model's tower, measured at model-info time."""

    family: str  # "Qwen2-VL"
    layers: int  # the tower's layers
    heads: int
    # the tower's hidden size (activation checkpointing keeps a layer's input: width values a patch)
    width: int
    patch: int  # a patch's side, pixels
    # pixel values a patch as the processor gives them (float32: channels x frames x patch^2 x 4)
    pixel_bytes: int
    patches_per_token: int  # patches merged into one of the language model's tokens
    # a fixed-size family's patches an image (Gemma 3: 4,096; Idefics3: a tile's); 0: as the image's size gives
    image_patches: int = 0
    layer: tuple[float, float] = (0.0, 0.0)  # bytes a patch one tower layer keeps when it trains (bf16, fp32)
    rest: tuple[float, float] = (0.0, 0.0)  # the stem's and projector's bytes a patch, as the model is frozen
    trains: bool = False  # whether the tower's layers train (model.freeze)
    window_patches: int = 0  # windowed attention's patches a window (Qwen2.5-VL), 0: whole images
    full_layers: int = 0  # of the layers, those over whole images where the others are windowed
    unit: str = "image"  # what the tower takes one of: an image, or a tile of one (Idefics3)
    # bytes a patch each of the text's cross-attention layers keeps (Llama 3.2 Vision: the keys and values of the
    # images' features), and how many such layers (0: the images are tokens of the text)
    cross: tuple[float, float] = (0.0, 0.0)
    cross_layers: int = 0
    cross_width: int = 0  # the text's width: the projected features a patch, which those layers keep once
    cross_heads: int = 0  # the text's attention heads (eager attention's scores a token and patch)


@dataclass(frozen=True)
class Budget:
    """A micro batch's images at the configuration's worst case, and their bytes on a rank."""

    max_pixels: int  # an image's bound
    image_tokens: int  # tokens an image of that size takes
    images: int  # images a micro batch holds at most
    patches: int  # the tower's patches a micro batch
    pixels: int  # pixel values, bytes
    tower: int  # the vision tower's, bytes (kept, or one layer's in flight where frozen)
    rest: int  # the stem's and projector's, bytes
    cross: int = (
        0  # the text's cross-attention layers' keys and values of the images' features (Llama 3.2 Vision)
    )

    @property
    def total(self) -> int:
        return self.pixels + self.tower + self.rest + self.cross


def tower_bytes(
    v: Vision, lp: int, images: list[int], eager: bool, checkpointing: bool = False
) -> tuple[float, float]:
    """(the tower's layers', the stem's and projector's) bytes for images of these patch counts: what the layers
    keep where the tower trains (with activation checkpointing, which transformers applies to the tower's layers
    too: each layer's input and one layer's), else one layer's working set."""
    at = 0 if lp < F32 else 1
    patches = sum(images)
    layer = v.layer[at] * patches
    if eager:  # each head's scores within an image (a window), the fp32 softmax and its copy
        score = F32 + (lp if lp < F32 else 0)
        whole = v.heads * score * sum(p * p for p in images)
        windowed = v.heads * score * sum(p * min(p, v.window_patches) for p in images)
        full = v.full_layers if v.window_patches else v.layers
        scores = (full * whole + (v.layers - full) * windowed) / max(v.layers, 1)  # a layer's, on average
        layer += max(whole, windowed) if not v.trains else scores
    # Llama 3.2 Vision's tower masks its attention within each image's tiles: one (patches x patches) mask an
    # image in the compute precision, made once and kept by every layer
    mask = lp * sum(p * p for p in images) if v.cross_layers else 0
    if not v.trains:
        return layer + mask, v.rest[at] * patches
    kept = v.layers * lp * v.width * patches + layer if checkpointing else v.layers * layer
    return kept + mask, v.rest[at] * patches


MAX_RATIO = 200  # Qwen-VL's smart_resize refuses an image whose sides differ more


def image_size(v: Vision, max_pixels: int | None, processor_pixels: int = QWEN_MAX_PIXELS) -> tuple[int, int]:
    """(patches, tokens) of the largest image: a fixed-size family's, else the most an image within
    data.image_max_pixels (`max_pixels`, scaled before the processor) can take once the processor rounds each
    side to the nearest whole token (Qwen-VL's smart_resize: a 16 x 3,136 image under 50,176 pixels takes 112
    tokens of 28 x 28 where 50,176 / 784 is 64), and at most the processor's own bound (which it keeps by
    rounding down)."""
    if v.image_patches:
        return v.image_patches, v.image_patches // v.patches_per_token
    side = v.patch * math.isqrt(v.patches_per_token)
    tokens = max(1, processor_pixels // (side * side))
    if max_pixels:
        tokens = min(tokens, rounded_tokens(side, max_pixels))
    return tokens * v.patches_per_token, tokens


@functools.lru_cache(maxsize=64)
def rounded_tokens(side: int, max_pixels: int) -> int:
    """The most tokens of side x side pixels an image of at most `max_pixels` takes after smart_resize's rounding
    (each height, the widest image of it within the bound and the aspect ratio). A side that rounds to none is
    scaled up to the processor's min_pixels instead (a small image's tokens): not the most."""
    most = 1
    for h in range(side // 2 + 1, math.isqrt(MAX_RATIO * max_pixels) + 1):
        w = min(max_pixels // h, MAX_RATIO * h)
        if round(w / side) < 1 or h > MAX_RATIO * w:
            continue
        most = max(most, round(h / side) * round(w / side))
    return most


@functools.lru_cache(maxsize=256)  # the planner asks for it under every setting of the levers
def budget(
    v: Vision,
    lp: int,
    rows: int,
    seq_len: int,
    max_pixels: int | None,
    eager: bool,
    checkpointing: bool = False,
    processor_pixels: int = QWEN_MAX_PIXELS,
    max_images: int | None = None,
) -> Budget:
    """The worst case (module doc): `rows` rows of `seq_len` tokens full of images of the largest size (every
    term is a sum over the images: one row's, times the rows)."""
    patches, tokens = image_size(v, max_pixels, processor_pixels)
    whole, left = divmod(seq_len, tokens)
    if v.cross_layers:  # one token an image: as many images a row as data.max_images allows (null: 1)
        whole, left = min(whole, max_images or 1), 0
    elif max_images and whole >= max_images:  # data.max_images below what the row's tokens hold
        whole, left = max_images, 0
    if not whole:  # an image larger than a row: the data refuses it, a row holds what fits
        whole, left = 0, seq_len
    sizes = [patches] * whole + ([left * v.patches_per_token] if left and not v.image_patches else [])
    layers, rest = tower_bytes(v, lp, sizes, eager, checkpointing)
    layers, rest, total = layers * rows, rest * rows, sum(sizes) * rows
    bound = min(max_pixels or processor_pixels, processor_pixels)
    cross = cross_bytes(v, lp, total, seq_len, eager)
    return Budget(
        bound, tokens, len(sizes) * rows, total, total * v.pixel_bytes, int(layers), int(rest), int(cross)
    )


def cross_bytes(v: Vision, lp: int, patches: int, seq_len: int, eager: bool) -> float:
    """What the text's cross-attention layers keep for `patches` patches of images (the micro batch's), each row's
    attended by its own `seq_len` tokens: each layer's keys and values (measured), the projected features once, and
    the attention's tokens x patches a row: under sdpa its additive mask, kept once for every layer in the compute
    precision; under eager each layer's scores a head (the fp32 softmax and its copy in the compute precision)."""
    if not v.cross_layers:
        return 0.0
    kept = v.cross_layers * v.cross[0 if lp < F32 else 1] * patches + v.cross_width * lp * patches
    if eager:
        kept += v.cross_layers * v.cross_heads * (F32 + (lp if lp < F32 else 0)) * seq_len * patches
    else:
        kept += lp * seq_len * patches
    return kept


@functools.lru_cache(maxsize=64)
def processor_max_pixels(directory: str | None) -> int | None:
    """The image processor's bound in a model's directory (preprocessor_config.json: max_pixels, or
    size.longest_edge as transformers 5 saves Qwen2-VL's), None where it says none."""
    if not directory:
        return None
    path = Path(directory).expanduser() / "preprocessor_config.json"
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    value = found.get("max_pixels") or (found.get("size") or {}).get("longest_edge")
    return int(value) if isinstance(value, int | float) and value > 0 else None


def experiment_budget(
    exp: Any, v: Vision | None, lp: int, rows: int, seq_len: int, eager: bool, checkpointing: bool = False
) -> Budget | None:
    """The experiment's image budget a rank (None for a text model)."""
    if v is None:
        return None
    directory = exp.data.tokenizer if exp.data.tokenizer != "byte" else exp.model.pretrained
    return budget(v, lp, rows, seq_len, exp.data.image_max_pixels, eager, checkpointing,
                  processor_max_pixels(directory) or QWEN_MAX_PIXELS, exp.data.max_images)  # fmt: skip


def describe(b: Budget | None, v: Vision | None) -> str:
    """--plan's line: the image budget a rank."""
    if b is None or v is None:
        return ""
    mib = 2**20
    size = (
        f"{v.image_patches:,} patches a {v.unit}"
        if v.image_patches
        else f"up to {b.max_pixels:,} pixels an image"
    )
    tower = "kept for backward" if v.trains else "frozen: one layer's in flight"
    if v.cross_layers:  # Llama 3.2 Vision: an image one token, its tiles attended by cross-attention layers
        return (
            f"images ({v.family}, {v.image_patches:,} patches an image in its tiles: 1 token): up to {b.images:,} "
            f"image{'s' if b.images != 1 else ''} a micro batch (data.max_images a row), {b.patches:,} patches: pixel values "
            f"{b.pixels / mib:,.1f} MiB, vision tower {b.tower / mib:,.1f} MiB ({tower}), stem and projector "
            f"{b.rest / mib:,.1f} MiB, the text's {v.cross_layers} cross-attention layers {b.cross / mib:,.1f} MiB; "
            f"{math.ceil(b.total / mib):,} MiB a rank in the activations"
        )
    return (
        f"images ({v.family}, {size}: {b.image_tokens:,} tokens): up to {b.images:,} {v.unit}s a micro batch, "
        f"{b.patches:,} patches: pixel values {b.pixels / mib:,.1f} MiB, vision tower {b.tower / mib:,.1f} MiB "
        f"({tower}), stem and projector {b.rest / mib:,.1f} MiB; {math.ceil(b.total / mib):,} MiB a rank in "
        f"the activations (the worst case: rows full of the largest {v.unit}s)"
    )
