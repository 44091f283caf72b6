"""configs/experiments/tiny-vlm.yaml as a user runs it: a tiny Qwen2-VL learns to say what a picture shows; bin/export
writes the model with its processor, which transformers' AutoModelForImageTextToText and the processor load, and
which names the shape of every picture (greedy answers to "What is this?")."""

import sys

import pytest
import torch
from helpers import ROOT, falling, train

from tests.vision_helpers import COLOURS, SHAPES, TINY_VLM, VISION_FAMILIES, draw, model_dir, shapes_data

pytestmark = pytest.mark.e2e


def test_tiny_vlm_learns_to_name_the_shapes_and_its_export_answers(tmp_path):
    from transformers import AutoModelForImageTextToText

    from trainer.data.images import load_processor

    TINY_VLM.make_processor()  # .cache/tiny-vlm from the fetched Qwen3 tokenizer (make tokenizers)
    r = train(tmp_path, {"run_dir": str(tmp_path / "run")}, experiment=ROOT / "configs" / "experiments" / "tiny-vlm.yaml",
              debug=False, cache=tmp_path / "cache")  # fmt: skip
    assert "images: 27 in 27 rows, 162 image tokens (never targets" in r.output, r.output[-3000:]
    assert (
        "packing: model type 'qwen2_vl' with images: a packed row trains as its examples one by one"
        in r.output
    )
    first, last = falling(r.losses)
    assert last < first / 10 and r.losses[150] < 0.2, r.losses
    out = tmp_path / "export"
    import subprocess

    subprocess.run([sys.executable, str(ROOT / "bin" / "export"), str(tmp_path / "run"), str(out)], cwd=ROOT,
                   check=True, capture_output=True)  # fmt: skip
    assert (out / "preprocessor_config.json").is_file() and (out / "chat_template.jinja").is_file()
    model = AutoModelForImageTextToText.from_pretrained(out).eval()
    proc = load_processor(str(out))
    shapes = colours = 0
    for shape in SHAPES:
        for colour in COLOURS:
            messages = [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}
            ]
            text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            inputs = proc(
                text=[text], images=[draw(shape, colour)], add_special_tokens=False, return_tensors="pt"
            )
            with torch.no_grad():
                ids = model.generate(**inputs, max_new_tokens=8, do_sample=False)
            answer = proc.tokenizer.decode(ids[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
            print(f"{colour} {shape}: {answer!r}")
            shapes += shape in answer
            colours += colour in answer
    assert shapes == 9 and colours >= 7, (shapes, colours)


@pytest.mark.parametrize("family", [f for f in VISION_FAMILIES if f != "qwen2_vl"])
def test_every_familys_export_loads_and_answers(tmp_path, family):
    """Qwen2.5-VL, Gemma 3, LLaVA, Idefics3 (Qwen2-VL above): two steps from the family's tiny model, then bin/export's
    directory loads as AutoModelForImageTextToText with AutoProcessor (the family's own classes) and generates an
    answer to a question about a picture from the processor's inputs."""
    import subprocess

    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = model_dir(family, tmp_path)
    data = shapes_data(tmp_path / "shapes.jsonl", rows=6)
    sets = {"model.config": None, "model.pretrained": str(model), "data.tokenizer": str(model),
            "data.train.files": str(data), "data.train.kind": "chat", "data.seq_len": 96, "data.eval_fraction": 0,
            "train.precision": "fp32", "train.max_steps": 2, "train.micro_batch_size": 2, "train.eval_every": 0,
            "train.eval_prompts": [], "checkpoint.save_final": True, "run_dir": str(tmp_path / "run")}  # fmt: skip
    train(tmp_path, sets, debug=False)
    out = tmp_path / "export"
    subprocess.run([sys.executable, str(ROOT / "bin" / "export"), str(tmp_path / "run"), str(out)], cwd=ROOT,
                   check=True, capture_output=True)  # fmt: skip
    from trainer.data.images import load_processor

    # AutoProcessor (Qwen2.5-VL's needs torchvision for its video processor: built without it, as training does)
    proc = AutoProcessor.from_pretrained(out) if family != "qwen2_5_vl" else load_processor(str(out))
    m = AutoModelForImageTextToText.from_pretrained(out).eval()
    assert type(m).__name__.lower().replace("_", "").startswith(family.replace("_", ""))
    assert type(proc).__name__.endswith("Processor")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = proc(text=[text], images=[draw("square", "red")], add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        ids = m.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert inputs["input_ids"].shape[1] < ids.shape[1] <= inputs["input_ids"].shape[1] + 4
