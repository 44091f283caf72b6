"""Resuming on another world size or ZeRO stage (2 ranks through torchrun, or 1 process), and
exporting a ZeRO-3 checkpoint to a Hugging Face model directory. (The launcher plays no part here;
torchrun starts a job with one process fewer than the deepspeed launcher.)"""

import json
import subprocess

import pytest
from helpers import K, ROOT, env_for, steps_after
from helpers import resume_sets as sets
from helpers import train as _train

pytestmark = pytest.mark.dist

# ----------------------------------------------------------------------------- another world size or stage

NODROP = {"model.config.resid_pdrop": 0, "model.config.embd_pdrop": 0, "model.config.attn_pdrop": 0}


@pytest.fixture(scope="session")
def sources(tmp_path_factory, small_data):
    """Uninterrupted runs without dropout, per (ranks, stage): the reference and the checkpoint."""
    cache = {}

    def get(ranks, stage):
        if (ranks, stage) not in cache:
            s = sets(small_data, stage, **NODROP, **{"train.micro_batch_size": 8 // ranks})
            tmp = tmp_path_factory.mktemp(f"src{ranks}_{stage}")
            cache[(ranks, stage)] = _train(tmp, s, launcher="torchrun" if ranks > 1 else "none")
        return cache[(ranks, stage)]

    return get


@pytest.mark.parametrize(
    ("src", "dst"),
    [((2, 2), (1, 2)), ((1, 2), (2, 3)), ((2, 2), (2, 3)), ((2, 0), (2, 2))],
    ids=["2r-z2-to-1r-z2", "1r-z2-to-2r-z3", "z2-to-z3", "z0-to-z2"],
)
def test_resume_on_another_world_size_or_stage(tmp_path, small_data, sources, src, dst):
    """The global batch is kept (micro = 8 / ranks), so the first step after the resume sees the
    batch the uninterrupted run saw, evaluated on the saved weights: same loss within 1e-5. The next
    steps match within 1e-5 too, which needs the Adam moments, its step count and the per-group
    weight decay restored."""
    a = sources(*src)
    ranks, stage = dst
    s = sets(small_data, stage, **NODROP, **{"train.micro_batch_size": 8 // ranks})
    ckpt = a.run_dir / "checkpoints" / "step_00000006"
    b = _train(tmp_path, s, launcher="torchrun" if ranks > 1 else "none", extra_args=["--resume", str(ckpt)])
    assert f"resumed from {ckpt} at step 6" in b.output
    assert (ckpt / "universal" / "CONVERTED").exists() or src[0] == 0 or dst[1] == 0
    after = steps_after(b, K)
    assert sorted(after) == list(range(K + 1, 2 * K + 1))
    for step, loss in after.items():
        ref = a.losses[step]
        assert abs(loss - ref) <= 1e-5 * abs(ref), f"step {step}: {loss} vs {ref}"
def test_export_from_stage3_gives_the_engines_logits(tmp_path, sources):
    """bin/export of a 2-rank ZeRO-3 checkpoint loads with from_pretrained and gives the same logits."""
    import sys

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    a = sources(2, 3)
    out = tmp_path / "hf"
    p = subprocess.run([sys.executable, str(ROOT / "bin" / "export"), str(a.run_dir), str(out)], cwd=ROOT,
                       env=env_for(1), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "exported" in p.stdout and "step 12" in p.stdout
    probe = torch.load(a.debug_dir / "probe.pt")
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits
    assert torch.allclose(logits, probe["logits"], rtol=1e-5, atol=1e-5), (logits - probe["logits"]).abs().max()
    assert AutoTokenizer.from_pretrained(out)("abc", add_special_tokens=False)["input_ids"] == [97, 98, 99]
    assert json.loads((out / "training" / "ds_config.json").read_text())["zero_optimization"]["stage"] == 3
