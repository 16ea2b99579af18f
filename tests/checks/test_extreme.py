"""The "fewest (or most) whole number such that" shape, judged from data (dtlib.checks.extreme)."""

from __future__ import annotations

from decimal import Decimal

import pytest
import torch

from dtlib.checks import cluster, layouts
from dtlib.checks.extreme import Extreme, judge_extreme

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
