"""Durable, verified checkpoints on 2 ranks: every rank writes and fsyncs its own files and reports
them with their digests, the manifest holds every rank's report, and a resume checks the bytes (every
rank a share of the files) before anything loads. A shard zeroed in place (the same size, so the
manifest's sizes pass) is named, and the run resumes from the previous complete checkpoint with the
losses of the uninterrupted run; `--resume PATH` of the damaged one stops, naming the file."""

import json

import pytest
from helpers import FAST, train

pytestmark = pytest.mark.dist

# ZeRO-2: each rank writes its own optimizer shard
SETS = {**FAST, "train.max_steps": 12, "checkpoint.every_steps": 6, "checkpoint.keep_last": 0,
        "checkpoint.async": False, "strategy.zero_stage": 2, "strategy.justification": "test"}  # fmt: skip


@pytest.mark.parametrize("save", ["sync", "async"])
def test_a_shard_zeroed_in_place_is_named_and_the_previous_checkpoint_resumed(tmp_path, save):
    sets = {**SETS, "checkpoint.async": save == "async", "run_dir": str(tmp_path / "run")}
    a = train(tmp_path / "a", sets, launcher="torchrun")
    root = tmp_path / "run" / "checkpoints"
    state = json.loads((root / "step_00000012" / "trainer_state.json").read_text())
    assert set(state["digests"]) == set(state["files"]) and set(state["writers"].values()) == {0, 1}
    assert any("optim_states" in rel and r == 1 for rel, r in state["writers"].items()), state["writers"]
    # rank 1's optimizer shard, zeroed in the middle without changing its size
    shard = max((root / "step_00000012" / rel for rel, r in state["writers"].items() if r == 1),
                key=lambda p: p.stat().st_size)  # fmt: skip
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.seek(size // 2)
        f.write(bytes(min(4096, size // 4)))
    assert shard.stat().st_size == size
    if save == "sync":  # (how the files were written does not change what the check reads)
        # (the deepspeed launcher: it exits with the ranks' code, where torchrun's agent reports any failure as 1)
        explicit = train(tmp_path / "c", {**sets, "train.max_steps": 18}, launcher="deepspeed",
                         extra_args=["--resume", str(root / "step_00000012")], check=False)  # fmt: skip
        assert explicit.returncode == 2 and f"{shard} holds other bytes than were written" in explicit.output
    b = train(tmp_path / "b", {**sets, "train.max_steps": 18}, launcher="torchrun", extra_args=["--resume"])
    assert f"checkpoint {root / 'step_00000012'} is damaged ({shard} holds other bytes" in b.output, b.output[-3000:]
    assert "resuming from step_00000006 instead" in b.output
    print(f"{save}: {shard.name} zeroed in place; resumed from step_00000006")
    for step in range(7, 13):  # the steps after the previous checkpoint, as the uninterrupted run took them
        assert b.losses[step] == a.losses[step], step
    assert sorted(b.losses)[-1] == 18
