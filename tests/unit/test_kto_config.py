"""train.objective kto's bad input (issue 74): a row without a label (or with one that is not true or false) stops
the run with exit 2 naming the file's line and the fix, before a model loads (--prepare-data too); the config's
contradictions are refused by --print-config naming the key: unpaired rows with another objective, kto over
preference or chat data, train.kto with another objective, train_on_prompt, weights that are not positive, an
unknown loss type. A saved tiny-kto experiment validates as it was written (a resume compares the two)."""

import json

import pytest
from helpers import ROOT, cli, refused_by_print_config

EXP = ROOT / "configs" / "experiments" / "tiny-kto.yaml"

BAD = {
    "unpaired-with-dpo": (["train.objective=dpo"], ["data.train.kind", "train.objective: kto"]),
    "kto-over-pairs": (["data.train.kind=preference"], ["data.train.kind", "kind unpaired", "taken apart"]),
    "kto-over-chat": (["data.train.kind=chat"], ["data.train.kind", "kind unpaired"]),
    "kto-section-elsewhere": (["train.objective=dpo", "data.train.kind=preference", "train.kto.desirable_weight=2"],
                              ["train.kto", "is train.objective kto's"]),
    "train-on-prompt": (["data.train_on_prompt=true"], ["data.train_on_prompt", "set it false"]),
    "zero-weight": (["train.kto.undesirable_weight=0"], ["undesirable_weight"]),
    "loss-type": (["train.kto.loss_type=bco"], ["loss_type"]),
    "label-smoothing": (["train.preference.label_smoothing=0.1"], ["train.preference.label_smoothing", "kto has no"]),
    "gamma": (["train.preference.gamma=1.0"], ["train.preference.gamma", "remove it"]),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_kto_key_exits_2_naming_the_file_the_key_and_the_fix(name, tmp_path, capsys):
    refused_by_print_config(EXP, *BAD[name], tmp_path, capsys)


def test_a_saved_kto_experiment_validates_as_it_was_written():
    import yaml

    from trainer.config import load, validate

    exp = load(EXP, ["train.kto.loss_type=apo_zero_unpaired"])
    assert validate(yaml.safe_load(exp.to_yaml())).to_dict() == exp.to_dict()


@pytest.mark.parametrize("mode", ["run", "prepare-data"])
def test_a_row_without_a_label_exits_2_naming_its_line_before_a_model_loads(tmp_path, mode):
    rows = [{"prompt": "q0?", "completion": " yes", "label": True}, {"prompt": "q1?", "completion": " no"},
            {"prompt": "q2?", "completion": " maybe", "label": False}]  # fmt: skip
    path = tmp_path / "feedback.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = {"train.objective": "kto", "data.train.files": str(path), "data.train.kind": "unpaired",
            "data.eval_fraction": 0, "train.eval_every": 0, "train.max_steps": 2, "train.micro_batch_size": 1,
            "data.cache_dir": str(tmp_path / "cache"), "run_dir": str(tmp_path / "run"), "checkpoint.every_steps": 0}  # fmt: skip
    code, out = cli(sets, *(["--prepare-data"] if mode == "prepare-data" else []))
    assert code == 2 and "Traceback" not in out, out[-3000:]
    assert "feedback.jsonl:2" in out and "the row has no label" in out and "give true" in out, out[-3000:]
    assert "model:" not in out  # before the model


def test_a_resume_whose_labels_changed_is_refused_as_changed_data(tmp_path):
    """The labels are the training signal but not in the rows: a resume over the same rows with a label flipped
    (the same tokens) must be refused as other data, as a changed token is (checkpoint.on_data_change: error)."""
    rows = [{"prompt": f"q{i}?", "completion": f" a{i}", "label": i % 2 == 0} for i in range(8)]
    path = tmp_path / "feedback.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = {"train.objective": "kto", "data.train.files": str(path), "data.train.kind": "unpaired",
            "data.eval_fraction": 0, "train.eval_every": 0, "train.max_steps": 2, "train.micro_batch_size": 4,
            "data.cache_dir": str(tmp_path / "cache"), "run_dir": str(tmp_path / "run"), "checkpoint.every_steps": 2}  # fmt: skip
    code, out = cli(sets)
    assert code == 0, out[-3000:]
    rows[3]["label"] = not rows[3]["label"]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out = cli(
        {**sets, "train.max_steps": 4}, "--resume", str(tmp_path / "run" / "checkpoints" / "step_00000002")
    )
    assert code == 2 and "the training data differs" in out and "labels" in out, out[-3000:]


@pytest.mark.parametrize("objective", ["kto", "dpo"])
def test_overfit_batch_learns_one_fixed_batch_of_rows_and_pairs(objective, tmp_path):
    """--overfit-batch over preference rows crashed (a Pairs batch has no dim()); kto's step takes its KL from the
    fixed batch."""
    from helpers import bin_train

    dpo = ["--set", "train.objective=dpo", "--set", "data.train.kind=preference", "--set",
           f"data.train.files={ROOT / 'data' / 'tiny' / 'python_prefs.jsonl'}"]  # fmt: skip
    p = bin_train(EXP, "--overfit-batch", "--set", f"run_dir={tmp_path / 'run'}", "--set", "train.max_steps=30",
                  "--set", "train.micro_batch_size=4", "--set", "train.log_every=5", *(dpo if objective == "dpo" else []))  # fmt: skip
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "Traceback" not in out, out[-3000:]
    line = next(x for x in out.splitlines() if "overfit-batch: loss" in x)
    first, last = (float(v) for v in line.split("loss ")[1].split(" on ")[0].split(" -> "))
    assert last < first, line


@pytest.mark.parametrize("objective", ["kto", "dpo"])
def test_check_runs_its_checkpoint_round_trip_over_preference_rows(objective, tmp_path):
    """--check's probe batch was raw rows, which a preference objective cannot read (a traceback, exit 1: the
    review's finding for kto, and dpo's before it); its probe loss must come back exactly after the round trip
    (kto's probe takes its own pairs' KL, not the last step's)."""
    from helpers import bin_train

    dpo = ["--set", "train.objective=dpo", "--set", "data.train.kind=preference", "--set",
           f"data.train.files={ROOT / 'data' / 'tiny' / 'python_prefs.jsonl'}"]  # fmt: skip
    p = bin_train(EXP, "--check", "--set", f"run_dir={tmp_path / 'run'}", "--set", "train.micro_batch_size=4",
                  *(dpo if objective == "dpo" else []))  # fmt: skip
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "Traceback" not in out and "check: checkpoint round trip ok" in out, out[
        -3000:
    ]


def test_the_tokens_of_a_kto_step_are_counted_before_its_batches_are_taken():
    """KLStream takes the step's batches at its start; the tokens the loop then asked for were the next step's (the
    review: 3168, 2816, 3296 logged for steps of 2816, 3168, 2816)."""
    import types

    from trainer.objectives.kto import KLStream

    inner = types.SimpleNamespace(taken=0)
    inner.next = lambda: setattr(inner, "taken", inner.taken + 1)
    inner.step_tokens = lambda k: (
        1000 * (inner.taken + 1)
    )  # (the tokens of the batches the stream would give next)
    inner.loss_denominator = lambda k: None
    stream = KLStream(inner)
    stream.step_start = lambda batches: None
    stream.loss_denominator(2)
    assert stream.step_tokens(2) == 1000  # this step's, counted before its 2 batches were taken


def test_a_checkpoint_older_than_the_labels_digest_resumes_and_pairs_without_margins_have_none(tmp_path):
    """The second review: pairs' caches always hold margins.npy (NaN without a margin column), so every DPO
    checkpoint made before the digest was kept was refused on resume as 'the pairs' margins differ'. A fingerprint
    without the key is no difference; pairs without margins record None; a changed digest still is one."""
    import numpy as np

    from trainer.data import data_changes
    from trainer.data.keys import side_digests

    now = {
        "train_digest": "t",
        "train_sequences": 4,
        "sources": {},
        "tokenizer": "byte",
        "margins_digest": "m",
    }
    older = {k: v for k, v in now.items() if k != "margins_digest"}
    assert data_changes(older, now) == []
    assert data_changes({**now, "margins_digest": "other"}, now) != []
    assert data_changes({**now, "margins_digest": None}, now) != []  # (a margin column added since)
    np.save(tmp_path / "margins.npy", np.full(3, np.nan))
    assert side_digests(tmp_path) == {"margins_digest": None}
    np.save(tmp_path / "margins.npy", np.asarray([1.0, 0.0, np.nan]))
    assert side_digests(tmp_path)["margins_digest"] is not None


def test_pairs_taken_apart_hold_out_whole_pairs(tmp_path):
    """eval_fraction over pairs given as kind unpaired: an odd count held out put one pair's chosen response in
    training and its rejected one in the eval (the second review's suspicion): 23 pairs at 0.1 hold out 2 pairs
    (4 rows: 46 x 0.1 rounds to 5), never a half."""
    from trainer import config
    from trainer.data import build

    rows = [{"prompt": f"q{i}?", "chosen": f" yes {i}", "rejected": f" no {i}"} for i in range(23)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    exp = config.load(
        EXP, [f"data.train.files={path}", "data.eval_fraction=0.1", f"data.cache_dir={tmp_path}"]
    )
    data = build(exp.data, exp.seed)
    assert len(data.eval) % 2 == 0 and len(data.train) % 2 == 0, (len(data.train), len(data.eval))
    assert data.eval_margins.tolist() == [1.0, 0.0] * (len(data.eval) // 2)
