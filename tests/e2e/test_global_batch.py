"""train.global_batch_size and train.micro_batch_size: auto (issue 55 item 3), as a user runs them: the
banner says what micro batch was chosen and why, and the losses are those of the same global batch
written out by hand (bitwise with the chosen split; within fp32's reordering with another split)."""

import re

import pytest
from helpers import FAST, train

pytestmark = pytest.mark.e2e

SETS = {**FAST, "model.config.n_layer": 1, "data.eval_fraction": 0, "train.max_steps": 4, "data.seq_len": 64,
        "model.config.resid_pdrop": 0, "model.config.embd_pdrop": 0, "model.config.attn_pdrop": 0}  # fmt: skip


def test_micro_batch_auto_equals_the_global_batch_written_out(tmp_path):
    auto = train(tmp_path / "auto", {**SETS, "train.micro_batch_size": "auto", "train.global_batch_size": 8},
                 debug=False)  # fmt: skip
    m = re.search(r"micro_batch_size auto: (\d+) \(x accumulation (\d+) x 1 data-parallel", auto.output)
    assert m, auto.output[-3000:]
    micro, accum = int(m.group(1)), int(m.group(2))
    assert micro * accum == 8 and "the fastest that fits" in auto.output
    assert f"batch: micro {micro} x world 1 x grad_accum {accum} = 8 sequences" in auto.output
    hand = train(
        tmp_path / "hand", {**SETS, "train.micro_batch_size": micro, "train.grad_accum": accum}, debug=False
    )
    assert auto.losses == hand.losses
    other = (1, 8) if micro != 1 else (2, 4)
    split = train(tmp_path / "split", {**SETS, "train.micro_batch_size": other[0], "train.grad_accum": other[1]},
                  debug=False)  # fmt: skip
    for step, loss in auto.losses.items():
        assert abs(loss - split.losses[step]) <= 1e-5 * abs(loss), (step, loss, split.losses[step])
    print(f"micro auto chose {micro} x {accum}; losses {auto.losses}")


def test_a_global_batch_sets_the_accumulation_and_refuses_a_contradiction(tmp_path):
    """tiny.yaml writes grad_accum: 1, which a global batch of 8 at micro 2 contradicts: refused, naming it
    (nothing the user gave is dropped); at grad_accum 4 the split is as written."""
    sets = {**SETS, "train.micro_batch_size": 2, "train.global_batch_size": 8}
    r = train(tmp_path / "no", sets, debug=False, check=False)
    assert r.returncode == 2 and "train.grad_accum 1 contradicts train.global_batch_size 8" in r.stderr, (
        r.stderr[-2000:]
    )
    r = train(tmp_path / "g", {**sets, "train.grad_accum": 4}, debug=False)
    assert "batch: micro 2 x world 1 x grad_accum 4 = 8 sequences" in r.output, r.output[-3000:]
    assert "global batch 8 = micro 2 x 1 data-parallel rank(s) x accumulation 4" in r.output
