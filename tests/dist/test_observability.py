"""wandb on 2 ranks, offline: rank 0 alone records the loss history and the config (the resolved
experiment and the DeepSpeed JSON), and a resumed run continues the same wandb run."""

import json

import pytest
from helpers import FAST, train, wandb_offline_run

pytestmark = pytest.mark.dist


def test_wandb_offline_on_two_ranks_and_a_resumed_run_keeps_its_id(tmp_path):
    sets = {**FAST, "strategy.zero_stage": 2, "logging.wandb.enabled": True, "logging.wandb.tags": ["ci"]}
    first = train(tmp_path, sets, launcher="torchrun", env={"TRAINER_FAULT": "term@8:rank=1"})
    assert "stopping at step 8 on request" in first.output
    runs = sorted((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs  # rank 0 only
    a = wandb_offline_run(next(runs[0].glob("run-*.wandb")))
    assert [h["_step"] for h in a["history"]] == list(range(1, 9))
    assert [h["train/loss"] for h in a["history"]] == [first.losses[s] for s in range(1, 9)]
    assert a["config"]["experiment"]["strategy"]["zero_stage"] == 2
    assert a["config"]["deepspeed"] == first.rank_reports()[0]["ds_config"]  # the exact JSON DeepSpeed ran with
    assert a["config"]["deepspeed"]["train_batch_size"] == 2 * FAST["train.micro_batch_size"]
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_00000008" / "trainer_state.json").read_text())
    assert state["wandb_run_id"] == a["id"]

    second = train(tmp_path, sets, launcher="torchrun", extra_args=["--resume"])
    assert f"wandb: run {a['id']} (offline, resumed)" in second.output
    runs = sorted((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(a["id"]) for r in runs)
    b = wandb_offline_run(next(runs[1].glob("run-*.wandb")))
    assert b["id"] == a["id"]
    steps = [h["_step"] for h in b["history"]]
    assert steps[:8] == list(range(9, 17))  # the history continues where the first attempt stopped
    assert any("eval/loss" in h for h in b["history"])
