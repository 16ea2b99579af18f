"""dtlib.sim.failures: the waste of a checkpoint interval, simulated run by run and computed exactly.

Oracles: the closed form of a segment's expected time under Poisson failures, (M + R)(exp((tau + C)/M) - 1),
derived independently of the simulator and compared with the mean of many simulated jobs; Young's (1974) and
Daly's (2006) published intervals, which the exact minimum must sit beside.
"""

from __future__ import annotations

import math
import statistics

import pytest

from dtlib.sim import failures


@pytest.mark.parametrize(("interval_s", "mtbf_s", "checkpoint_s", "restart_s"), [
    (600, 3 * 3600, 60, 300), (3000, 3 * 3600, 60, 300), (200, 1800, 20, 120),
])
def test_simulated_jobs_waste_what_the_closed_form_says(interval_s, mtbf_s, checkpoint_s, restart_s):
    work_s = 50 * mtbf_s
    runs = [failures.simulate(work_s, interval_s, mtbf_s, checkpoint_s, restart_s, seed=seed) for seed in range(12)]
    simulated = [1 - work_s / run.wall_s for run in runs]
    exact = failures.waste(interval_s, mtbf_s, checkpoint_s, restart_s)
    spread = statistics.stdev(simulated) / math.sqrt(len(simulated))
    assert abs(statistics.mean(simulated) - exact) < 4 * spread + 2e-3, (statistics.mean(simulated), exact)


def test_a_run_accounts_for_every_second():
    run = failures.simulate(20_000, 900, 3600, 45, 200, seed=3)
    assert run.failures > 0
    assert sum(run.seconds(kind) for kind in ("work", "checkpoint", "lost", "restart")) == pytest.approx(run.wall_s)
    assert run.seconds("work") == pytest.approx(20_000)
    assert run.seconds("restart") == pytest.approx(200 * run.failures)
    assert failures.simulate(20_000, 900, 3600, 45, 200, seed=3).events == run.events  # a seed draws the same


@pytest.mark.parametrize(("mtbf_s", "checkpoint_s"), [(4 * 3600, 60), (1800, 30), (900, 10)])
def test_the_best_interval_sits_by_daly_and_young(mtbf_s, checkpoint_s):
    best = failures.best_interval(mtbf_s, checkpoint_s, 300)
    waste = failures.waste(best, mtbf_s, checkpoint_s, 300)
    assert waste <= failures.waste(best * 1.01, mtbf_s, checkpoint_s, 300)
    assert waste <= failures.waste(best * 0.99, mtbf_s, checkpoint_s, 300)
    assert best == pytest.approx(failures.daly(checkpoint_s, mtbf_s), rel=0.02)
    assert best == pytest.approx(failures.young(checkpoint_s, mtbf_s), rel=0.15)


def test_the_restart_cost_adds_waste_but_does_not_move_the_best_interval():
    quick, slow = failures.best_interval(7200, 60, 10), failures.best_interval(7200, 60, 3000)
    assert quick == pytest.approx(slow, rel=1e-4)
    assert failures.waste(quick, 7200, 60, 3000) > failures.waste(quick, 7200, 60, 10)


@pytest.mark.parametrize(("arguments", "name"), [
    ((0, 3600, 60, 300), "interval_s"), ((600, -1, 60, 300), "mtbf_s"), ((600, 3600, -5, 300), "checkpoint_s"),
    ((600, 3600, 60, float("nan")), "restart_s"), ((600, 3600, 60, True), "restart_s"),
])
def test_bad_numbers_are_refused_by_name(arguments, name):
    with pytest.raises(ValueError, match=name):
        failures.waste(*arguments)


@pytest.mark.parametrize(("interval_s", "mtbf_s", "checkpoint_s", "restart_s"),
                         [(600, 3600, 30, 300), (50, 7200, 2, 2000), (20000, 3600, 600, 60)])
def test_the_overhead_is_what_the_interval_decides_of_the_waste(interval_s, mtbf_s, checkpoint_s, restart_s):
    """Oracle: the closed-form waste; the restarts' factor is the same at every interval."""
    extra = failures.overhead(interval_s, mtbf_s, checkpoint_s)
    expected = 1 - 1 / ((1 + extra) * (1 + restart_s / mtbf_s))
    assert failures.waste(interval_s, mtbf_s, checkpoint_s, restart_s) == pytest.approx(expected, rel=1e-12)
    best = failures.best_interval(mtbf_s, checkpoint_s, restart_s)
    assert failures.overhead(best, mtbf_s, checkpoint_s) <= failures.overhead(best * 1.01, mtbf_s, checkpoint_s)
    assert failures.overhead(best, mtbf_s, checkpoint_s) <= failures.overhead(best * 0.99, mtbf_s, checkpoint_s)
