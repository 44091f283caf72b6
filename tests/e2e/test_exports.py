"""Exports that load (issue 54): for every kind of base -- a random init, a pretrained model trained in fp32
and in bf16, LoRA, QLoRA, QLoRA over a checkpoint stored in 4 bits, DPO -- bin/export's directory loads
with from_pretrained in a fresh process and its logits equal the training forward's (the engine's logits
on two training rows at the end of the run, TRAINER_DEBUG_DIR/probe.pt) within its dtype's tolerance.
Quantization settings are carried only where the weights are quantized: a merged QLoRA export holds
dequantized weights, and its config.json no quantization_config (finding 6: the base's was copied, and
from_pretrained built 4-bit layers around plain weights, which failed at the first forward).

Every run is short (1 step); bin/export's main runs for each in one process, and the exports load together
in another, fresh one."""

import json
import subprocess
import sys

import pytest
import torch
from helpers import FAST, QLORA, ROOT, env_for, qlora_base, train

pytestmark = pytest.mark.e2e

BASE = {**FAST, "model.config.n_layer": 1, "data.eval_fraction": 0, "train.micro_batch_size": 2, "data.seq_len": 64,
        "train.max_steps": 1, "checkpoint.every_steps": 0, "checkpoint.save_final": True, "optim.lr": 1e-2,
        "optim.warmup_steps": 0}  # fmt: skip
FP32 = {"train.precision": "fp32"}
PRETRAINED = {"model.config": None, "model.chunked_loss": False}
LORA = {"model.lora": {"r": 4, "alpha": 8, "dropout": 0.0}}

# kind -> (the experiment's settings given the pretrained bases, the tolerance of the logits: (mean, max)
# absolute differences against the training forward)
KINDS = {
    "random init": (lambda b: {**FP32}, (1e-5, 1e-4)),
    "pretrained fp32": (lambda b: {**PRETRAINED, **FP32, "model.pretrained": b["fp32"]}, (1e-5, 1e-4)),
    # the training forward computes with bf16 weights, the export holds the fp32 masters (rounded here)
    "pretrained bf16": (
        lambda b: {**PRETRAINED, "train.precision": "bf16", "model.pretrained": b["fp32"]},
        (1e-2, 5e-2),
    ),
    "lora": (lambda b: {**LORA, **FP32}, (1e-5, 1e-4)),
    # the training forward dequantizes NF4 in bf16; the export holds the dequantized weights merged
    "qlora": (lambda b: {**PRETRAINED, **QLORA, "model.pretrained": b["fp32"]}, (5e-3, 3e-2)),
    "qlora over a 4-bit checkpoint": (
        lambda b: {**PRETRAINED, **QLORA, "model.pretrained": b["4bit"], "train.precision": "fp32"},
        (1e-5, 1e-4),
    ),  # fmt: skip
    "dpo": (
        lambda b: {
            **PRETRAINED,
            **FP32,
            **LORA,
            "model.pretrained": b["fp32"],
            "train.objective": "dpo",
            "data.train": {"files": str(ROOT / "data/tiny/python_prefs.jsonl"), "kind": "preference"},
            "data.seq_len": 128,
        },
        (1e-5, 1e-4),
    ),  # fmt: skip
}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """A small pretrained Llama (fp32 safetensors), and the same model stored in 4 bits (bitsandbytes
    NF4 with double quantization: its config.json has a quantization_config)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    d = tmp_path_factory.mktemp("bases")
    fp32 = qlora_base(d, small=True)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.float32)  # fmt: skip
    m = AutoModelForCausalLM.from_pretrained(
        fp32, quantization_config=quant, dtype=torch.float32, device_map={"": "cpu"}
    )
    m.save_pretrained(d / "base-4bit")
    assert "quantization_config" in json.loads((d / "base-4bit" / "config.json").read_text())
    return {"fp32": str(fp32), "4bit": str(d / "base-4bit")}


@pytest.fixture(scope="module")
def exported(tmp_path_factory, bases):
    out = {}
    root = tmp_path_factory.mktemp("exports")
    runs = {}
    for kind, (sets, _) in KINDS.items():
        name = kind.replace(" ", "_")
        runs[kind] = train(root / name, {**BASE, **sets(bases)})
        out[kind] = (root / f"{name}-hf", runs[kind].debug_dir / "probe.pt")
    # bin/export's main for each, in one process (its start-up once)
    script = "import sys\nfrom trainer.checkpoint.export import main\nfor a, b in zip(sys.argv[1::2], sys.argv[2::2]):\n" \
             "    assert main([a, b]) == 0, a\n"  # fmt: skip
    args = [str(x) for kind in KINDS for x in (runs[kind].run_dir, out[kind][0])]
    p = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, env=env_for(1), capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    # every export loaded in one fresh process, as a user's script would
    script = (
        "import json, sys, torch\nfrom transformers import AutoModelForCausalLM\nres = {}\n"
        "for kind, (hf, probe) in json.loads(sys.argv[1]).items():\n"
        "    p = torch.load(probe)\n"
        "    m = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()\n"
        "    with torch.no_grad():\n        d = (m(input_ids=p['input_ids']).logits.float() - p['logits']).abs()\n"
        "    res[kind] = [d.mean().item(), d.max().item()]\n"
        "print(json.dumps(res))\n"
    )
    arg = json.dumps({k: [str(a), str(b)] for k, (a, b) in out.items()})
    p = subprocess.run([sys.executable, "-c", script, arg], cwd=ROOT, env=env_for(1), capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    return out, json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_of_export_loads_and_gives_the_training_logits(exported, kind):
    dirs, diffs = exported
    mean, worst = diffs[kind]
    tol = KINDS[kind][1]
    print(
        f"{kind:32} logits against the training forward: mean {mean:.2e}, max {worst:.2e} (tolerance {tol})"
    )
    assert mean <= tol[0] and worst <= tol[1], (kind, mean, worst)
    config = json.loads((dirs[kind][0] / "config.json").read_text())
    assert "quantization_config" not in config, "merged weights are not quantized: no quantization settings"
