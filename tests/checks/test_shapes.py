"""dtlib.checks.shapes: typed answers judged from data. A made-up exercise of each shape (a choice, a known number,
the fewest whole number such that) runs through every judgement in order; the notebooks' checkers of each shape
are then its data (notebooks 00 and 06: a choice; 05: a known number; 10 and 14: the fewest or the most)."""

from __future__ import annotations

from decimal import Decimal

import pytest
import torch

from dtlib import checks
from dtlib.checks import cluster, layouts
from dtlib.checks.shapes import Choice, Extreme, Known, judge_choice, judge_extreme, judge_known

#: The fewest even numbers whose square reaches 50: 8 (6 * 6 = 36 does not; 8 * 8 = 64 does).
EVEN_SQUARES = Extreme(
    "even numbers",
    allowed=lambda n: None if n >= 2 and n % 2 == 0 else f"{n} is not an even number of at least 2.",
    holds=lambda n: n * n >= 50,
    next=lambda n: n - 2 if n > 2 else None,
    fails=lambda n: f"{n} squared is {n * n}, under 50.",
    beaten=lambda n, fewer: f"{n} reaches it, but so does {fewer}.",
    right=lambda n, fewer: f"{n}: {fewer} squared is {fewer * fewer}.")


@pytest.mark.parametrize(("answer", "ok", "says"), [
    (8, True, "8: 6 squared is 36."),
    (Decimal("8"), True, "8: 6 squared is 36."),  # typed any way a number can be
    (torch.tensor(8.0), True, "8: 6 squared is 36."),
    ("8", True, "8: 6 squared is 36."),
    (10, False, "10 reaches it, but so does 8."),
    (6, False, "6 squared is 36, under 50."),
    (7, False, "7 is not an even number of at least 2."),
    (8.5, False, "whole number"),
    (None, False, "No answer yet"),
])
def test_each_judgement_in_order(answer, ok, says):
    feedback = judge_extreme(answer, EVEN_SQUARES)
    assert feedback.ok is ok and says in feedback.message, feedback.message


def test_with_no_next_number_the_answer_that_holds_is_right():
    smallest = Extreme("stages", lambda n: None if n >= 1 else "at least 1", lambda n: True,
                       lambda n: n - 1 if n > 1 else None, str, lambda n, m: "beaten", lambda n, m: f"right, {m}")
    assert judge_extreme(1, smallest).message == "right, None"
    assert judge_extreme(2, smallest).message == "beaten"


@pytest.mark.parametrize(("check", "right", "beaten", "fails", "outside"), [
    (layouts.pipeline_micro_batches, 32, 64, 16, 24),  # 4 stages, 10%: m >= 27 and divides 64
    (lambda answer: layouts.pipeline_micro_batches(answer, stages=2, target=0.2, batch=12), 4, 6, 3, 5),
])
def test_notebook_10s_checker_is_the_shape_with_its_data(check, right, beaten, fails, outside):
    assert check(right).ok
    assert "but fewer do too" in check(beaten).message and not check(beaten).ok
    assert "above" in check(fails).message and not check(fails).ok
    assert "do not split" in check(outside).message and not check(outside).ok


def test_notebook_14s_checkers_compute_two_layouts_per_answer(monkeypatch):
    """The search is the next number only: a right answer costs its own simulation and its neighbour's (and,
    for the micro-batch, the one-sample step its message quotes), not a table."""
    asked = []
    real = cluster._stage_0
    monkeypatch.setattr(cluster, "_stage_0", lambda shape, pp, *rest: asked.append(pp) or real(shape, pp, *rest))
    assert cluster.smallest_pipeline(4).ok  # the 70B model answer: pp=2 peaks over 79 GiB
    assert sorted(asked) == [2, 4]


#: Which fruit is yellow: "banana"; a colour is a slip, "plantain" a synonym.
YELLOW = Choice("a fruit", ("apple", "banana", "cherry"), "banana", "Right: bananas are yellow.",
                why_not=lambda name: f"{name} is red.", synonyms={"plantain": "banana"},
                slip=lambda text: "that is a colour, not a fruit" if text in ("yellow", "red") else None,
                none_of_them=lambda text: f"{text!r} is no fruit here.")


@pytest.mark.parametrize(("answer", "ok", "says"), [
    ("banana", True, "Right: bananas are yellow."),
    (" BANANA\n", True, "Right"),  # read as a person means it
    ("Plantain", True, "Right"),  # a synonym
    ("apple", False, "apple is red."),  # another option, and why it is wrong here
    ("Yellow", False, "that is a colour, not a fruit"),  # a slip, named before the options are read
    ("kiwi", False, "'kiwi' is no fruit here."),
    (None, False, "No answer yet: set `answer` to a fruit, one of: 'apple', 'banana', 'cherry'."),
    (3, False, "(not int)"),
])
def test_a_choice_is_judged_in_order(answer, ok, says):
    feedback = judge_choice(answer, YELLOW)
    assert feedback.ok is ok and says in feedback.message, feedback.message


#: 12 eggs in a dozen; 6 is half of it, and an answer in dozens is a unit slip.
DOZEN = Known("eggs", 12, right=lambda n: f"Right: {n:g} eggs.", otherwise=lambda n: f"{n:g} is off.",
              slips={6: "that is half a dozen."}, units=(("dozens", 12, "12"),))


@pytest.mark.parametrize(("answer", "ok", "says"), [
    (12, True, "Right: 12 eggs."),
    ("12 eggs", True, "Right"),
    (Decimal("12.05"), True, "Right"),  # within rtol (1%)
    (6, False, "6 eggs: that is half a dozen."),
    (1, False, "1 looks like the answer in dozens (12 eggs): that is 12 eggs, the right amount."),
    (0.5, False, "0.5 looks like dozens (12 eggs), that is 6 eggs; give the answer in eggs. And that is half"),
    (20, False, "20 is off."),
    (-12, False, "-12 is not a number of eggs: the answer is a positive count."),
    ("a dozen", False, "not the text 'a dozen'"),
])
def test_a_known_number_is_judged_in_order(answer, ok, says):
    feedback = judge_known(answer, DOZEN)
    assert feedback.ok is ok and says in feedback.message, feedback.message


def test_six_of_the_nine_typed_checkers_are_a_shapes_data():
    """Issue 47's bar: the typed-answer checkers are tables. Each of these six builds its shape's data and calls
    its judge (the other three read a command line, a mesh's structure, or a function over drawn jobs)."""
    import inspect

    judged = {name: judge for name, judge in [
        ("backend_choice", "judge_choice"), ("strategy_choice", "judge_choice"), ("fsdp_memory", "judge_known"),
        ("pipeline_micro_batches", "judge_extreme"), ("largest_micro_batch", "judge_extreme"),
        ("smallest_pipeline", "judge_extreme")]}
    for name, judge in judged.items():
        source = inspect.getsource(getattr(checks, name))
        assert f"return {judge}(answer" in source, name
        assert source.count("return Feedback(") == 0, f"{name} still decides outside its shape"

