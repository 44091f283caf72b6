"""bin/report on several runs: strong scaling (the global batch kept) and weak scaling (the batch per
rank kept) per strategy, from what each run's metrics.jsonl records."""

import json

import pytest

from trainer.report import cli, compare


def write_run(
    path, world, tokens_per_step, step_s, strategy="zero2", losses=(5.0, 4.0, 3.0, 2.5), legacy=False
):
    path.mkdir(parents=True)
    lines = []
    for i, loss in enumerate(losses, 1):
        step = 5 * i
        rec = {"step": step, "loss": loss, "lr": 1e-3, "tokens": step * tokens_per_step,
               "tokens_per_s": tokens_per_step / step_s, "step_time_s": step_s * (3 if i == 1 else 1),
               "rank_busy_s": [0.01] * world, "elapsed_s": step * step_s}  # fmt: skip
        if not legacy:
            rec.update(world_size=world, tokens_per_step=tokens_per_step, strategy=strategy, zero_stage=2)
        lines.append(json.dumps(rec))
    lines.insert(2, json.dumps({"step": 10, "eval_loss": 3.9, "eval_ppl": 49.4}))
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return path


def test_strong_and_weak_scaling_efficiency(tmp_path, capsys):
    one = write_run(tmp_path / "one", 1, 1024, 0.100)
    one_accum = write_run(tmp_path / "one-accum", 1, 2048, 0.200, losses=(5.0, 4.0, 3.0, 2.5))
    two = write_run(tmp_path / "two", 2, 2048, 0.125, losses=(5.0, 4.001, 3.0, 2.5))
    other = write_run(tmp_path / "z3", 2, 2048, 0.3, strategy="zero3")
    runs = [compare.facts(d) for d in (one, one_accum, two, other)]
    assert [r.world for r in runs] == [1, 1, 2, 2]
    assert runs[0].step_s == pytest.approx(0.1)  # the first (warm-up) interval is left out
    found = {(s.kind, s.base.run_dir.name, s.run.run_dir.name): s for s in compare.scaling(runs)}
    assert set(found) == {("strong", "one-accum", "two"), ("weak", "one", "two")}  # zero3 has no 1-rank run
    strong, weak = found["strong", "one-accum", "two"], found["weak", "one", "two"]
    assert strong.speedup == pytest.approx(1.6) and strong.efficiency == pytest.approx(0.8)
    assert weak.efficiency == pytest.approx(0.8)
    gap, n = strong.loss_gap()
    assert gap == pytest.approx(0.001) and n == 4

    assert cli.main([str(d) for d in (one, one_accum, two, other)]) == 0
    out = capsys.readouterr().out
    assert "zero2 strong scaling efficiency 80.0% (global batch kept, 2,048 tokens): 1 -> 2 ranks" in out
    assert "zero2 weak scaling efficiency 80.0% (batch per rank kept, 1,024 tokens): 1 -> 2 ranks" in out
    assert "zero3 strong scaling (global batch kept): no two runs at different world sizes to compare" in out
    assert (tmp_path / "scaling.png").stat().st_size > 10_000


def test_runs_logged_before_the_run_facts_were_recorded(tmp_path):
    """Older metrics.jsonl files: the world size from the per-rank list, tokens per step from the rate."""
    a = compare.facts(write_run(tmp_path / "a", 1, 1024, 0.1, legacy=True))
    b = compare.facts(write_run(tmp_path / "b", 2, 2048, 0.1, legacy=True))
    assert (a.world, a.tokens_per_step, b.world, b.tokens_per_step, a.strategy) == (1, 1024, 2, 2048, "?")
    (weak,) = compare.scaling([a, b])
    assert weak.kind == "weak" and weak.efficiency == pytest.approx(1.0)


def test_a_directory_without_metrics_is_a_clear_error(tmp_path, capsys):
    write_run(tmp_path / "a", 1, 1024, 0.1)
    (tmp_path / "empty").mkdir()
    assert cli.main([str(tmp_path / "a"), str(tmp_path / "empty")]) == 2
    assert "no metrics.jsonl here" in capsys.readouterr().err
