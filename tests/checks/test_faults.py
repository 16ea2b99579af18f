"""dtlib.checks.checkpoint_interval (notebook 16): right intervals written several ways pass, and each kind of
wrong one is refused with what it got wrong. Oracle: dtlib.sim.failures' exact waste (tests/sim/test_failures.py
checks it against simulated jobs) and Young's and Daly's published formulas."""

from __future__ import annotations

import datetime
import math

import pytest

from dtlib.checks.faults import checkpoint_interval
from dtlib.sim import failures


def young(rate, gpus, checkpoint_s, restart_s):
    return math.sqrt(2 * checkpoint_s * 3600 / (rate * gpus))


def daly(rate, gpus, checkpoint_s, restart_s):
    return failures.daly(checkpoint_s, 3600 / (rate * gpus))


def minimised(rate, gpus, checkpoint_s, restart_s):
    return failures.best_interval(3600 / (rate * gpus), checkpoint_s, restart_s)


def young_as_text(rate, gpus, checkpoint_s, restart_s):
    return f"{young(rate, gpus, checkpoint_s, restart_s):.1f}"


def young_less_the_checkpoint(rate, gpus, checkpoint_s, restart_s):  # right: Daly's first-order term
    return young(rate, gpus, checkpoint_s, restart_s) - checkpoint_s


@pytest.mark.parametrize("answer", [young, daly, minimised, young_as_text, young_less_the_checkpoint])
def test_right_intervals_pass_on_every_draw(answer):
    """Young's rule, the notebook's solution, once failed 4% of calls (a job that failed every 11 minutes with
    10-minute checkpoints); every right answer must pass every call."""
    for seed in range(100):
        feedback = checkpoint_interval(answer, seed=seed)
        assert feedback.ok, (seed, feedback.message)


@pytest.mark.parametrize("answer", [
    lambda *job: datetime.timedelta(seconds=young(*job)), lambda *job: f"{young(*job):.0f} s",
    lambda *job: f"{young(*job):.0f} sec", lambda *job: f"{young(*job):,.0f} seconds"])
def test_right_intervals_with_their_unit_or_as_a_timedelta_pass(answer):
    """Review: "1780 s" and a timedelta were refused as no number of seconds."""
    for seed in range(5):
        feedback = checkpoint_interval(answer, seed=seed)
        assert feedback.ok, (seed, feedback.message)


WRONG = [
    (lambda rate, gpus, c, r: math.sqrt(2 * c * 3600 / rate), "one GPU's failures"),
    (lambda rate, gpus, c, r: young(rate, gpus, c, r) / 60, "the interval in minutes"),
    (lambda rate, gpus, c, r: young(rate, gpus, c, r) / 3600, "the interval in hours"),
    (lambda rate, gpus, c, r: math.sqrt(2 * c / (rate * gpus)), "the MTBF in hours with the checkpoint in seconds"),
    (lambda rate, gpus, c, r: math.sqrt(c * 3600 / (rate * gpus)), "sqrt(1 * checkpoint_s * mtbf)"),
    (lambda rate, gpus, c, r: math.sqrt(1.5 * c * 3600 / (rate * gpus)), "sqrt(1.5 * checkpoint_s * mtbf)"),
    (lambda rate, gpus, c, r: math.sqrt(1.7 * c * 3600 / (rate * gpus)), "sqrt(1.7 * checkpoint_s * mtbf)"),
    (lambda rate, gpus, c, r: math.sqrt(2 * c * 4000 / (rate * gpus)), "sqrt(2.2 * checkpoint_s * mtbf)"),
    (lambda rate, gpus, c, r: math.sqrt(2 * (c + r) * 3600 / (rate * gpus)), "puts the restart inside the root"),
    (lambda rate, gpus, c, r: math.sqrt(2 * c * (3600 / (rate * gpus) - r)), "takes the restart from the MTBF"),
    (lambda rate, gpus, c, r: math.sqrt(2 * c * (3600 / (rate * gpus) + r)), "adds the restart to the MTBF"),
    (lambda rate, gpus, c, r: young(rate, gpus, c, r) + c, "counts the checkpoint's own time in the interval"),
    (lambda rate, gpus, c, r: 3600.0, "returned 3,600 s for every job"),
    (lambda rate, gpus, c, r: 1 / (rate * gpus), "Minimise the overhead"),
    (lambda rate, gpus, c, r: -young(rate, gpus, c, r), "positive number of seconds"),
    (lambda rate, gpus, c, r: None, "returned None: return the interval's seconds"),
    (lambda rate, gpus, c, r: 1 / 0, "raised ZeroDivisionError"),
    (lambda rate, gpus, c, r: 1e-300, "an interval this short does nothing but checkpoint"),
    (lambda rate, gpus, c, r: 1e300, "returned 1e+300 s: the job then fails long before each checkpoint"),
    (lambda rate, gpus, c, r: 10**400, "that a float can hold (below 1.8e308), not one of about 10^400"),
    (lambda rate, gpus, c, r: 1e-9, "returned 1e-09 s for every job"),
]


@pytest.mark.parametrize(("answer", "said"), WRONG)
def test_wrong_intervals_are_refused_with_their_slip_on_every_draw(answer, said):
    """Each call draws one job whose checkpoints are long against its MTBF and one whose restarts are: the
    slips that only those expose (a factor, the restart beside the MTBF, the checkpoint in the interval) fail
    every call, not one in a few."""
    for seed in range(30):
        feedback = checkpoint_interval(answer, seed=seed)
        assert not feedback.ok and said in feedback.message, (seed, feedback.message)


def test_the_wrong_bank_holds_many_kinds():
    assert len({said for _, said in WRONG}) == len(WRONG) >= 8


def test_a_wrong_factor_is_refused_on_every_draw_however_it_was_written():
    """Review: sqrt(1.7 c M) and Young's rule with 3,000 s per hour passed every draw, and with 4,000 s per hour 15
    of 20: a third job whose checkpoints are short (first-order ground) shows a factor on every call."""
    for answer in (lambda rate, gpus, c, r: math.sqrt(2 * c * 3000 / (rate * gpus)),
                   lambda rate, gpus, c, r: math.sqrt(2.4 * c * 3600 / (rate * gpus))):
        assert not any(checkpoint_interval(answer, seed=seed).ok for seed in range(30))


def test_what_is_no_function_is_refused():
    assert "Pass your function itself" in checkpoint_interval(1800).message


def test_the_jobs_are_drawn_per_call():
    asked = {checkpoint_interval(lambda *job: 1.0).message for _ in range(5)}
    assert len(asked) > 1  # a constant answer meets other jobs each time
