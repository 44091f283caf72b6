"""Every ZeRO stage (and CPU offload) trains on 2 ranks through the real launchers.

After training every rank holds identical parameters (digests gathered across ranks), the ranks
consumed disjoint samples, and the same seed and stage give the same per-step losses under the
deepspeed launcher and under torchrun.
"""

import pytest
from helpers import FAST, falling, train

pytestmark = pytest.mark.dist

CASES = {
    "zero0": {"strategy.zero_stage": 0},
    "zero1": {"strategy.zero_stage": 1},
    "zero2": {"strategy.zero_stage": 2},
    "zero3": {"strategy.zero_stage": 3},
    "zero2+cpu": {"strategy.zero_stage": 2, "strategy.offload": "cpu"},
    "zero3+cpu": {"strategy.zero_stage": 3, "strategy.offload": "cpu"},
}


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    cache = {}

    def get(name, launcher="deepspeed"):
        key = (name, launcher)
        if key not in cache:
            tmp = tmp_path_factory.mktemp(f"{name}-{launcher}".replace("+", "_"))
            cache[key] = train(tmp, {**FAST, **CASES[name]}, launcher=launcher)
        return cache[key]

    return get


def check_run(r, stage, offload="none"):
    assert f"ZeRO stage {stage}, offload {offload}" in r.output
    losses = r.losses
    assert sorted(losses) == list(range(1, FAST["train.max_steps"] + 1))
    first, last = falling(losses)
    assert last < first * 0.85, f"loss did not fall: {first:.3f} -> {last:.3f}"

    reports = r.rank_reports()
    assert [rep["rank"] for rep in reports] == [0, 1]
    digests = reports[0]["all_param_digests"]
    assert len(digests) == 2 and digests[0] == digests[1], "ranks hold different parameters"
    assert reports[1]["param_digest"] == reports[0]["param_digest"]

    a, b = (set(rep["samples"]) for rep in reports)
    per_rank = FAST["train.max_steps"] * FAST["train.micro_batch_size"]
    assert len(reports[0]["samples"]) == len(reports[1]["samples"]) == per_rank
    assert not a & b, f"ranks consumed {len(a & b)} identical samples"


@pytest.mark.parametrize("name", list(CASES))
def test_stage_trains_on_two_ranks(runs, name):
    case = CASES[name]
    check_run(runs(name), case["strategy.zero_stage"], case.get("strategy.offload", "none"))


@pytest.mark.parametrize("name", ["zero0", "zero1", "zero2", "zero3"])
def test_measured_memory_matches_the_plan(runs, name):
    """Bytes each rank holds in parameters, gradients and optimizer states (counted from the engine's
    tensors after the first step) are within 10% of the planner's model-state figures. At stage 3
    the planner's parameters include one gathered layer, which exists only inside forward/backward:
    the resident parameters are compared. At stages 1-2 DeepSpeed's gradient partition buffer holds
    whole gradients of the parameters that straddle a partition boundary, one parameter more than
    P/N (14% on this tiny model, negligible on a real one), so each category gets 15%."""
    for rep in runs(name).rank_reports():
        measured, planned = rep["memory"], dict(rep["plan"]["estimate_bytes"])
        planned["params"] -= planned["gathered_layer"]
        rows = [(k, measured[k], planned[k]) for k in ("params", "grads", "optimizer")]
        total_m, total_p = sum(r[1] for r in rows), sum(r[2] for r in rows)
        print(f"{name} rank {rep['rank']}: " + ", ".join(f"{k} {m:,} vs plan {p:,}" for k, m, p in rows)
              + f"; total {total_m:,} vs {total_p:,} ({total_m / total_p - 1:+.1%})")
        assert abs(total_m / total_p - 1) <= 0.10
        for key, m, p in rows:
            assert abs(m / p - 1) <= 0.15, f"{key}: measured {m:,}, planned {p:,}"


def test_torchrun_gives_the_same_losses_as_deepspeed(runs):
    ds, tr = runs("zero2"), runs("zero2", "torchrun")
    check_run(tr, 2)
    assert "via torchrun" in tr.output and "via deepspeed" in ds.output
    assert tr.losses == ds.losses  # bitwise: same seed, stage and data order
    assert tr.rank_reports()[0]["param_digest"] == ds.rank_reports()[0]["param_digest"]
