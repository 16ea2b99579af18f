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
