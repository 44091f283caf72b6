"""train.objective kto (issue 74 item 2) on real launchers: LoRA at ZeRO-3 over unpaired rows logs the same loss at
every step whether the step is one micro batch of 4, 4 accumulated micro batches of 1 or 2 ranks of 2 (the KL
reference point the mean over the step's mismatched pairs, every rank's: TRL's per-micro-batch estimate would
differ), with the KL non-zero in some of them; the eval (8 rows held out) logs the same loss and KL from every split
(its KL the mean over the eval set's pairs, every rank's); a resume from step 4 logs the uninterrupted losses bit
for bit."""

import json

import pytest
from helpers import NODROP, ROOT, split_losses, train

pytestmark = pytest.mark.dist

FEEDBACK = ROOT / "data" / "tiny" / "python_feedback.jsonl"


@pytest.fixture(scope="module")
def feedback(tmp_path_factory):
    """The first 24 rows (labels mixed) to train on, and 8 of them to evaluate on (where the policy's KL to its
    reference rises above 0, as it does on the training rows: held-out rows' stayed at 0)."""
    d = tmp_path_factory.mktemp("feedback")
    lines = FEEDBACK.read_text().splitlines()
    (d / "feedback.jsonl").write_text("".join(x + "\n" for x in lines[:24]))
    (d / "eval.jsonl").write_text("".join(x + "\n" for x in lines[8:16]))
    return d / "feedback.jsonl"


def kto_sets(data, **kw):
    return {"data.train.files": str(data), "data.train.kind": "unpaired", "data.eval_fraction": 0,
            "data.eval": {"files": str(data.parent / "eval.jsonl"), "kind": "unpaired"},
            "data.num_workers": 0, "train.objective": "kto", "train.kto.desirable_weight": 1.2,
            "model.config.n_layer": 2, "model.lora": {"r": 4, "alpha": 8, "dropout": 0.0},
            "strategy.zero_stage": 3, "train.max_steps": 8, "train.log_every": 1, "train.eval_every": 2,
            "optim.lr": 1e-2, "optim.warmup_steps": 0, "checkpoint.every_steps": 4, "checkpoint.keep_last": 0,
            **NODROP, **kw}  # fmt: skip


def test_kto_with_lora_at_zero3_is_split_invariant_and_resumes_exactly(tmp_path, feedback):
    runs = {}
    split_losses(
        tmp_path, lambda split: kto_sets(feedback, **split), check=lambda r: runs.setdefault(len(runs), r)
    )
    two = runs[2]
    assert (
        "objective: kto (beta 0.1, weights 1.2/1; the KL reference point the mean over the step's"
        in two.output
    )
    assert "ZeRO stage 3" in two.output
    recs = [m for m in two.metrics if "rewards_chosen" in m or "kl" in m]
    kls = [m["kl"] for m in recs]
    assert len(recs) == 8 and all(m["rows"] == 4 for m in recs) and max(kls) > 1e-3, kls
    for r in runs.values():  # the KL logged alike by every split (fp32: step 1's is 0 +- noise)
        assert [m["kl"] for m in r.metrics if "kl" in m] == pytest.approx(kls, rel=1e-4, abs=1e-5)
    evals = {
        n: [(m["eval_loss"], m.get("eval_kl")) for m in r.metrics if "eval_loss" in m]
        for n, r in runs.items()
    }
    assert len(evals[0]) == 4 and any(kl for _, kl in evals[0]), evals  # (the eval set's KL: not only 0)
    flat = [v for e in evals[0] for v in e]
    for n in (1, 2):  # the eval set's KL and loss whatever its split (the review: each rank clamped its own)
        assert [v for e in evals[n] for v in e] == pytest.approx(flat, rel=1e-4, abs=1e-6), (
            evals
        )  # (fp32 sums)
    ckpt = two.run_dir / "checkpoints" / "step_00000004"
    b = train(tmp_path / "resumed", kto_sets(feedback, **{"train.micro_batch_size": 2}), launcher="torchrun",
              nproc=2, extra_args=["--resume", str(ckpt)])  # fmt: skip
    assert {s: v for s, v in b.losses.items() if s > 4} == {s: v for s, v in two.losses.items() if s > 4}
    print("kto kl by step:", json.dumps(kls))
