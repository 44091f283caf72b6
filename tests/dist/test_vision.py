"""Vision-language fine-tuning on 2 ranks through torchrun: ZeRO-3 with a micro batch that has no image on one rank
(every other row of the data is text only, unshuffled, one example a row: rank 1 never sees an image) neither hangs
nor errs, and logs the losses of one rank at ZeRO-0 over the same global batches; it resumes bit for bit. Without
the idle image (trainer/model/vision.py) the same run stopped in gloo's "collective mismatch" (the vision tower's
weights gathered on one rank only); on NCCL that is a hang (LLaMA-Factory #5616, Qwen3-VL #126)."""

import pytest
from helpers import train

from tests.vision_helpers import VISION_FAMILIES, model_dir, shapes_data

pytestmark = pytest.mark.dist


def sets_for(model, data, **kw):
    return {"model.config": None, "model.pretrained": str(model), "data.tokenizer": str(model),
            "data.train.files": str(data), "data.train.kind": "chat", "data.seq_len": 64, "data.eval_fraction": 0,
            "data.num_workers": 0, "data.shuffle": False, "data.packing": False, "train.precision": "fp32",
            "train.max_steps": 4, "train.log_every": 1, "train.eval_every": 0, "train.eval_prompts": [],
            "optim.lr": 1e-3, "optim.warmup_steps": 0, "checkpoint.save_final": False, **kw}  # fmt: skip


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_zero3_with_a_text_only_rank_gives_the_losses_of_one_rank_and_resumes(tmp_path, family):
    model = model_dir(family, tmp_path)
    data = shapes_data(tmp_path / "alternate.jsonl", rows=8, text_rows=8, alternate=True)
    two = train(tmp_path / "zero3", sets_for(model, data, **{"train.micro_batch_size": 1, "strategy.zero_stage": 3,
                                                             "checkpoint.every_steps": 2, "checkpoint.keep_last": 0}),
                launcher="torchrun", nproc=2, debug=False, timeout=300)  # fmt: skip
    assert "images: 8 in 8 rows" in two.output, two.output[-3000:]
    one = train(tmp_path / "one", sets_for(model, data, **{"train.micro_batch_size": 2, "strategy.zero_stage": 0}),
                launcher="none", debug=False)  # fmt: skip
    assert sorted(one.losses) == [1, 2, 3, 4] and one.losses[4] < one.losses[1]
    for step, value in one.losses.items():
        assert two.losses[step] == pytest.approx(value, rel=1e-5), (one.losses, two.losses)
    if family == "qwen2_vl":  # the position in image data and the vision tower's state come back exactly
        ckpt = two.run_dir / "checkpoints" / "step_00000002"
        again = train(tmp_path / "resumed", sets_for(model, data, **{"train.micro_batch_size": 1, "strategy.zero_stage": 3}),
                      launcher="torchrun", nproc=2, debug=False, timeout=300, extra_args=["--resume", str(ckpt)])  # fmt: skip
        assert {s: v for s, v in again.losses.items() if s > 2} == {s: v for s, v in two.losses.items() if s > 2}


@pytest.mark.parametrize("family,lora", [("qwen2_vl", {"r": 8, "dropout": 0.0}),
                                         ("gemma3", {"r": 8, "dropout": 0.0, "quantization": "4bit"}),
                                         ("llava", {"r": 8, "dropout": 0.0}),
                                         ("idefics3", {"r": 8, "dropout": 0.0, "quantization": "4bit"}),
                                         ("mllama", {"r": 8, "dropout": 0.0, "quantization": "4bit"})])
def test_lora_and_qlora_at_zero3_with_a_text_only_rank_give_the_losses_of_one_rank(tmp_path, family, lora):
    """LoRA on Qwen2-VL and LLaVA, QLoRA (4-bit base, the vision tower unquantized) on Gemma 3, Idefics3 and Llama 3.2
    Vision: at ZeRO-3 on 2 ranks, one of
    them text only, the losses of one rank at ZeRO-0 (the adapters on the language model, the idle image running the
    frozen tower on the text-only rank)."""
    model = model_dir(family, tmp_path)
    data = shapes_data(tmp_path / "alternate.jsonl", rows=8, text_rows=8, alternate=True)
    sets = {"model.lora": lora, "optim.lr": 1e-2}
    two = train(tmp_path / "zero3", sets_for(model, data, **sets, **{"train.micro_batch_size": 1, "strategy.zero_stage": 3}),
                launcher="torchrun", nproc=2, debug=False, timeout=300)  # fmt: skip
    one = train(tmp_path / "one", sets_for(model, data, **sets, **{"train.micro_batch_size": 2, "strategy.zero_stage": 0}),
                launcher="none", debug=False)  # fmt: skip
    assert one.losses[4] < one.losses[1]
    if "quantization" in lora:
        # the language model's: 2 self-attention layers of 7, and Llama 3.2 Vision's cross-attention layer
        quantized = 21 if family == "mllama" else 14
        assert f"{quantized} linear layers quantized" in two.output, two.output[-3000:]
    for step, value in one.losses.items():
        assert two.losses[step] == pytest.approx(value, rel=1e-5), (one.losses, two.losses)
