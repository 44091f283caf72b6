"""Images in chat data: where a conversation's images are, how they are read, and how the model's own
processor turns a rendered example into its tokens and pixels.

Three forms, as the tools our users come from write them:

- OpenAI-style content parts: `{"type": "image", "image" | "path" | "url" | "base64": ...}` or
  `{"type": "image_url", "image_url": {"url": ...}}` among a message's `text` parts (TRL, Axolotl);
- an `images` column (`data.train.images_field`) with `<image>` placeholders in the messages' text, one per
  image in order (LLaMA-Factory's ShareGPT form);
- a single `image` column (`image_field`): at its `<image>` placeholder, else before the first user message's
  text (as TRL puts it).

An image is a path (absolute, or relative to the data file's folder), a `file://`, `http(s)://` or
`data:image/...;base64,` address, a base64 string, raw bytes, or Hugging Face datasets' `{bytes, path}`. Counts
are checked against the placeholders before anything trains (file:line). The conversation is rendered by the
chat template with `{"type": "image"}` parts (the template writes the family's placeholder), the targets found
on that text as for text (trainer/data/chat.py), then the processor expands each placeholder into the image's
tokens and makes its pixels (`expand`): the ids are the processor's own, the targets carried over by aligning
the two tokenizations, and **no token of an image is ever a target** (the tokens the expansion inserted, the
placeholder's, and the special tokens that enclose them).
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import io
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainer.common.errors import UserError

PLACEHOLDER = "<image>"  # LLaMA-Factory's, in the text of the `images` / `image` column forms
IMAGE_PART = {"type": "image"}  # what the chat template is given for an image
_KEYS = ("image", "path", "url", "base64")  # the keys an image part may name it by


def source_of(part: Mapping[str, Any]) -> Any:
    """What an OpenAI-style image part names its image by; None where it names none."""
    if part.get("type") == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, Mapping) else url
    for k in _KEYS:
        if part.get(k) is not None:
            return part[k] if k != "base64" else {"base64": part[k]}
    return None


def is_image_part(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") in ("image", "image_url")


def _split(text: str) -> list[dict[str, Any]]:
    """A string with `<image>` placeholders -> content parts."""
    out: list[dict[str, Any]] = []
    for k, piece in enumerate(text.split(PLACEHOLDER)):
        if k:
            out.append(dict(IMAGE_PART))
        if piece:
            out.append({"type": "text", "text": piece})
    return out


def conversation_images(messages: Any, row: Mapping[str, Any], src: Any, where: Any) -> tuple[Any, list[Any]]:
    """(the messages with every image as an `{"type": "image"}` part, the images' sources in order). Text-only
    rows come back as they are, with no sources."""
    if not isinstance(messages, list):
        return messages, []
    many = row.get(src.images_field) if src.images_field else None
    one = row.get(src.image_field) if src.image_field else None
    column = many if many not in (None, []) else ([one] if one is not None else None)
    out, found = [], []
    for n, m in enumerate(messages):
        content = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(content, list) and any(is_image_part(p) for p in content):
            parts = []
            for k, p in enumerate(content):
                if not is_image_part(p):
                    parts.append(p)
                    continue
                spec = source_of(p)
                if spec is None:
                    raise UserError(
                        f"{where}: message {n}: image part {k} names no image; give one of "
                        f"{', '.join(_KEYS)} (or image_url.url)"
                    )
                found.append(spec)
                parts.append(dict(IMAGE_PART))
            m = {**m, "content": parts}
        out.append(m)
    if found and column is not None:
        raise UserError(
            f"{where}: the row has image parts in its messages and an {src.images_field}/{src.image_field} "
            "column; give its images one way"
        )
    if column is None:
        return out, found
    if not isinstance(column, list):
        raise UserError(f"{where}: {src.images_field} is {type(column).__name__}; give a list of images")
    holders = sum(m["content"].count(PLACEHOLDER) for m in out if isinstance(m, Mapping) and isinstance(m.get("content"), str))  # fmt: skip
    if (
        holders == 0 and many in (None, []) and one is not None
    ):  # TRL's single image: before the first user text
        first = next(
            (i for i, m in enumerate(out) if isinstance(m, Mapping) and m.get("role") == "user"), None
        )
        if first is None or not isinstance(out[first].get("content"), str):
            raise UserError(f"{where}: the row has an {src.image_field} but no user message to put it in")
        out[first] = {**out[first], "content": PLACEHOLDER + out[first]["content"]}
        holders = 1
    if holders != len(column):
        col = src.images_field if many not in (None, []) else src.image_field
        raise UserError(
            f"{where}: {holders} {PLACEHOLDER} placeholder(s) in the messages but {len(column)} image(s) in "
            f"{col}; put one {PLACEHOLDER} where each image goes, in order"
        )
    for i, m in enumerate(out):
        if isinstance(m, Mapping) and isinstance(m.get("content"), str) and PLACEHOLDER in m["content"]:
            out[i] = {**m, "content": _split(m["content"])}
    return out, list(column)


def _read_bytes(spec: Any, base: Path | None, where: Any, k: int) -> tuple[bytes, dict[str, Any]]:
    """The image's bytes and what identifies them for the cache (a file's path, size and time; else a digest)."""
    if isinstance(spec, Mapping):
        if spec.get("bytes") is not None:
            spec = spec["bytes"]
        elif spec.get("base64") is not None:
            spec = "data:;base64," + str(spec["base64"])
        elif spec.get("path") or spec.get("url"):
            spec = spec.get("path") or spec.get("url")
        else:
            raise UserError(f"{where}: image {k} is a mapping without bytes, path, url or base64")
    if isinstance(spec, bytes | bytearray):
        blob = bytes(spec)
        return blob, {"sha256": hashlib.sha256(blob).hexdigest()}
    if not isinstance(spec, str) or not spec:
        raise UserError(f"{where}: image {k} is {type(spec).__name__}; give a path, an address or base64")
    if spec.startswith("data:"):
        try:
            blob = base64.b64decode(spec.split(",", 1)[1], validate=True)
        except (IndexError, binascii.Error) as e:
            raise UserError(f"{where}: image {k}: a data address that is not base64 ({e})") from None
        return blob, {"sha256": hashlib.sha256(blob).hexdigest()}
    if spec.startswith(("http://", "https://")):
        import urllib.request

        try:
            with urllib.request.urlopen(spec, timeout=60) as r:  # the data asks for it: its own address
                blob = r.read()
        except OSError as e:
            raise UserError(f"{where}: image {k}: cannot fetch {spec}: {e}; give a local file") from None
        return blob, {"url": spec, "sha256": hashlib.sha256(blob).hexdigest()}
    path = Path(spec[len("file://") :] if spec.startswith("file://") else spec).expanduser()
    if not path.is_absolute() and base is not None:
        path = base / path
    try:
        blob = path.read_bytes()
        st = path.stat()
    except OSError as e:
        blob = _base64_image(spec)  # a bare base64 string ('/9j/...' for a JPEG: slashes are base64's too)
        if blob is not None:
            return blob, {"sha256": hashlib.sha256(blob).hexdigest()}
        raise UserError(
            f"{where}: image {k}: cannot read {path} ({e.strerror or e}); paths are relative to the data file's "
            "folder"
        ) from None
    return blob, {"file": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _base64_image(spec: str) -> bytes | None:
    """The bytes of a bare base64 string that decodes to an image PIL recognises; None otherwise (a path)."""
    from PIL import Image, UnidentifiedImageError

    try:
        blob = base64.b64decode(spec, validate=True)
        Image.open(io.BytesIO(blob))
    except (binascii.Error, ValueError, UnidentifiedImageError, OSError):
        return None
    return blob


def bounded(img: Any, max_pixels: int | None, min_pixels: int | None) -> Any:
    """The image scaled (aspect kept) to at most `max_pixels` and at least `min_pixels` (data.image_max_pixels,
    image_min_pixels), as LLaMA-Factory bounds them before the processor."""
    w, h = img.size
    if max_pixels and w * h > max_pixels:
        f = math.sqrt(max_pixels / (w * h))
        img = img.resize((max(1, int(w * f)), max(1, int(h * f))))
    w, h = img.size
    if min_pixels and w * h < min_pixels:
        f = math.sqrt(min_pixels / (w * h))
        img = img.resize((math.ceil(w * f), math.ceil(h * f)))
    return img


def open_images(specs: list[Any], where: Any, section: Any) -> tuple[list[Any], list[dict[str, Any]]]:
    """The images of a row, decoded to RGB and bounded, and what identifies each (the cache's stamps)."""
    from PIL import Image, UnidentifiedImageError

    file = getattr(where, "file", None)
    base = Path(file).parent if file else None
    out, stamps = [], []
    for k, spec in enumerate(specs):
        blob, stamp = _read_bytes(spec, base, where, k)
        try:
            img = Image.open(io.BytesIO(blob))
            img.load()
        except Image.DecompressionBombError:
            raise UserError(
                f"{where}: image {k} has {_pixels(blob):,} pixels, more than PIL opens (its decompression-bomb "
                f"limit, {2 * Image.MAX_IMAGE_PIXELS:,}); shrink the file (data.image_max_pixels scales images PIL "
                "has opened)"
            ) from None
        except (UnidentifiedImageError, OSError, ValueError) as e:
            raise UserError(
                f"{where}: image {k} is not an image PIL can read ({e}); fix or remove it"
            ) from None
        out.append(bounded(img.convert("RGB"), section.image_max_pixels, section.image_min_pixels))
        stamps.append(stamp)
    return out, stamps


def _pixels(blob: bytes) -> int:
    """An image file's pixels from its header alone (PIL reads the size without decoding)."""
    import warnings

    from PIL import Image

    limit = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None  # the header only: nothing is decoded
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            w, h = Image.open(io.BytesIO(blob)).size
    finally:
        Image.MAX_IMAGE_PIXELS = limit
    return w * h


def stamps_changed(stamps: list[dict[str, Any]]) -> str | None:
    """The first image file whose size or time differs from when the cache was built (None: none)."""
    for s in stamps:
        if "file" not in s:
            continue
        try:
            st = os.stat(s["file"])
        except OSError:
            return s["file"]
        if (st.st_size, st.st_mtime_ns) != (s["size"], s["mtime_ns"]):
            return s["file"]
    return None


# ---------------------------------------------------------------------------------------------- processor

_CONFIGS = ("processor_config.json", "preprocessor_config.json")


def load_processor(spec: str) -> Any:
    """The model's processor (see `_load_processor`), loaded once per process for a directory's files as they are."""
    local = Path(spec).expanduser()
    stamp = tuple(sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in local.iterdir() if f.is_file())) if local.is_dir() else ()  # fmt: skip
    return _load_processor(spec, stamp)


@functools.lru_cache(maxsize=4)
def _load_processor(spec: str, stamp: tuple[Any, ...]) -> Any:
    """The model's processor from the directory (or hub id) data.tokenizer names; None where it has no image
    processor (a text model's tokenizer). Without torchvision, Qwen-VL's processors are built without their
    video processor (image_only_processor)."""
    if spec == "byte":
        return None
    local = Path(spec).expanduser()
    if local.is_dir() and not any((local / f).is_file() for f in _CONFIGS):
        return None
    from transformers import AutoProcessor

    try:
        proc = AutoProcessor.from_pretrained(spec)
    except (ImportError, AttributeError, ValueError, OSError) as e:
        proc = image_only_processor(spec)
        if proc is None:
            raise UserError(f"data.tokenizer: cannot load the processor of '{spec}': {e}") from None
    return proc if getattr(proc, "image_processor", None) is not None else None


def processor_id(proc: Any) -> str | None:
    """The processor's identity for the data cache's key: its class and its image processor's settings."""
    if proc is None:
        return None
    settings = proc.image_processor.to_dict()
    extra = {
        k: v
        for k, v in vars(proc).items()
        if isinstance(v, int | str | float | bool) and not k.startswith("_")
    }
    blob = json.dumps([type(proc).__name__, settings, extra], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def image_only_processor(spec: str) -> Any:
    """A Qwen-VL processor without its video processor (which needs torchvision): None for other classes."""
    local = Path(spec).expanduser()
    name = None
    for f in ("processor_config.json", "preprocessor_config.json"):
        try:
            name = json.loads((local / f).read_text()).get("processor_class") or name
        except (OSError, ValueError):
            continue
    if name not in ("Qwen2VLProcessor", "Qwen2_5_VLProcessor"):
        return None
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.qwen2_vl import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyProcessor(Qwen2VLProcessor):
        def __init__(
            self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None
        ) -> None:
            self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
            self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)

    tok = AutoTokenizer.from_pretrained(spec)
    template = local / "chat_template.jinja"
    return ImageOnlyProcessor(
        AutoImageProcessor.from_pretrained(spec),
        tok,
        chat_template=template.read_text() if template.is_file() else tok.chat_template,
    )
