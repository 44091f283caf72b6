"""QLoRA (`model.lora.quantization: 4bit`): LoRA adapters over a base loaded from model.pretrained with
bitsandbytes' NF4 weights (double quantization, computing in bf16, stored in bf16 so that ZeRO-3 can
partition them), on 2 ranks through the real launchers at ZeRO 0, 2 and 3: it trains, resumes bit for
bit from a checkpoint that holds the adapters and the optimizer and never the base, and the adapter
loads with peft's PeftModel over the 4-bit base."""

import pytest
import torch
from helpers import (
    NODROP,
    K,
    assert_same_continuation,
    chat_data,
    check_memory,
    falling,
    resume_sets,
    split_losses,
    train,
)

from trainer.files import file_lock

pytestmark = pytest.mark.dist
pytest.importorskip("bitsandbytes")

QLORA = {"model.lora": {"r": 4, "alpha": 8, "dropout": 0.0, "quantization": "4bit"}, "optim.lr": 1e-2,
         "optim.warmup_steps": 0, "train.precision": "bf16", "strategy.justification": "test"}  # fmt: skip
CASES = {"zero0": (0, "deepspeed"), "zero2": (2, "torchrun"), "zero3": (3, "deepspeed")}


def base_dir(shared_dir):
    """A Llama of the byte tokenizer's vocabulary, saved as a from_pretrained directory once a session:
    12.6M parameters in its linear layers (25 MB in bf16, 6.3 MB packed in 4 bits), enough for the
    planner's packed bytes and quantization state to be told apart from the rest."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = shared_dir / "qlora-base-512"
    with file_lock(shared_dir / "qlora-base.lock"):
        if not (out / "config.json").exists():
            torch.manual_seed(0)
            cfg = AutoConfig.for_model("llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                                       vocab_size=257, bos_token_id=256, eos_token_id=256)  # fmt: skip
            AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out


def sets_for(data, shared_dir, stage):
    model = {"model.config": None, "model.pretrained": str(base_dir(shared_dir))}
    return resume_sets(data, stage, **NODROP, **QLORA, **model)


@pytest.mark.parametrize("name", list(CASES))
def test_qlora_trains_resumes_bit_for_bit_and_its_adapter_loads_over_the_4bit_base(
    tmp_path, shared_dir, small_data, name
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    stage, launcher = CASES[name]
    sets = sets_for(small_data, shared_dir, stage)
    a = train(tmp_path / "a", sets, launcher=launcher)
    assert f"ZeRO stage {stage}" in a.output
    assert "base weights: 4bit nf4, double quantization, 28 linear layers quantized" in a.output, a.output[
        -3000:
    ]
    first, last = falling(a.losses)
    assert last < first * 0.97, (first, last)
    ckpt = a.run_dir / "checkpoints" / f"step_{2 * K:08d}"
    names = {p.name for p in ckpt.rglob("*") if p.is_file()}
    assert "adapter_model.safetensors" in names and not any(n == "model.safetensors" for n in names)
    b = train(tmp_path / "b", sets, launcher="torchrun", extra_args=["--resume", str(a.run_dir / "checkpoints" /
                                                                                   f"step_{K:08d}")])  # fmt: skip
    assert_same_continuation(a, b)
    check_memory(a, name)  # the packed weights and their quantization state as planned, within 10%
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)  # fmt: skip
    base = AutoModelForCausalLM.from_pretrained(base_dir(shared_dir), quantization_config=quant,
                                                dtype=torch.bfloat16, device_map={"": "cpu"})  # fmt: skip
    model = PeftModel.from_pretrained(base, str(ckpt / "adapter")).eval()
    trained = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert trained and all(p.abs().sum() > 0 for p in trained)  # every B moved
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        quantized = model(input_ids=ids).logits.float()
    assert torch.isfinite(quantized).all()
    if name == "zero3":  # export from the sharded checkpoint: the adapters merged into the dequantized base
        merged_logits_match_the_4bit_forward(tmp_path, shared_dir, ckpt, ids, quantized)


def merged_logits_match_the_4bit_forward(tmp_path, shared_dir, ckpt, ids, quantized):
    """bin/export of a QLoRA checkpoint: a plain model (no bitsandbytes), the adapters merged into the
    dequantized base. Its logits (fp32, and with --dtype bf16) are the 4-bit base's with the adapter
    to within rounding, several times closer than the same adapter over the original weights (the
    quantization's own error)."""
    import json
    import subprocess
    import sys

    from helpers import ROOT, env_for
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    def export(dtype):
        out = tmp_path / f"merged-{dtype}"
        p = subprocess.run([sys.executable, str(ROOT / "bin" / "export"), str(ckpt), str(out), "--dtype", dtype],
                           cwd=ROOT, env=env_for(1), capture_output=True, text=True, timeout=600)  # fmt: skip
        assert p.returncode == 0, p.stderr[-3000:]
        model = AutoModelForCausalLM.from_pretrained(out, dtype="auto").eval()
        assert not any("quant" in k for k in model.state_dict()) and "quantization_config" not in model.config
        return model

    fp32 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=torch.bfloat16)  # fmt: skip
    base = AutoModelForCausalLM.from_pretrained(base_dir(shared_dir), quantization_config=fp32, dtype=torch.float32,
                                                device_map={"": "cpu"})  # fmt: skip
    original = AutoModelForCausalLM.from_pretrained(base_dir(shared_dir), dtype=torch.bfloat16)
    models = {"4bit fp32": PeftModel.from_pretrained(base, str(ckpt / "adapter")).eval(),
              "original bf16": PeftModel.from_pretrained(original, str(ckpt / "adapter")).eval(),
              "merged fp32": export("fp32"), "merged bf16": export("bf16")}  # fmt: skip
    with torch.no_grad():
        logits = {k: m(input_ids=ids).logits.float() for k, m in models.items()}
    err = {k: (logits[k] - (logits["4bit fp32"] if k == "merged fp32" else quantized)).abs() for k in logits}
    print("against the 4-bit forward, mean (max) |logit difference|: " + ", ".join(
        f"{k} {e.mean().item():.2e} ({e.max().item():.2e})" for k, e in err.items() if k != "4bit fp32"))  # fmt: skip
    # (fp32: 6.0e-4 against 5.9e-3 when measured; what is left is the adapter's fp32 master weights
    # against the bf16 ones in the checkpoint's adapter/, and the bf16-rounded embeddings and norms)
    assert err["merged fp32"].mean() < 0.25 * err["original bf16"].mean()
    assert err["merged bf16"].mean() < 0.5 * err["original bf16"].mean()
    # --adapter: the adapter alone, naming the pretrained base, loads over the 4-bit base
    out = tmp_path / "adapter"
    p = subprocess.run([sys.executable, str(ROOT / "bin" / "export"), str(ckpt), str(out), "--adapter"], cwd=ROOT,
                       env=env_for(1), capture_output=True, text=True, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        base_dir(shared_dir)
    )
    with torch.no_grad():
        fresh = AutoModelForCausalLM.from_pretrained(base_dir(shared_dir), quantization_config=fp32, dtype=torch.float32,
                                                     device_map={"": "cpu"})  # fmt: skip
        exported = PeftModel.from_pretrained(fresh, str(out))(input_ids=ids).logits.float()
    assert (exported - logits["4bit fp32"]).abs().mean() < 0.25 * err["original bf16"].mean()


def dequantized_base(shared_dir):
    """The base as its NF4 weights hold it (bitsandbytes' dequantization, saved in fp32): LoRA over this
    is what QLoRA trains, up to how the layer computes."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    out = shared_dir / "qlora-base-512-dequantized"
    with file_lock(shared_dir / "qlora-base-dequantized.lock"):
        if not (out / "config.json").exists():
            quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                       bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)  # fmt: skip
            base = AutoModelForCausalLM.from_pretrained(base_dir(shared_dir), quantization_config=quant, dtype="auto",
                                                        device_map={"": "cpu"})  # fmt: skip
            base.dequantize().save_pretrained(out)
    return out


def test_qlora_is_lora_over_its_dequantized_base_and_follows_bf16_lora(tmp_path, shared_dir):
    """100 steps on one rank, bf16, the same data and seed: QLoRA logs the losses of bf16 LoRA over
    the base's dequantized NF4 weights bit for bit (the adapters see exactly those weights), and
    follows bf16 LoRA over the original weights within the 4-bit error (the gap is printed; 3.3% over
    the last 10 steps when measured)."""
    curve = {**QLORA, "model.config": None, "train.max_steps": 100, "train.log_every": 1, "train.eval_every": 0,
             "train.micro_batch_size": 4, "data.eval_fraction": 0, "data.num_workers": 0, "optim.lr": 3e-3,
             "checkpoint.every_steps": 0, "checkpoint.save_final": False, "model.lora.r": 8, "model.lora.alpha": 16}  # fmt: skip
    runs = {}
    for name, base, quantization in (("qlora", base_dir(shared_dir), "4bit"),
                                     ("dequantized", dequantized_base(shared_dir), "none"),
                                     ("bf16", base_dir(shared_dir), "none")):  # fmt: skip
        sets = {**curve, "model.pretrained": str(base), "model.lora.quantization": quantization}
        runs[name] = train(tmp_path / name, sets, debug=False).losses
    q, d, b = runs["qlora"], runs["dequantized"], runs["bf16"]
    assert sorted(q) == list(range(1, 101)) and q == d
    gap = [abs(q[s] / b[s] - 1) for s in q]
    print(f"QLoRA against bf16 LoRA: step 1 {gap[0]:.2%}, mean {sum(gap) / 100:.2%}, last 10 {sum(gap[-10:]) / 10:.2%}, "
          f"max {max(gap):.2%}; final losses {q[100]:.4f} and {b[100]:.4f}")  # fmt: skip
    assert gap[0] < 0.01 and sum(gap[-10:]) / 10 < 0.10
    assert sum(q[s] for s in range(91, 101)) < 0.9 * sum(q[s] for s in range(1, 11))  # 3.68 against 4.33


def test_qlora_chat_steps_do_not_depend_on_how_the_batch_or_the_rows_are_split(tmp_path, shared_dir):
    """Chat data, packed, over the 4-bit base (stored and computing in fp32): 1 rank x accumulation 4,
    2 ranks x micro 2 (deepspeed launcher, 1e-6 relative) and sequence parallelism 2 log the same losses
    at every step."""
    data = chat_data(tmp_path / "chat.jsonl")
    sets = {**QLORA, "model.config": None, "model.pretrained": str(base_dir(shared_dir)), "train.precision": "fp32",
            "data.train.files": str(data), "data.train.kind": "chat", "data.eval_fraction": 0, "data.num_workers": 0,
            "train.max_steps": 6, "train.log_every": 1, "train.eval_every": 0, "train.eval_prompts": [],
            "checkpoint.save_final": False, "checkpoint.every_steps": 0}  # fmt: skip
    losses = split_losses(tmp_path, lambda split: {**sets, **split}, names=("accum4", "2ranks"))
    assert losses["accum4"][6] < losses["accum4"][1]
    # sequence parallelism 2 at ZeRO-3 (the packed weights sharded and gathered per layer) with activation
    # checkpointing: each rank a half of every row, the same steps (1e-5 relative)
    sp = {**sets, "train.micro_batch_size": 1, "train.grad_accum": 4, "strategy.sequence_parallel": 2,
          "strategy.zero_stage": 3, "model.activation_checkpointing": True}  # fmt: skip
    r = train(tmp_path / "sp2", sp, launcher="torchrun", debug=False)
    assert "sequence parallel 2" in r.output and "activation checkpointing" in r.output
    for step, value in losses["accum4"].items():
        assert r.losses[step] == pytest.approx(value, rel=1e-5), (step, r.losses, losses["accum4"])


def test_qlora_dpo_at_zero3_its_reference_is_the_4bit_base(tmp_path, shared_dir):
    """DPO over the 4-bit base at ZeRO-3 on 2 ranks, fp32: the reference is the policy with its adapters
    disabled (the quantized base itself, computed before the first step), so the first step's margin
    is 0 and its loss ln 2 (1e-5); the margins then grow."""
    from helpers import ROOT

    prefs = tmp_path / "prefs.jsonl"
    rows = (ROOT / "data" / "tiny" / "python_prefs.jsonl").read_text().splitlines(keepends=True)[:16]
    prefs.write_text("".join(rows))
    sets = {**QLORA, "model.config": None, "model.pretrained": str(base_dir(shared_dir)), "train.precision": "fp32",
            "data.train.files": str(prefs), "data.train.kind": "preference", "data.eval_fraction": 0,
            "data.num_workers": 0, "train.objective": "dpo", "train.micro_batch_size": 2, "train.max_steps": 8,
            "train.log_every": 1, "train.eval_every": 0, "optim.lr": 3e-3, "strategy.zero_stage": 3,
            "checkpoint.every_steps": 0, "checkpoint.save_final": False}  # fmt: skip
    r = train(tmp_path, sets, launcher="deepspeed", cache=tmp_path / "cache", debug=False)
    assert "ZeRO stage 3" in r.output and "base weights: 4bit nf4" in r.output
    assert "reference log-probs: computed for 16 pairs" in r.output
    recs = [m for m in r.metrics if "reward_margin" in m]
    first = recs[0]
    assert abs(first["reward_margin"]) < 1e-5 and first["loss"] == pytest.approx(0.6931472, abs=1e-5), first
    assert sum(m["reward_margin"] for m in recs[-3:]) > 0, recs
