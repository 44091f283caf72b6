"""Run-time escalation: an out-of-memory at stage 0 ends the attempt and the supervisor continues
from the last checkpoint one rung higher (stage 1), to the requested number of steps. The
supervisor starts the job with torchrun here (with the deepspeed launcher in test_failfast.py)."""

import json
import subprocess
import sys

import pytest
from helpers import FAST, cli

pytestmark = pytest.mark.dist


def test_oom_at_stage_0_escalates_to_stage_1_and_finishes(tmp_path):
    run_dir = tmp_path / "run"
    # checkpoint.async false: a background write of step 6 still in flight at the OOM two steps later
    # (a loaded machine: 3 test workers on 2 cores) is rightly not committed, and the resume is from 3
    sets = {**FAST, "train.max_steps": 12, "checkpoint.every_steps": 3, "strategy.on_oom": "escalate",
            "strategy.justification": "", "run_dir": run_dir, "checkpoint.async": False}
    code, out = cli(sets, "--launcher", "torchrun", "--nproc-per-node", "2", "--max-restarts", "2",
                    env={"TRAINER_FAULT": "oom@8:rank=1:attempt=0"}, timeout=600)
    assert code == 0, out[-4000:]

    attempts = [json.loads(line) for line in (run_dir / "attempts.jsonl").read_text().splitlines()]
    # The rank that ran out of memory exits 3, but the launcher reports whichever rank it sees fail
    # first (the other one, blocked in a collective, fails too): the record is what the supervisor reads.
    assert [a["exit"] != 0 for a in attempts] == [True, False]
    assert attempts[0]["oom"]["stage"] == 0 and attempts[0]["oom"]["step"] == 8 and attempts[0]["oom"]["rank"] == 1
    assert "escalated after out-of-memory on zero0 at step 8 (attempt 0): next attempt on zero1" in out

    final = json.loads((run_dir / "checkpoints" / "step_00000012" / "trainer_state.json").read_text())
    assert final["step"] == 12 and final["zero_stage"] == 1
    assert "escalated after out-of-memory on zero0" in final["plan"]["reason"]

    # Steps: attempt 0 logged 1..7, attempt 1 resumed from the checkpoint at 6 and logged 7..12.
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert sorted(set(steps)) == list(range(1, 13)), "no step skipped"
    repeated = sorted({s for s in steps if steps.count(s) > 1})
    assert repeated == [7], "only the steps between the last checkpoint (6) and the OOM (8) run twice"
    losses = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first7, second7 = [m["loss"] for m in losses if m.get("step") == 7 and "loss" in m]
    assert abs(first7 - second7) <= 1e-5 * first7, "stage 1 continues exactly where stage 0 stood"


def test_oom_on_the_last_pinned_rung_escalates_to_the_next_activation_lever(tmp_path):
    """Stage 3 pinned (no higher rung without offload there): an out-of-memory climbs the other axis, to
    the cheapest activation lever the plan ranks next (the tiled loss), on the same rung, and resumes."""
    run_dir = tmp_path / "run"
    sets = {**FAST, "train.max_steps": 8, "checkpoint.every_steps": 3, "strategy.on_oom": "escalate",
            "strategy.zero_stage": 3, "strategy.offload": "none", "strategy.justification": "test",
            "run_dir": run_dir, "checkpoint.async": False, "checkpoint.save_final": True}  # fmt: skip
    code, out = cli(sets, "--launcher", "torchrun", "--nproc-per-node", "2", "--max-restarts", "2",
                    env={"TRAINER_FAULT": "oom@5:rank=0:attempt=0"}, timeout=600)  # fmt: skip
    assert code == 0, out[-4000:]
    assert (
        "escalated after out-of-memory on zero3 at step 5 (attempt 0): next attempt on zero3 with activation "
        "levers: tiled loss" in out
    ), out[-4000:]
    assert "activation levers: tiled loss (" in out  # the escalation pins the tiled loss on
    final = json.loads((run_dir / "checkpoints" / "step_00000008" / "trainer_state.json").read_text())
    assert final["zero_stage"] == 3 and final["plan"]["levers"] == "tiled loss"
