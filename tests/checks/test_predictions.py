"""dtlib.checks.predictions: predict, then measure. The verdicts, against guesses of every kind a learner types
(right, near, off by a telling factor, off by another, text, nothing, a fraction of a count), and the widget.
What each prediction measures is tested in test_measured.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dtlib.checks import predictions
from dtlib.checks.predictions import PREDICTIONS, Prediction, judge

FIXED = Prediction(question="How many?", unit="MiB", measure=lambda: 1.5, why="Because.",
                   hints=((2.0, "Twice: the naive way."),))
COUNT = dataclasses.replace(FIXED, unit="calls", whole=True, measure=lambda: 2)


@pytest.mark.parametrize("guess", ["1.5", 1.5, "1.5 MiB", " 1.5 ", "1.52", 1.45, torch.tensor(1.5), "3/2", " 3 / 2"])
def test_a_guess_within_the_tolerance_is_right_whatever_its_form(guess):
    verdict = judge(FIXED, guess, 1.5)
    assert verdict.ok, verdict
    assert "this machine measured 1.5 MiB" in verdict.message and verdict.message.endswith("Because.")


@pytest.mark.parametrize(("guess", "said"), [
    ("3", "Yours is 2 times the measurement. Twice: the naive way. Because."),  # a telling factor: its hint
    ("0.75", "Yours is the measurement divided by 2. Because."),  # no hint for this factor: the reason alone
    ("1.6", "Yours is 7% above the measurement. Because."),  # just past the tolerance
    ("1.2", "Yours is 20% below the measurement. Because."),
    ("-1.5", "this machine measured 1.5 MiB. Because."),  # no factor between numbers of other signs
    ("0", "this machine measured 1.5 MiB. Because."),
])
def test_a_wrong_guess_is_told_how_far_off_and_why(guess, said):
    verdict = judge(FIXED, guess, 1.5)
    assert not verdict.ok and verdict.message.endswith(said), verdict


@pytest.mark.parametrize(("guess", "said"), [
    ("", "Type your prediction first, a number of MiB, then measure."),
    (None, "Type your prediction first"),
    ("a lot", "Predict a number of MiB, not the text 'a lot'."),
    ("1.5 GiB", "not the text '1.5 GiB'"),  # another unit is not read as this one
    ("3/0", "not the text '3/0'"),
    ("3/2 MiB", "not the text '3/2 MiB'"),  # a fraction is read bare, as a number; with a unit it is text
])
def test_what_is_not_a_number_of_the_unit_is_refused_by_name(guess, said):
    verdict = judge(FIXED, guess, 1.5)
    assert not verdict.ok and said in verdict.message, verdict


def test_a_count_must_be_exact_and_whole():
    assert judge(COUNT, "2", 2).ok
    assert not judge(COUNT, "2.5", 2).ok and "whole number of calls, not 2.5" in judge(COUNT, "2.5", 2).message
    assert not judge(COUNT, 3, 2).ok  # within no tolerance: a count is right or wrong
    assert "You predicted 3; this machine measured 2 calls." in judge(COUNT, 3, 2).message


def test_every_prediction_has_a_question_a_unit_a_reason_and_hints_for_factors_other_than_one():
    for name, prediction in PREDICTIONS.items():
        assert prediction.question.endswith("?") and prediction.why, name
        assert prediction.unit or not prediction.how_far, f"{name}: only a name (a rank) has no unit"
        assert all(factor > 0 and factor != 1 for factor, _ in prediction.hints), name


def test_a_counts_hint_is_shown_for_its_own_number_only():
    numbers = PREDICTIONS["numbers on rank 0"]
    assert "cuts the norm four ways" in judge(numbers, "4160", 4224).message
    assert "Yours is 1% below the measurement. The Linear" in judge(numbers, "4200", 4224).message  # no hint


def test_numbers_are_shown_as_a_person_reads_them():
    assert "You predicted 1,536; this machine measured 1,542 copies." in judge(
        dataclasses.replace(FIXED, unit="copies"), "1536", 1542.0).message


def test_the_widget_asks_measures_once_and_judges_every_guess(monkeypatch, capsys):
    pytest.importorskip("ipywidgets")
    calls = []
    monkeypatch.setitem(PREDICTIONS, "fixed", dataclasses.replace(FIXED, measure=lambda: calls.append(1) or 1.5))
    box = predictions.predict("fixed")
    assert "dtlib-prediction" in box._dom_classes and "How many?" in box.children[0].value
    guess, button = box.children[1].children
    guess.value = "3"
    button.click()
    guess.value = "1.5"
    button.click()
    shown = capsys.readouterr().out  # outside a kernel, the output widget lets prints through
    assert "✗ You predicted 3;" in shown and "✓ You predicted 1.5;" in shown and len(calls) == 1


def test_a_measurement_that_fails_says_so_and_the_next_press_measures_again(monkeypatch, capsys):
    pytest.importorskip("ipywidgets")
    attempts = []

    def flaky() -> float:
        attempts.append(1)
        if len(attempts) == 1:
            raise TimeoutError("ranks did not answer")
        return 1.5

    monkeypatch.setitem(PREDICTIONS, "flaky", dataclasses.replace(FIXED, measure=flaky))
    guess, button = predictions.predict("flaky").children[1].children
    guess.value = "1.5"
    button.click()
    button.click()
    shown = capsys.readouterr().out
    assert "The measurement failed, so nothing was judged: TimeoutError: ranks did not answer" in shown
    assert "✓ You predicted 1.5;" in shown and len(attempts) == 2


def test_an_unknown_prediction_is_refused_with_the_names_there_are():
    with pytest.raises(ValueError, match="no prediction named 'rings bytes': choose one of"):
        predictions.predict("rings bytes")


@pytest.mark.parametrize(("name", "guess", "measured"), [
    ("hsdp traffic", "1.33x", 4 / 3), ("hsdp traffic", "1.33×", 4 / 3), ("hsdp traffic", "133%", 4 / 3),
    ("micro-batches held", "4 microbatches", 4), ("micro-batches held", "4 micro batches", 4),
])
def test_a_right_guess_is_taken_with_its_unit_however_spelled(name, guess, measured):
    """Review: refused as text: a ratio with its x or as a percentage, a unit spelled as one word or two."""
    verdict = judge(PREDICTIONS[name], guess, measured)
    assert verdict.ok, verdict


def test_mb_for_mib_is_refused_with_the_unit_where_it_is_the_only_error():
    """Review: 12.58 (12 MiB in MB, 4.8% off) passed under the 5% a drawn measurement needs; these bytes are counted
    exactly."""
    ring = PREDICTIONS["ring attention bytes"]
    assert judge(ring, "12", 12.0).ok
    for guess in ("12.58", "12.6"):
        verdict = judge(ring, guess, 12.0)
        assert not verdict.ok and "12 MiB counted in MB (10^6 bytes)" in verdict.message, verdict
    model_state = judge(PREDICTIONS["model state"], "1.27", 1.18)
    assert not model_state.ok and "the right amount in GB (10^9 bytes)" in model_state.message, model_state


@pytest.fixture(scope="module")
def job_waste() -> float:
    return PREDICTIONS["job waste"].measure()  # 20 simulated jobs: about two seconds


@pytest.mark.parametrize(("guess", "said"), [
    ("15", ""), ("15.4", ""), ("15%", ""), ("15.7", ""),  # the exact figure, rounded; the reason's own sum
    ("14.17", "Leaving one of the three costs out"),  # review: passed; the restarts forgotten
    ("14.58", "Leaving one of the three costs out"),  # review: passed; the checkpoints forgotten
    ("13.8", "Leaving one of the three costs out"),  # the checkpoints forgotten, computed exactly
    ("16.25", "16.25% adds the three costs as shares of the work"),
    ("0.154", "0.154 looks like a fraction, not a percentage: 0.154 of the whole is 15.4%, which would be"),
])
def test_job_waste_refuses_each_cost_left_out_and_takes_the_right_figure_rounded(job_waste, guess, said):
    verdict = judge(PREDICTIONS["job waste"], guess, job_waste)
    assert verdict.ok is not said and said in verdict.message, verdict
    assert "; 20 simulated jobs measured " in verdict.message  # a simulation's figure, not this machine's own
    assert verdict.message.startswith(f"You predicted {guess.removesuffix('%')};")  # the guess as it was typed


@pytest.mark.parametrize("guess", [10**400, "9" * 400], ids=["10**400", "400 digits"])
def test_a_guess_past_what_a_float_holds_is_refused_not_raised(guess):
    verdict = judge(PREDICTIONS["torchrun rank"], guess, 3)
    assert not verdict.ok and "that a float can hold" in verdict.message, verdict
