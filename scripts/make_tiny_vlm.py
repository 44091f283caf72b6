#!/usr/bin/env python3
"""The image set and the processor of configs/experiments/tiny-vlm.yaml, made here (nothing is downloaded):

- `data/tiny_vlm/pictures/`: a square, a circle and a triangle in red, green and blue (56 x 56 PNGs, drawn with
  PIL), and `data/tiny_vlm/shapes.jsonl`: "What is this?" about each, answered "A red square." and so on, in the
  three forms chat data holds images (OpenAI content parts, an `images` column with <image>, an `image` column);
- `.cache/tiny-vlm/`: the processor directory the experiment reads (data.tokenizer), as a Qwen2-VL checkpoint has
  it: the published Qwen3 tokenizer (`make tokenizers`: it holds Qwen-VL's vision tokens) beside
  `data/tiny_vlm/processor/` (Qwen2-VL's image processor settings, small images: at most 16 tokens an image, and
  the published Qwen2.5-VL chat template).

    python scripts/make_tiny_vlm.py [--data] [--processor]   (both by default)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data" / "tiny_vlm"
PROCESSOR = ROOT / ".cache" / "tiny-vlm"
TOKENIZER = ROOT / ".cache" / "tokenizers" / "qwen3"
SHAPES = ("square", "circle", "triangle")
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220)}
FORMS = ("parts", "images", "image")


def draw(shape: str, colour: str, size: int = 56):  # noqa: ANN201 (a PIL image)
    """A shape in a colour on white."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), (255, 255, 255))
    d = ImageDraw.Draw(img)
    box = (size // 6, size // 6, size - size // 6, size - size // 6)
    fill = COLOURS[colour]
    if shape == "square":
        d.rectangle(box, fill=fill)
    elif shape == "circle":
        d.ellipse(box, fill=fill)
    else:
        d.polygon([(size // 2, box[1]), (box[2], box[3]), (box[0], box[3])], fill=fill)
    return img


def row(form: str, picture: str, answer: str, question: str = "What is this?") -> dict:
    """One conversation about `picture` (a path relative to the data file) in one of the three forms."""
    if form == "parts":
        user = {
            "role": "user",
            "content": [{"type": "image", "path": picture}, {"type": "text", "text": question}],
        }
        return {"messages": [user, {"role": "assistant", "content": answer}]}
    messages = [{"role": "user", "content": ("<image>" if form == "images" else "") + question},
                {"role": "assistant", "content": answer}]  # fmt: skip
    return (
        {"messages": messages, "images": [picture]}
        if form == "images"
        else {"messages": messages, "image": picture}
    )


def make_data(out: Path = DATA) -> Path:
    (out / "pictures").mkdir(parents=True, exist_ok=True)
    rows = []
    for form in FORMS:
        for colour in COLOURS:
            for shape in SHAPES:
                name = f"pictures/{colour}-{shape}.png"
                if not (out / name).exists():
                    draw(shape, colour).save(out / name)
                rows.append(row(form, name, f"A {colour} {shape}."))
    path = out / "shapes.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_processor(out: Path = PROCESSOR) -> Path:
    if not (TOKENIZER / "tokenizer.json").is_file():
        raise SystemExit(f"{TOKENIZER} is missing: run `make tokenizers` first")
    import tempfile

    files = (
        TOKENIZER / "tokenizer.json",
        TOKENIZER / "tokenizer_config.json",
        *sorted((DATA / "processor").iterdir()),
    )
    if all((out / f.name).is_file() and (out / f.name).read_bytes() == f.read_bytes() for f in files):
        return out  # made already (another process may be reading it)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    for src in files:
        shutil.copyfile(src, tmp / src.name)
    shutil.rmtree(out, ignore_errors=True)
    try:
        tmp.rename(out)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", action="store_true", help="make data/tiny_vlm only")
    ap.add_argument("--processor", action="store_true", help="make .cache/tiny-vlm only")
    args = ap.parse_args()
    both = not (args.data or args.processor)
    if args.data or both:
        print(f"make_tiny_vlm: {make_data()}")
    if args.processor or both:
        print(f"make_tiny_vlm: {make_processor()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
