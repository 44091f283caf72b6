"""What a GPU lease runs, tried where no GPU is (issue 62): a lease is 15 minutes that come by chance, and a
typo in one of its runs, a recipe that cannot run, or a carry that does not fit loses one.

- every run bench/gpu.sh's `finetune` and `unsloth` leases name parses: ours' --set keys against the
  experiment's schema, the recipe's and Unsloth's arguments against bench/finetune.py's parser;
- the recipe (bench/finetune.py hf) runs at a micro batch other than 1 and keeps the step's tokens;
- `collect` finds the recipe's best micro batch and Unsloth's, and the ratios the issue's targets name;
- bench/carry.py's trim keeps a wheel installable: RECORD lists what is left, with its hashes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import carry, finetune  # noqa: E402
from trainer import config  # noqa: E402

SPEC = re.compile(r'^\s+"((?:ours|hf|unsloth)_\w+)\|([^"]*)"$', re.M)


def specs() -> list[tuple[str, str]]:
    found = SPEC.findall((ROOT / "bench" / "gpu.sh").read_text())
    assert len(found) >= 20, found  # the finetune and unsloth lists
    return found


def test_every_run_of_the_fine_tuning_leases_parses():
    exp = ROOT / "configs" / "experiments" / "llama3-8b-qlora.yaml"
    fixed = ["model.pretrained=/tmp/llama8b", "train.max_steps=8", "train.global_batch_size=4",
             "optim.implementation=torch", "strategy.headroom=0.9"]  # fmt: skip
    names = set()
    for name, args in specs():
        names.add(name)
        if name.startswith("ours_"):
            config.load(str(exp), fixed + args.split())  # a ConfigError names the key
        else:
            side = name.split("_")[0]
            argv = [side, name, "--base", "/tmp/b", "--json", "/tmp/j", *shlex.split(args)]
            parsed = finetune.parse(argv)  # exits 2 with the reason on a bad argument or micro batch
            assert parsed.cmd == side and parsed.name == name
    # the targets need these: ours at micro auto and 1 x 4, the recipe at 1 x 4 and its best, Unsloth
    assert {"ours_qlora", "ours_qlora_m1", "hf_qlora", "hf_qlora_m2", "hf_qlora_m4", "ours_lora", "hf_lora",
            "unsloth_qlora", "unsloth_qlora_m4"} <= names  # fmt: skip


def test_the_recipe_refuses_a_micro_batch_that_changes_the_steps_tokens():
    r = subprocess.run([sys.executable, "bench/finetune.py", "hf", "x", "--base", "/nonexistent", "--micro", "3",
                        "--json", "/tmp/x.json"], cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2 and "--micro 3: must divide 4" in r.stderr, r.stderr


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, vocab_size=256,
                               max_position_embeddings=finetune.SEQ)  # fmt: skip
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("base")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out


def test_the_recipe_runs_at_its_other_micro_batches(tiny_base, tmp_path):
    out = tmp_path / "hf_lora_m2.json"
    r = subprocess.run([sys.executable, "bench/finetune.py", "hf", "hf_lora_m2", "--base", str(tiny_base), "--quant",
                        "none", "--micro", "2", "--steps", "1", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())
    assert (got["micro"], got["accumulation"], got["tokens_per_step"]) == (2, 2, 8192), got
    assert got["side"] == "hf" and got["steps"] == 1 and got["tokens_per_s"] > 0


def test_collect_finds_each_sides_best_micro_batch_and_the_ratios(tmp_path):
    def side(
        name: str, tps: float, micro: int = 1, quant: str = "4bit", dropout: float = 0.05, peak=None
    ) -> None:  # noqa: ANN001
        who = name.split("_")[0]
        row = {"name": name, "side": who, "quant": quant, "dropout": dropout, "micro": micro,
               "tokens_per_s": tps, "step_s": 8192 / tps, "peak_bytes": peak}  # fmt: skip
        (tmp_path / f"{name}.json").write_text(json.dumps(row))

    def ours(
        name: str,
        tps: float,
        peak: int,
        plan_gb: float,
        model: str = "8,030,261,248 frozen, 6,979,321,856 of them in 4-bit nf4",
    ) -> None:
        rows = [{"tokens_per_s": tps, "step_time_s": 8192 / tps, "peak_memory_bytes": peak}] * 6
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tmp_path / f"{name}.log").write_text(
            f"12:00:00 model: 8,072,204,288 parameters ({model})\n12:00:00 strategy: ZeRO stage 0\n"
            f"12:00:00 memory per rank (estimate): {plan_gb} GB\n"
        )

    ours("ours_qlora", 6000, 10 * 2**30, 11.0)
    ours("ours_lora", 9000, 30 * 2**30, 31.5, "8,030,261,248 frozen")
    ours("ours_qlora_d0", 6600, 10 * 2**30, 11.0)
    side("hf_qlora", 3000, peak=12 * 2**30)
    side("hf_qlora_m2", 3600, micro=2)
    side("hf_qlora_m4", 4000, micro=4)
    side("hf_qlora_d0", 5000, dropout=0.0)  # not at the same dropout: no part of the "best"
    side("hf_lora", 4500, quant="none", peak=20 * 2**30)
    side("unsloth_qlora", 5000)
    side("unsloth_qlora_m4", 5500, micro=4)
    side("unsloth_qlora_d0", 6000, dropout=0.0)
    r = subprocess.run([sys.executable, "bench/finetune.py", "collect", str(tmp_path)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0 and "hf_qlora_m4" in r.stdout, r.stderr[-2000:]
    got = json.loads((tmp_path / "finetune.json").read_text())
    assert got["ratio_qlora"] == pytest.approx(2.0)
    assert (got["ratio_qlora_best"], got["ratio_qlora_best_against"]) == (pytest.approx(1.5), "hf_qlora_m4")
    assert (got["ratio_qlora_unsloth"], got["ratio_qlora_unsloth_against"]) == (
        pytest.approx(6000 / 5500),
        "unsloth_qlora_m4",
    )
    assert got["ratio_qlora_unsloth_d0"] == pytest.approx(1.1)
    assert got["ratio_lora"] == pytest.approx(2.0) and got["ratio_lora_best"] == pytest.approx(2.0)
    assert got["ratio_lora_unsloth"] is None  # no Unsloth bf16 run
    assert got["peak_ratio_qlora"] == pytest.approx(10 / 12) and got["peak_ratio_lora"] == pytest.approx(1.5)
    runs = got["runs"]
    assert runs["ours_lora"]["quant"] == "none" and runs["ours_qlora"]["quant"] == "4bit"
    assert runs["ours_qlora"]["plan_over_peak"] == pytest.approx(1.1)


def wheel(path: Path, members: dict[str, bytes]) -> Path:
    record = "pkg-1.0.dist-info/RECORD"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
        z.writestr(record, "".join(f"{n},sha256=x,{len(d)}\n" for n, d in members.items()) + f"{record},,\n")
    return path


def test_a_trimmed_wheel_lists_what_is_left_with_its_hashes(tmp_path):
    members = {
        "bitsandbytes/__init__.py": b"x = 1\n",
        "bitsandbytes/libbitsandbytes_cuda118.so": b"\0" * 1000,
        "bitsandbytes/libbitsandbytes_cuda130.so": b"\1" * 1000,
        "bitsandbytes/libbitsandbytes_cpu.so": b"\2" * 10,
        "bitsandbytes/libbitsandbytes_rocm64.so": b"\3" * 1000,
        "pkg-1.0.dist-info/METADATA": b"Name: pkg\n",
    }
    w = wheel(tmp_path / "bitsandbytes-1.0-py3-none-any.whl", members)
    before, after = carry.trim(w, carry.bnb_drop("130"))
    assert after < before
    with zipfile.ZipFile(w) as z:
        names = set(z.namelist())
        record = z.read("pkg-1.0.dist-info/RECORD").decode().splitlines()
        kept = {"bitsandbytes/__init__.py", "bitsandbytes/libbitsandbytes_cuda130.so",
                "bitsandbytes/libbitsandbytes_cpu.so", "pkg-1.0.dist-info/METADATA"}  # fmt: skip
        assert names == kept | {"pkg-1.0.dist-info/RECORD"}
        for line in record[:-1]:
            name, digest, size = line.rsplit(",", 2)
            data = z.read(name)
            want = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert (digest, int(size)) == (f"sha256={want}", len(data))
        assert {line.rsplit(",", 2)[0] for line in record} == names
    assert carry.unsloth_drop("studio/frontend/x.js") and not carry.unsloth_drop("unsloth/__init__.py")


QWEN3_06B = ('{"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, '
             '"num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 4096, '
             '"tie_word_embeddings": true}')  # fmt: skip


def test_grpo_lease_trl_side_runs_the_gpu_job_shape(tmp_path):
    """bench/grpo.py --trl-side --job: TRL's GRPOTrainer on the GPU job's batch (8 prompts x G 8 a step, one
    generate call), a tiny shape in fp32 here: its step time and generation's share come back."""
    shape = json.dumps({"model_type": "qwen3", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 128})  # fmt: skip
    job = {
        "shape": shape,
        "tokenizer": "byte",
        "precision": "fp32",
        "micro": 16,
        "accum": 4,
        "generations": 8,
    }
    out = tmp_path / "trl.json"
    r = subprocess.run([sys.executable, "bench/grpo.py", "--trl-side", str(out), "--steps", "7", "--max-new-tokens", "4",
                        "--job", json.dumps(job)], cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["device"] == "cpu" and got["job"] == job and len(got["step_times_s"]) >= 2
    assert got["gradient_checkpointing"] is False  # the review's: TRL's default (on) against ours off
    assert 0 < got["generation_share"] < 1 and got["completion_length"] <= 4


def test_grpo_lease_collect_puts_the_decode_step_against_its_floor(tmp_path):
    from bench import grpo

    rows = [{"step": i, "step_time_s": 4.0, "tokens_per_s": 1.0, "generation_share": 0.75, "generation_s": 3.0,
             "completion_length": 256} for i in range(1, 11)]  # fmt: skip
    for name, scale in (("grpo_batched", 1.0), ("grpo_static", 0.5)):
        lines = [json.dumps({**r, "step_time_s": r["step_time_s"] * scale, "generation_s": r["generation_s"] * scale})
                 for r in rows]  # fmt: skip
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "trl.json").write_text(json.dumps({"step_s": 6.0, "completion_length": 256, "generation_s": 5.0,
                                                   "generation_share": 0.8}))  # fmt: skip
    (tmp_path / "gpu.txt").write_text("name, memory.total [MiB]\nNVIDIA H200, 143771 MiB\n")
    got = grpo.collect(tmp_path, QWEN3_06B, 256, "byte")
    floor = got["decode_floor"]
    # Qwen3-0.6B's shape at the byte tokenizer's 257 tokens (tied): a layer's attention (q and o 1024 x 2048, k
    # and v 1024 x 1024, two head norms of 128), MLP (3 x 1024 x 3072) and two norms; the final norm, the embedding
    layer = 2 * 1024 * 2048 + 2 * 1024 * 1024 + 2 * 128 + 3 * 1024 * 3072 + 2 * 1024
    assert floor["parameters"] == 28 * layer + 1024 + 257 * 1024  # 0.44B outside the embedding, as published
    kv_token = 28 * 2 * 8 * 128 * 2
    assert floor["kv_bytes_mean"] == 64 * (floor["prompt_width"] + 128) * kv_token
    assert floor["floor_s"] == pytest.approx(floor["bytes_a_decode_step"] / 4.8e12)
    assert got["grpo_batched"]["decode_step_s"] == pytest.approx(3.0 / 256)
    assert got["grpo_static"]["decode_over_floor"] == pytest.approx(1.5 / 256 / floor["floor_s"])
    assert got["ours_over_trl_tokens_per_s"] == pytest.approx(1.5) and got[
        "static_over_dynamic"
    ] == pytest.approx(2.0)


def test_carry_names_the_cuda_library_it_keeps_or_refuses(tmp_path):
    """The review's: --cuda 12.8 (as torch prints it) kept no CUDA library at all, silently."""
    assert [carry.cuda_tag(v) for v in ("130", "13.0", "cu130", "12.8")] == ["130", "130", "130", "128"]
    with pytest.raises(SystemExit, match="a CUDA version"):
        carry.cuda_tag("latest")
    libs = {
        f"bitsandbytes/libbitsandbytes_{k}.so": b"\0" * 100 for k in ("cuda121", "cuda130", "cpu", "rocm64")
    }
    folder = tmp_path / "whl"
    folder.mkdir()
    wheel(folder / "bitsandbytes-1.0-py3-none-any.whl", libs)
    with pytest.raises(SystemExit, match="no library for CUDA 999"):
        carry.trim_all(folder, "999")
    carry.trim_all(folder, carry.cuda_tag("13.0"))
    with zipfile.ZipFile(folder / "bitsandbytes-1.0-py3-none-any.whl") as z:
        assert sorted(n for n in z.namelist() if n.endswith(".so")) == [
            "bitsandbytes/libbitsandbytes_cpu.so", "bitsandbytes/libbitsandbytes_cuda130.so"]  # fmt: skip


def test_carry_replaces_only_a_folder_of_wheels_inside_the_checkout(tmp_path, monkeypatch):
    """The review's: --dir named any folder, and it was emptied before the build, which then failed."""
    kept = tmp_path / "notes" / "notes.txt"
    kept.parent.mkdir()
    kept.write_text("keep")
    monkeypatch.setattr(carry, "ROOT", tmp_path)
    monkeypatch.setattr(sys, "argv", ["carry.py", "grpo", "--dir", str(kept.parent)])
    with pytest.raises(SystemExit, match="holds notes.txt, not only wheels"):
        carry.main()
    monkeypatch.setattr(carry, "ROOT", tmp_path / "elsewhere")
    with pytest.raises(SystemExit, match="outside the checkout"):
        carry.main()
    assert kept.read_text() == "keep"
