"""Fine-tuning data through bin/train: chat rows, masked to the assistant turns, packed with
per-example positions. A step's loss is the mean over every target token of the step, however the
global batch is split into micro batches, accumulation and ranks (and with the chunked loss)."""

import pytest
from helpers import chat_data, train

pytestmark = pytest.mark.dist

NO_DROPOUT = {f"model.config.{k}": 0.0 for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}


def sft_sets(data, **kw):
    return {
        "data.train.files": str(data),
        "data.train.kind": "chat",
        "data.eval_fraction": 0,
        "data.num_workers": 0,
        "model.config.n_layer": 2,
        "train.max_steps": 6,
        "train.log_every": 1,
        "train.eval_every": 0,
        "train.eval_prompts": [],
        "checkpoint.save_final": False,
        **NO_DROPOUT,
        **kw,
    }


def test_the_step_loss_does_not_depend_on_how_the_batch_is_split(tmp_path):
    """4 packed rows per step (their target counts differ): micro 4 x 1 rank, micro 1 x accumulation
    4, micro 2 x 2 ranks (deepspeed launcher) log the same losses at every step (1e-6 relative): the
    same updates, as each step's loss depends on the weights the steps before left; and the same
    with model.chunked_loss. Without the normalization, a mean of per-micro-batch means, micro 1 x 4
    differs from micro 4 x 1 from the first step (see the closing note of issue 18)."""
    data = chat_data(tmp_path / "chat.jsonl")
    splits = {
        "micro4": ({"train.micro_batch_size": 4, "train.grad_accum": 1}, "none", 1),
        "accum4": ({"train.micro_batch_size": 1, "train.grad_accum": 4}, "none", 1),
        "2ranks": ({"train.micro_batch_size": 2, "train.grad_accum": 1}, "deepspeed", 2),
    }
    losses = {}
    for name, (split, launcher, n) in splits.items():
        r = train(tmp_path / name, sft_sets(data, **split), launcher=launcher, nproc=n, debug=False)
        losses[name] = r.losses
        assert "fine-tuning data (chat): 400 of 400 examples" in r.output
    ref = losses["micro4"]
    assert sorted(ref) == list(range(1, 7)) and ref[6] < ref[1]
    for name in ("accum4", "2ranks"):
        for step, value in ref.items():
            assert losses[name][step] == pytest.approx(value, rel=1e-6), (name, step, losses[name], ref)
    chunked = {}
    for name in ("micro4", "accum4"):
        split, launcher, n = splits[name]
        r = train(tmp_path / f"{name}-chunked", sft_sets(data, **split, **{"model.chunked_loss": True}),
                  launcher=launcher, nproc=n, debug=False)  # fmt: skip
        chunked[name] = r.losses
    for step, value in chunked["micro4"].items():
        assert chunked["accum4"][step] == pytest.approx(value, rel=1e-6), step
        assert value == pytest.approx(ref[step], rel=1e-5), step  # the chunked loss is the same loss
