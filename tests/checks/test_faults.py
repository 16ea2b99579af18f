"""dtlib.checks.checkpoint_interval (notebook 16): right intervals written several ways pass, and each kind of
wrong one is refused with what it got wrong. Oracle: dtlib.sim.failures' exact waste (tests/sim/test_failures.py
checks it against simulated jobs) and Young's and Daly's published formulas."""

from __future__ import annotations

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


@pytest.mark.parametrize("answer", [young, daly, minimised, young_as_text])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_right_intervals_pass(answer, seed):
    feedback = checkpoint_interval(answer, seed=seed)
    assert feedback.ok, feedback.message


WRONG = [
    (lambda rate, gpus, c, r: math.sqrt(2 * c * 3600 / rate), "one GPU's failures"),
    (lambda rate, gpus, c, r: young(rate, gpus, c, r) / 60, "in minutes"),
    (lambda rate, gpus, c, r: young(rate, gpus, c, r) / 3600, "in hours"),
    (lambda rate, gpus, c, r: math.sqrt(c * 3600 / (rate * gpus)), "factor 2 inside the root"),
    (lambda rate, gpus, c, r: math.sqrt(2 * (c + r) * 3600 / (rate * gpus)), "does not move the best interval"),
    (lambda rate, gpus, c, r: 1800.0, "wastes"),
    (lambda rate, gpus, c, r: -young(rate, gpus, c, r), "positive number of seconds"),
    (lambda rate, gpus, c, r: None, "No answer yet"),
    (lambda rate, gpus, c, r: 1 / 0, "raised ZeroDivisionError"),
]


@pytest.mark.parametrize(("answer", "said"), WRONG)
def test_wrong_intervals_are_refused_with_their_slip(answer, said):
    feedback = checkpoint_interval(answer, seed=0)
    assert not feedback.ok and said in feedback.message, feedback.message


def test_what_is_no_function_is_refused():
    assert "Pass your function itself" in checkpoint_interval(1800).message


def test_the_jobs_are_drawn_per_call():
    asked = {checkpoint_interval(lambda *job: 1.0, jobs=1).message for _ in range(5)}
    assert len(asked) > 1  # a constant answer meets other jobs each time
