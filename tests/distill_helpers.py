"""The tiny teacher and student the distillation tests share (tests/unit/test_distill*.py): GPT-2s of the byte
tokenizer's vocabulary, random and seeded, saved as a checkout holds them; each module makes them its fixtures:
`teacher_dir = pytest.fixture(scope="module")(make_teacher)`."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

GPT2 = {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 256, "vocab_size": 257, "resid_pdrop": 0.0,
        "embd_pdrop": 0.0, "attn_pdrop": 0.0}  # fmt: skip
TEACHER = {**GPT2, "n_embd": 96, "n_layer": 3}


def make_teacher(tmp_path_factory):
    """A tiny GPT-2 teacher (3 layers of 96)."""
    out = tmp_path_factory.mktemp("teacher")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(**TEACHER)).save_pretrained(out)
    return out


def make_student(tmp_path_factory):
    """The student's initial weights saved (every ZeRO stage starts from them: zero.Init draws a config's
    initial weights otherwise than a plain build)."""
    out = tmp_path_factory.mktemp("student")
    torch.manual_seed(3)
    GPT2LMHeadModel(GPT2Config(**GPT2)).save_pretrained(out)
    return out


def qwen3_base_tokenizer(tmp_path):
    """Qwen3's published tokenizer with a base model's EOS (<|endoftext|>): its ChatML template ends a turn with
    <|im_end|>, which is no EOS id (the base models' case). Returns (its directory, the tokenizer)."""
    import json
    import shutil

    from helpers import ROOT
    from transformers import AutoTokenizer

    src, out = ROOT / ".cache" / "tokenizers" / "qwen3", tmp_path / "qwen3-base-tokenizer"
    out.mkdir()
    shutil.copy(src / "tokenizer.json", out)
    config = json.loads((src / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|endoftext|>"}))
    return out, AutoTokenizer.from_pretrained(out)


def gpt2_of(tok, path, width=16):
    """A one-layer GPT-2 of `tok`'s vocabulary, saved at `path`."""
    shape = {"n_layer": 1, "n_head": 2, "n_positions": 256, "vocab_size": len(tok), "bos_token_id": None,
             "eos_token_id": tok.eos_token_id}  # fmt: skip
    GPT2LMHeadModel(GPT2Config(n_embd=width, **shape)).save_pretrained(path)
    return path
