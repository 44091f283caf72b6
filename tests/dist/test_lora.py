"""LoRA (model.lora) on 2 ranks through the real launchers, at ZeRO stages 0, 1 (bf16), 2, 3, 2 with
CPU offload and 3 with parameters and optimizer offloaded, for gpt2 and llama: the loss falls, the base weights stay bit for bit what they were, the
adapters move and are the same on every rank, and every checkpoint's adapter/ (peft's format,
gathered from the partitions at ZeRO-3, verified before the checkpoint becomes visible) reloads with
peft to the engine's logits. The ZeRO-3 adapter equals the ZeRO-0 one of the same seed (the reported
failure of other trainers: a ZeRO-3 adapter saved as empty partitions). Resume is bitwise at stages
0-3; 2 ranks at stage 2 resume on 1 rank at stage 3. bin/export merged and --adapter from a
stage-3 checkpoint give the engine's logits."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from helpers import NODROP, K, Result, assert_same_continuation, check_memory, falling, resume_sets, train

from trainer.common.files import file_lock

pytestmark = pytest.mark.dist

# Adapters on a random base learn slowly: a higher learning rate, no warmup, for a loss that falls in 12 steps.
LORA = {"model.lora": {"r": 4, "alpha": 8, "dropout": 0.0}, "optim.lr": 1e-2, "optim.warmup_steps": 0}
# The base models LoRA fine-tunes, made once per session as from_pretrained directories (seeded random
# weights, the byte tokenizer's vocabulary): the same base at every stage, whatever ZeRO-3's own
# initialisation would draw.
BASES = {
    "gpt2": {"model_type": "gpt2", "n_layer": 2, "n_embd": 128, "n_head": 4, "n_positions": 256,
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "llama": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256},
}  # fmt: skip
# name -> (stage, offload, base, launcher, more settings); the offload case in bf16, with the chunked
# loss and activation checkpointing
CASES = {
    "zero0-gpt2": (0, "none", "gpt2", "deepspeed", {}),
    "zero1-llama": (1, "none", "llama", "torchrun", {"train.precision": "bf16"}),
    "zero2-llama": (2, "none", "llama", "torchrun", {}),
    "zero3-gpt2": (3, "none", "gpt2", "torchrun", {}),
    "zero3+cpu-gpt2": (3, "cpu", "gpt2", "torchrun", {}),
    "zero2+cpu-llama": (2, "cpu", "llama", "torchrun", {"train.precision": "bf16", "model.chunked_loss": True,
                                                          "model.activation_checkpointing": True}),
}  # fmt: skip


def base_dir(shared_dir: Path, family: str) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    out = shared_dir / f"lora-base-{family}"
    with file_lock(shared_dir / f"lora-base-{family}.lock"):
        if not (out / "config.json").exists():
            torch.manual_seed(0)
            cfg = AutoConfig.for_model(**BASES[family], vocab_size=257, bos_token_id=256, eos_token_id=256)
            AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out


def sets_for(data, shared_dir, name, **kw):
    stage, offload, family, _, more = CASES[name]
    extra = {"strategy.offload": offload, **more} if offload != "none" else dict(more)
    model = {"model.config": None, "model.pretrained": str(base_dir(shared_dir, family))}
    return resume_sets(data, stage, **NODROP, **LORA, **model, **extra, **kw)


@pytest.fixture(scope="session")
def lora_runs(shared_dir, small_data):
    """Run A per case: 2K steps with a checkpoint every K, made once per session."""
    cache: dict[str, Result] = {}

    def get(name: str) -> Result:
        if name not in cache:
            tmp = shared_dir / f"lora-{name}".replace("+", "_")
            done = tmp / "result.json"
            with file_lock(shared_dir / f"lora-{name}.lock".replace("+", "_")):
                if done.exists():
                    d = json.loads(done.read_text())
                    cache[name] = Result(
                        **{**d, "run_dir": Path(d["run_dir"]), "debug_dir": Path(d["debug_dir"])}
                    )
                else:
                    cache[name] = train(tmp, sets_for(small_data, shared_dir, name), launcher=CASES[name][3])
                    done.write_text(json.dumps(dataclasses.asdict(cache[name]), default=str))
        return cache[name]

    return get


def base_model(ckpt: Path) -> torch.nn.Module:
    """The pretrained base the run's experiment.yaml names (its frozen weights must still be these)."""
    import yaml
    from transformers import AutoModelForCausalLM

    exp = yaml.safe_load((ckpt / "experiment.yaml").read_text())
    return AutoModelForCausalLM.from_pretrained(exp["model"]["pretrained"]).eval()


def base_dir_of(ckpt: Path) -> Path:
    import yaml

    return Path(yaml.safe_load((ckpt / "experiment.yaml").read_text())["model"]["pretrained"])


def checkpoint_state(ckpt: Path) -> dict[str, torch.Tensor]:
    from trainer.checkpoint.export import consolidated_state_dict

    return consolidated_state_dict(ckpt)


def peft_reload(ckpt: Path) -> torch.nn.Module:
    from peft import PeftModel

    return PeftModel.from_pretrained(base_model(ckpt), str(ckpt / "adapter")).eval()


@pytest.mark.parametrize("name", list(CASES))
def test_lora_trains_on_two_ranks_with_frozen_base_and_a_sound_adapter(lora_runs, name):
    stage, offload, family, _, more = CASES[name]
    bf16 = more.get("train.precision") == "bf16"
    r = lora_runs(name)
    assert f"ZeRO stage {stage}, offload {offload}" in r.output
    assert "trainable = " in r.output and "frozen)" in r.output
    first, last = falling(r.losses)
    assert last < first * 0.97, f"loss did not fall: {first:.3f} -> {last:.3f}"
    digests = r.rank_reports()[0]["all_param_digests"]
    assert len(digests) == 2 and digests[0] == digests[1], "ranks hold different parameters"

    ckpt = r.run_dir / "checkpoints" / f"step_{2 * K:08d}"
    state = checkpoint_state(ckpt)
    base = base_model(ckpt).state_dict()
    prefix = "base_model.model."
    frozen = {k[len(prefix) :].replace(".base_layer", ""): v for k, v in state.items() if "lora_" not in k}
    assert set(base) - set(frozen) <= {"lm_head.weight"} and set(frozen) <= set(base)  # (tied to wte)
    for k, v in frozen.items():  # (in bf16 the engine holds the pretrained weights rounded, once)
        assert torch.equal(v, base[k].bfloat16().float() if bf16 else base[k]), (
            f"{k}: the frozen weight changed"
        )
    b = {k: v for k, v in state.items() if "lora_B" in k}
    assert b and all(v.abs().sum() > 0 for v in b.values()), "an adapter B matrix is still zero"
    # The checkpoint leaves the frozen base out (model.pretrained holds it): DeepSpeed's module states
    # hold the adapters alone, and no frozen fragments at ZeRO 2/3; the state records the base's digest.
    for f in ckpt.glob("*model_states.pt"):
        ms = torch.load(f, map_location="cpu", weights_only=False)
        assert ms["module"] and all("lora_" in k for k in ms["module"]), (f.name, sorted(ms["module"])[:5])
        assert not ms.get("frozen_param_fragments"), f.name
    rec = json.loads((ckpt / "trainer_state.json").read_text())["frozen_weights"]
    assert (
        rec["omitted"]
        and rec["pretrained"] == str(base_dir_of(ckpt))
        and re.fullmatch(r"(bfloat16|float32):[0-9a-f]{16}", rec["digest"])
    )

    from safetensors.torch import load_file

    saved = load_file(str(ckpt / "adapter" / "adapter_model.safetensors"))
    assert len(saved) == sum("lora_" in k for k in state)
    cfg = json.loads((ckpt / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["peft_type"] == "LORA"
    probe = torch.load(r.debug_dir / "probe.pt")
    with torch.no_grad():
        reloaded = peft_reload(ckpt)
        logits = (reloaded.bfloat16() if bf16 else reloaded)(input_ids=probe["input_ids"]).logits.float()
    tol = 2e-2 if bf16 else 1e-5  # bf16: the engine's kernels and peft's round differently
    torch.testing.assert_close(logits, probe["logits"], rtol=tol, atol=tol)
    if offload == "none":  # (offloaded states are not on the device: the plan counts none there)
        check_memory(r, name.split("-")[0])


def test_the_zero3_adapter_is_whole_and_equals_the_zero0_one(lora_runs):
    """What ZeRO-3 trainers get wrong: the saved adapter must hold full tensors (not the rank's
    partition, nor empty placeholders), the same values as a stage-0 run of the same seed."""
    from safetensors.torch import load_file

    tensors = {}
    for name in ("zero0-gpt2", "zero3-gpt2"):
        ckpt = lora_runs(name).run_dir / "checkpoints" / f"step_{2 * K:08d}" / "adapter"
        tensors[name] = load_file(str(ckpt / "adapter_model.safetensors"))
    z0, z3 = tensors["zero0-gpt2"], tensors["zero3-gpt2"]
    assert z0.keys() == z3.keys()
    for k, v in z0.items():
        assert z3[k].shape == v.shape and v.numel() > 0, k
        torch.testing.assert_close(z3[k], v, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["zero0-gpt2", "zero1-llama", "zero2-llama", "zero3-gpt2"])
def test_lora_resume_is_bitwise(tmp_path, shared_dir, small_data, lora_runs, name):
    a = lora_runs(name)
    d = a.run_dir / "checkpoints" / f"step_{K:08d}"
    b = train(
        tmp_path, sets_for(small_data, shared_dir, name), launcher="torchrun", extra_args=["--resume", str(d)]
    )
    assert f"resumed from {d} at step {K}" in b.output
    assert_same_continuation(a, b)


def test_a_resume_on_other_frozen_weights_is_refused_naming_the_pretrained_model(
    tmp_path, shared_dir, small_data
):
    """The checkpoints leave the base out, so a resume takes it from model.pretrained: a base whose
    weights changed since, at the same path (one weight nudged, as a re-export or a moved hub revision
    would), is refused before any step, exit 2, naming the path and the checkpoint."""
    import shutil

    from transformers import AutoModelForCausalLM

    base = tmp_path / "base"
    shutil.copytree(base_dir(shared_dir, "gpt2"), base)
    sets = {**sets_for(small_data, shared_dir, "zero0-gpt2"), "model.pretrained": str(base)}
    a = train(tmp_path, sets, debug=False)
    ckpt = a.run_dir / "checkpoints" / f"step_{2 * K:08d}"
    m = AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        m.transformer.h[0].mlp.c_fc.weight[0, 0] += 1e-3
    m.save_pretrained(base)
    b = train(
        tmp_path, {**sets, "train.max_steps": 2 * K + 2}, extra_args=["--resume"], debug=False, check=False
    )
    assert b.returncode == 2, b.output[-3000:]
    assert (
        f"{ckpt} was trained on frozen weights from model.pretrained={base}, which its checkpoints leave out: digest float32:"
        in b.output
    ), b.output[-3000:]
    assert "Restore the weights at model.pretrained as they were when the run started" in b.output
    assert "Traceback" not in b.output and max(b.losses) == 2 * K  # (run A's steps: none was added)


def test_lora_resumes_from_two_ranks_at_stage_2_on_one_rank_at_stage_3(
    tmp_path, shared_dir, small_data, lora_runs
):
    """The same rows per micro step (8 on one rank, 4 on each of two: the epochs end at the same
    step); fp32 sums over other row counts round differently."""
    a = lora_runs("zero2-llama")
    d = a.run_dir / "checkpoints" / f"step_{K:08d}"
    sets = sets_for(
        small_data, shared_dir, "zero2-llama", **{"strategy.zero_stage": 3, "train.micro_batch_size": 8}
    )
    b = train(tmp_path, sets, launcher="none", extra_args=["--resume", str(d)])
    assert f"resumed from {d} at step {K}" in b.output and "ZeRO stage 3" in b.output
    for step in range(K + 1, 2 * K + 1):
        assert b.losses[step] == pytest.approx(a.losses[step], rel=1e-5), step


def test_export_merged_and_adapter_from_a_zero3_checkpoint(tmp_path, lora_runs):
    import yaml
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer.checkpoint.export import export

    r = lora_runs("zero3-gpt2")
    ckpt = r.run_dir / "checkpoints" / f"step_{2 * K:08d}"
    probe = torch.load(r.debug_dir / "probe.pt")
    merged = AutoModelForCausalLM.from_pretrained(export(ckpt, tmp_path / "merged")).eval()
    assert not any("lora" in k for k in merged.state_dict())
    out = export(ckpt, tmp_path / "adapter", adapter=True)
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert (
        cfg["base_model_name_or_path"]
        == yaml.safe_load((ckpt / "experiment.yaml").read_text())["model"]["pretrained"]
    )
    adapted = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(cfg["base_model_name_or_path"]), out
    )
    with torch.no_grad():
        for m in (merged, adapted.eval()):
            torch.testing.assert_close(
                m(input_ids=probe["input_ids"]).logits, probe["logits"], rtol=1e-5, atol=1e-5
            )


def test_export_from_a_stage_1_checkpoint_of_a_config_base(tmp_path, small_data):
    """A base made from a config (seeded random weights nobody can name) stays in the checkpoints, and
    at ZeRO-1 DeepSpeed keeps frozen weights only in the module's state (it saves them apart at
    stages 2-3): bin/export's merged model and the adapter with its OUT/base give the engine's logits
    (before the fix: "the weights do not fit the model", the frozen weights missing)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer.checkpoint.export import export

    sets = resume_sets(small_data, 1, **NODROP, **LORA, **{"model.config": BASES["llama"]})
    r = train(tmp_path, sets, launcher="torchrun")
    ckpt = r.run_dir / "checkpoints" / f"step_{2 * K:08d}"
    assert json.loads((ckpt / "trainer_state.json").read_text())["frozen_weights"]["omitted"] is False
    probe = torch.load(r.debug_dir / "probe.pt")
    merged = AutoModelForCausalLM.from_pretrained(export(ckpt, tmp_path / "merged")).eval()
    out = export(ckpt, tmp_path / "adapter", adapter=True)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out / "base"), out).eval()
    with torch.no_grad():
        for m in (merged, adapted):
            torch.testing.assert_close(
                m(input_ids=probe["input_ids"]).logits, probe["logits"], rtol=1e-5, atol=1e-5
            )


def test_the_frozen_weights_digest_is_the_same_at_every_stage(lora_runs):
    """One base, fp32: the digest the checkpoints record is the same at ZeRO-0 (whole weights), ZeRO-3
    (gathered from the partitions) and ZeRO-3 with the parameters offloaded to the CPU."""
    digests = {}
    for name in ("zero0-gpt2", "zero3-gpt2", "zero3+cpu-gpt2"):
        ckpt = lora_runs(name).run_dir / "checkpoints" / f"step_{2 * K:08d}"
        digests[name] = json.loads((ckpt / "trainer_state.json").read_text())["frozen_weights"]["digest"]
    assert len(set(digests.values())) == 1 and digests["zero0-gpt2"].startswith("float32:"), digests


def test_check_passes_for_lora_with_a_warmup_from_zero(tmp_path, shared_dir, small_data):
    """`bin/train --check` takes one step and round-trips a checkpoint. With a warmup from LR 0 that
    step moves nothing, so LoRA's B matrices are still zero: the adapter's verification must not call
    that an empty adapter (it did, failing `bin/train configs/experiments/tiny-sft-lora.yaml --check`);
    it asks whether a step with a nonzero learning rate was taken."""
    sets = {**sets_for(small_data, shared_dir, "zero0-gpt2"), "optim.warmup_steps": 5}
    r = train(tmp_path, sets, extra_args=["--check"], debug=False, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "check passed" in r.stdout + r.stderr
