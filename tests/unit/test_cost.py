"""What a run costs: device-hours per attempt and in total (bin/report), and the GPU utilisation
warning (the console), from records and readings made up here."""

import json

from trainer.metrics.measure import UtilisationWatch
from trainer.report.runs import cost_rows


def test_device_hours_per_attempt_and_tokens_per_device_hour(tmp_path):
    """From the supervisor's attempts.jsonl (every attempt, a killed one too) when there is one, else from
    the attempts' own records in metrics.jsonl."""
    train = [{"step": 10, "tokens": 1_000_000}]
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"event": "attempt", "attempt": 0, "ranks": 2, "seconds": 36.0, "device_hours": 0.02})
        + "\n"
    )
    rows = dict(cost_rows(tmp_path, train))
    assert rows["device-hours"] == "0.02 over 1 attempt(s): 0.02 (2 x 36 s) [metrics.jsonl]"
    assert rows["tokens per device-hour"] == "50,000,000"
    attempts = [{"attempt": 0, "exit": -9, "ranks": 8, "seconds": 900.0, "device_hours": 2.0},
                {"attempt": 1, "exit": 0, "ranks": 8, "seconds": 1800.0, "device_hours": 4.0}]  # fmt: skip
    (tmp_path / "attempts.jsonl").write_text("".join(json.dumps(a) + "\n" for a in attempts))
    rows = dict(cost_rows(tmp_path, train))
    assert rows["device-hours"].startswith(
        "6 over 2 attempt(s): 2 (8 x 900 s), 4 (8 x 1800 s) [attempts.jsonl]"
    )
    assert rows["tokens per device-hour"] == "166,667"


def test_low_gpu_utilisation_for_a_window_is_a_warning_naming_the_cause():
    readings = iter([95, 70, 60, 50, 40, 90, 30, 20, 10])
    watch = UtilisationWatch(lambda: next(readings), window=3)
    said = [watch.check(rec := {"data_wait_share": 0.25}) for _ in range(5)]
    assert said[:2] == [None, None] and said[4] is None and rec["gpu_utilisation"] == 0.4
    assert said[3] is not None and "GPU utilisation 60% (under 80%) for 3 log intervals" in said[3]
    assert "the data: 25% of the step waits" in said[3]
    host = [watch.check({"data_wait_share": 0.01}) for _ in range(4)]  # 90 resets the streak, then 30 20 10
    assert host[:3] == [None, None, None] and "the host" in host[3] and "train.compile" in host[3]
    assert UtilisationWatch(lambda: None).check({}) is None  # no reading: nothing said
