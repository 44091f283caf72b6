"""checkpoint.every_minutes: auto: Daly's interval against its closed form and against the optimum of
the expected run time it approximates; the re-estimate as saves are measured."""

import math

import pytest

from trainer.checkpoint.interval import AutoInterval, auto_interval, daly
from trainer.config.schema import FLEET_MTBF_NODE_HOURS


@pytest.mark.parametrize(
    ("cost", "mtbf"), [(0.02, 3600.0), (12.0, 792 * 3600.0), (60.0, 3600.0), (5.0, 50.0)]
)
def test_daly_is_its_closed_form_and_the_optimum_of_the_expected_run_time(cost, mtbf):
    r = cost / (2 * mtbf)
    assert daly(cost, mtbf) == pytest.approx(
        math.sqrt(2 * cost * mtbf) * (1 + math.sqrt(r) / 3 + r / 9) - cost
    )

    def run_time(tau):  # Daly 2006, eq. (2) with no restart time: per unit of work, failures exponential
        return mtbf * (math.exp((tau + cost) / mtbf) - 1) / tau

    grid = [daly(cost, mtbf) * (0.5 + k / 1000) for k in range(1001)]
    best = min(grid, key=run_time)
    # Daly's higher-order estimate sits within a few percent of the true optimum for delta << M
    assert run_time(daly(cost, mtbf)) <= run_time(best) * 1.001, (daly(cost, mtbf), best)
    assert abs(daly(cost, mtbf) - best) / best < 0.05


def test_a_save_costlier_than_two_mtbfs_saves_every_mtbf():
    assert daly(10.0, 4.0) == 4.0


def test_the_interval_starts_from_the_plans_copy_and_follows_the_measured_saves():
    a = auto_interval(FLEET_MTBF_NODE_HOURS, nodes=8, snapshot_bytes=int(23.6e9), background=True)
    assert a.mtbf_s == pytest.approx(6335 * 3600 / 8) and a.cost_s == pytest.approx(11.8)
    assert "estimated from the host copy of 23.6 GB per node at 2 GB/s" in a.describe()
    assert a.minutes == pytest.approx(daly(11.8, 6335 * 3600 / 8) / 60)
    assert a.observe(11.0) is None  # within 10%: not logged again
    line = a.observe(40.0)  # the median of 11 and 40
    assert line is not None and "the median of 2 measured save(s)" in line and a.cost_s == pytest.approx(25.5)
    sync = auto_interval(100.0, nodes=1, snapshot_bytes=int(1e9), background=False)
    assert sync.cost_s == pytest.approx(2.0) and isinstance(sync, AutoInterval)
