"""Finding the checkpoint to resume from: complete ones only, verified by their manifest."""

import json

import pytest
import yaml
from helpers import TINY

from trainer import checkpoint as ck
from trainer import config
from trainer.common.errors import UserError


def make(root, step, files=None, latest=True, complete=True):
    tag = ck.tag_for(step)
    d = root / (tag if complete else ck.STAGING_PREFIX + tag)
    d.mkdir(parents=True)
    files = files or {"mp_rank_00_model_states.pt": b"x" * 100}
    for name, data in files.items():
        (d / name).write_bytes(data)
    state = {"step": step, "files": {n: len(b) for n, b in files.items()}, "world_size": 2, "zero_stage": 2}
    if complete:
        (d / ck.STATE).write_text(json.dumps(state))
        (d / "experiment.yaml").write_text(config.load(TINY).to_yaml())
    if latest and complete:
        (root / ck.LATEST).write_text(tag + "\n")
    return d


def test_latest_names_the_newest_complete(tmp_path):
    root = tmp_path / "checkpoints"
    make(root, 10)
    make(root, 20)
    make(root, 30, complete=False)  # a save that crashed: staging leftover, ignored
    found, warnings = ck.latest(root)
    assert found.step == 20 and not warnings


def test_a_damaged_latest_falls_back_to_the_previous_and_says_so(tmp_path):
    root = tmp_path / "checkpoints"
    make(root, 10)
    d = make(root, 20)
    (d / "mp_rank_00_model_states.pt").write_bytes(b"x" * 50)  # truncated
    found, warnings = ck.latest(root)
    assert found.step == 10
    assert "mp_rank_00_model_states.pt has 50 bytes, the manifest says 100" in warnings[0]
    (d / "mp_rank_00_model_states.pt").unlink()
    assert "is missing" in ck.latest(root)[1][0]


def test_latest_file_missing_or_pointing_nowhere(tmp_path):
    root = tmp_path / "checkpoints"
    make(root, 10)
    make(root, 20)
    (root / ck.LATEST).write_text("step_00000099\n")
    assert ck.latest(root)[0].step == 20
    (root / ck.LATEST).unlink()
    assert ck.latest(root)[0].step == 20


def test_resolve_resume_modes(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(UserError, match=r"nothing to resume.*looked in .*checkpoints"):
        ck.resolve_resume("latest", "never", run)
    assert ck.resolve_resume(None, "auto", run) == (None, [])  # auto: start fresh
    assert ck.resolve_resume(None, "never", run) == (None, [])
    make(run / "checkpoints", 10)
    assert ck.resolve_resume(None, "auto", run)[0].step == 10
    assert ck.resolve_resume("latest", "never", run)[0].step == 10
    with pytest.raises(UserError, match="already holds checkpoints"):
        ck.resolve_resume(None, "never", run)  # a fresh start would mix two runs
    for path in (run, run / "checkpoints", run / "checkpoints" / "step_00000010"):
        assert ck.resolve_resume(str(path), "never", run)[0].step == 10
    with pytest.raises(UserError, match="not a checkpoint"):
        ck.resolve_resume(str(tmp_path), "never", run)


def test_an_explicit_damaged_checkpoint_is_an_error(tmp_path):
    d = make(tmp_path / "checkpoints", 10)
    (d / "mp_rank_00_model_states.pt").unlink()
    with pytest.raises(UserError, match="damaged.*mp_rank_00_model_states.pt is missing"):
        ck.resolve_resume(str(d), "never", tmp_path)


def test_compatibility(tmp_path):
    d = make(tmp_path / "checkpoints", 10)
    found = ck.Found(d, ck.read_state(d))
    harmless = config.load(
        TINY,
        [
            "train.max_steps=500",
            "logging.level=debug",
            "checkpoint.every_steps=7",
            "strategy.zero_stage=3",
            "train.micro_batch_size=8",
            "data.num_workers=0",
            "model.chunked_loss=true",
            "model.activation_checkpointing=true",
        ],
    )
    diffs = ck.check_compatible(found, harmless)
    assert "train.max_steps" in diffs and "strategy.zero_stage" in diffs and "model.chunked_loss" in diffs
    # A checkpoint written before an option existed has no value for it: new defaults resume.
    saved = yaml.safe_load((d / "experiment.yaml").read_text())
    del saved["model"]["chunked_loss"]
    (d / "experiment.yaml").write_text(yaml.safe_dump(saved))
    assert ck.check_compatible(found, config.load(TINY)) == []
    # Written before model.attn_implementation's default became auto (null then): the same model, so a
    # resume goes on, as it does onto another kernel.
    saved["model"]["attn_implementation"] = None
    (d / "experiment.yaml").write_text(yaml.safe_dump(saved))
    assert ck.check_compatible(found, config.load(TINY)) == ["model.attn_implementation"]
    assert ck.check_compatible(found, config.load(TINY, ["model.attn_implementation=eager"])) == [
        "model.attn_implementation"
    ]
    with pytest.raises(UserError) as e:
        ck.check_compatible(found, config.load(TINY, ["model.config.n_layer=3", "data.seq_len=64", "seed=1"]))
    text = str(e.value)
    assert "model.config.n_layer: checkpoint has 4, the experiment now has 3" in text
    assert "data.seq_len" in text and "seed" in text


def test_differences_are_dotted_paths():
    a = yaml.safe_load("a: {b: 1, c: [1, 2]}\nd: 2")
    b = yaml.safe_load("a: {b: 2, c: [1, 2]}\ne: 3")
    assert ck.differences(a, b) == ["a.b", "d", "e"]


def test_latest_is_followed_unless_a_commit_stopped_before_replacing_it(tmp_path):
    """A plain resume takes what `latest` names, but for the one case a crash makes: a single newer
    checkpoint whose save began with `latest` naming that one (its `previous`), committed and stopped before
    `latest` was replaced. A rollback written into `latest` by hand, or a line abandoned before rollbacks
    were moved aside, is followed (and the newer line left to the resume's rollback handling)."""
    root = tmp_path / "checkpoints"
    for step, previous in ((10, None), (20, "step_00000010"), (30, "step_00000020")):
        d = make(root, step)
        state = json.loads((d / ck.STATE).read_text())
        (d / ck.STATE).write_text(json.dumps({**state, "previous": previous}))
    (root / ck.LATEST).write_text("step_00000020\n")  # the commit of 30 stopped before `latest`
    found, warnings = ck.latest(root)
    assert found.step == 30 and not warnings
    (root / ck.LATEST).write_text("step_00000010\n")  # a rollback to 10 written by hand: 20 and 30 are newer
    found, warnings = ck.latest(root)
    assert found.step == 10 and "names step_00000010, older than step_00000020, step_00000030" in warnings[0]


def test_auto_never_starts_fresh_over_checkpoints_it_cannot_resume(tmp_path):
    run = tmp_path / "run"
    d = make(run / "checkpoints", 10)
    (d / "mp_rank_00_model_states.pt").write_bytes(b"x" * 10)  # truncated: the only checkpoint is damaged
    with pytest.raises(UserError, match="holds checkpoints but none can be resumed"):
        ck.resolve_resume(None, "auto", run)
