"""Typed answers of one shape: the fewest, or the most, of something whole that meets a condition.

"The fewest micro-batches that keep the bubble under 10%", "the most samples per rank that fit 79 GiB", "the
fewest pipeline stages at which rank 0 fits": each exercise is the same four judgements, in the same order, and
differs only in its data. :class:`Extreme` holds that data; :func:`judge_extreme` judges any answer by it:

1. the answer read as a whole number, however it was typed (:func:`dtlib.checks._numbers.whole_answer`);
2. a number outside the exercise's domain (not a divisor of the layers, no micro-batch at all) is refused with
   the exercise's reason;
3. a number that fails the condition is refused with what it gives (its peak, its bubble);
4. a number that meets it, while the next one in the asked direction meets it too, is refused, with both;
5. otherwise it is right, and the message gives the next one's figure beside it.

Step 4 looks at the next allowed number only. That is the whole search wherever the condition is monotone
(more stages never raise rank 0's peak, more micro-batches never grow the bubble, one more sample never lowers a
peak); each exercise says why its condition is. A checker then computes two figures per answer, not a table.

Example::

    fewest = Extreme("micro-batches", allowed=lambda m: None if m >= 1 else "At least one.",
                     holds=lambda m: 3 / (m + 3) <= 0.1, next=lambda m: m - 1 if m > 1 else None,
                     fails=lambda m: f"{m} leave a bubble of {3 / (m + 3):.0%}.",
                     beaten=lambda m, fewer: f"{fewer} meet it too: find the fewest.",
                     right=lambda m, fewer: f"{m} micro-batches.")
    judge_extreme(27, fewest).ok   # True: 3/30 = 10%, and 26 leave 10.3%
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dtlib.checks._numbers import whole_answer
from dtlib.checks.feedback import Feedback


@dataclass(frozen=True)
class Extreme:
    """What one "fewest (or most) whole number such that" exercise asks, and what it says at each judgement."""

    what: str  # the unit, as whole_answer names it: "micro-batches", "pipeline stages"
    allowed: Callable[[int], str | None]  # None where the number is in the domain, else why it is not
    holds: Callable[[int], bool]  # the condition, on an allowed number
    # the next allowed number in the asked direction (the next smaller one for "fewest"), or None where there is none
    next: Callable[[int], int | None]
    fails: Callable[[int], str]  # an allowed number that does not meet the condition
    beaten: Callable[[int, int], str]  # (the answer, the next one): both meet it
    right: Callable[[int, int | None], str]  # (the answer, the next one or None): the answer is the extreme


def judge_extreme(answer: Any, exercise: Extreme) -> Feedback:
    """``answer`` judged by ``exercise``, in the order the module describes."""
    count = whole_answer(answer, exercise.what)
    if isinstance(count, str):
        return Feedback(False, count)
    outside = exercise.allowed(count)
    if outside is not None:
        return Feedback(False, outside)
    if not exercise.holds(count):
        return Feedback(False, exercise.fails(count))
    following = exercise.next(count)
    if following is not None and exercise.holds(following):
        return Feedback(False, exercise.beaten(count, following))
    return Feedback(True, exercise.right(count, following))
