"""checkpoint.every_minutes: auto on a real run: the interval is logged at start from the plan's host
copy, re-estimated from the measured saves, and the saves follow it."""

import re

import pytest
from helpers import train

pytestmark = pytest.mark.e2e


def test_auto_saves_at_the_young_daly_interval_it_logs(tmp_path):
    """tiny, one rank, a job MTBF of 36 s (checkpoint.mtbf_hours 0.01) so that the interval is
    seconds: every save comes at least the interval in force after the one before (the clock is
    checked once a step, so at most a few steps later), and the interval logged is Daly's."""
    sets = {"train.max_steps": 150, "train.log_every": 1, "train.eval_every": 0, "checkpoint.every_steps": 0,
            "checkpoint.every_minutes": "auto", "checkpoint.mtbf_hours": 0.01, "checkpoint.keep_last": 2,
            "checkpoint.save_final": False, "model.config.n_layer": 2, "data.num_workers": 0}  # fmt: skip
    r = train(tmp_path, sets, debug=False)
    logged = [float(m) for m in re.findall(r"checkpoint\.every_minutes: auto = ([\d.]+) min", r.output)]
    assert logged and "estimated from the host copy" in r.output, r.output[-3000:]
    elapsed = {m["step"]: m["elapsed_s"] for m in r.metrics if "elapsed_s" in m}
    saves = [m["saved_step"] for m in r.metrics if "checkpoint" in m]
    assert len(saves) >= 3, (saves, logged)
    step_s = max(b - a for a, b in zip(list(elapsed.values()), list(elapsed.values())[1:], strict=False))
    shortest = min(logged) * 60
    gaps = [elapsed[b] - elapsed[a] for a, b in zip(saves, saves[1:], strict=False)]
    assert all(g >= shortest - 2 * step_s for g in gaps), (gaps, logged, step_s)
    assert all(g <= max(logged) * 60 + 5 * step_s + 1.0 for g in gaps), (gaps, logged, step_s)
    print(f"auto interval: logged {logged} min; gaps between saves {[round(g, 2) for g in gaps]} s")
