"""The planner's decisions over a matrix of jobs (issue 61: 1B, 8B and 70B Llama shapes; full, LoRA, QLoRA; 1 to
64 ranks; 16 to 141 GB; 2k to 32k tokens; issue 68: Qwen3-4B, Gemma-3-1B, Mixtral-8x7B and Qwen3-30B-A3B) are
the checked-in table's, tests/unit/plan_matrix.md, which
bench/plan_matrix.py writes: a change to any decision or estimate shows in review as a diff of that table. Every
row obeys the escalation rules: the choice is the fastest setting that fits by the plan's own estimate, and
offload only where no rung fits without it."""

import difflib
import shutil

import pytest

from bench import plan_matrix


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory):
    # the checked-in counts, copied: a count made again (another transformers) is not written into the checkout
    cache = tmp_path_factory.mktemp("counts")
    shutil.copytree(plan_matrix.MODEL_INFO, cache, dirs_exist_ok=True)
    return plan_matrix.table(cache)


def test_the_decisions_are_the_checked_in_table(regenerated):
    want = plan_matrix.TABLE.read_text()
    if regenerated != want:
        diff = "".join(
            difflib.unified_diff(want.splitlines(True), regenerated.splitlines(True), "checked in", "now")
        )
        pytest.fail(
            f"the planner decides otherwise; review the diff, then python bench/plan_matrix.py --write:\n{diff}"
        )


def test_the_matrix_covers_what_the_issue_names(regenerated):
    rows = [r.split(" | ") for r in regenerated.splitlines() if r.startswith("| ")]
    rows = [[r[0].removeprefix("| "), *r[1:]] for r in rows if r[1] in plan_matrix.METHODS]
    assert (
        len(rows) == 3 * 3 * 5 * 4 * 3 + 4 * 3 * 3 * 4 * 3
    )  # the Llamas on 5 world sizes, the other four on 3
    assert {r[0] for r in rows} == set(plan_matrix.MODELS)
    decisions = {r[5] for r in rows}
    # every rung the ladder has but NVMe (no path given) is the answer somewhere, and nothing fits somewhere
    assert {"zero0", "zero1", "zero2", "zero3", "zero2+cpu", "zero3+cpu (optimizer only)", "zero3+cpu",
            "nothing fits"} <= decisions  # fmt: skip
    blocked = [r[10] for r in rows if r[5] == "nothing fits"]
    assert all("blocks it" in b for b in blocked), blocked
