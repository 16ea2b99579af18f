"""Typed answers by shape: each exercise of a shape is the same judgements in the same order, and differs only in
its data. A checker of a typed answer builds the shape's data and hands the answer to its judge; it writes no
chain of ifs. Three shapes:

- :class:`Choice`, one name from a list ("which backend does 'auto' pick", "which strategy"), judged by
  :func:`judge_choice`: a text that names something else a learner may mean (a device for a backend) is refused
  with what it is; then the answer is read as one of the options (:func:`dtlib.checks.typed.choice`, synonyms
  included); the right one is right, and any other is refused with why it is wrong for this job.
- :class:`Known`, a number the exercise computes ("bytes of model state per rank"), judged by
  :func:`judge_known`: read however it was typed, positive, right within ``rtol``; else the number a usual slip
  gives (counting the parameters only), the answer in another unit (MB for bytes), or how far off it is.
- :class:`Extreme`, the fewest (or the most) of something whole that meets a condition ("the fewest
  micro-batches that keep the bubble under 10%", "the most samples per rank that fit 79 GiB", "the fewest
  pipeline stages at which rank 0 fits"), judged by :func:`judge_extreme`:

  1. the answer read as a whole number, however it was typed (:func:`dtlib.checks._numbers.whole_answer`);
  2. a number outside the exercise's domain (not a divisor of the layers, no micro-batch at all) is refused
     with the exercise's reason;
  3. a number that fails the condition is refused with what it gives (its peak, its bubble);
  4. a number that meets it, while the next one in the asked direction meets it too, is refused, with both;
  5. otherwise it is right, and the message gives the next one's figure beside it.

  Step 4 looks at the next allowed number only. That is the whole search wherever the condition is monotone
  (more stages never raise rank 0's peak, more micro-batches never grow the bubble, one more sample never
  lowers a peak); each exercise says why its condition is. A checker then computes two figures per answer.

Example::

    fewest = Extreme("micro-batches", allowed=lambda m: None if m >= 1 else "At least one.",
                     holds=lambda m: 3 / (m + 3) <= 0.1, next=lambda m: m - 1 if m > 1 else None,
                     fails=lambda m: f"{m} leave a bubble of {3 / (m + 3):.0%}.",
                     beaten=lambda m, fewer: f"{fewer} meet it too: find the fewest.",
                     right=lambda m, fewer: f"{m} micro-batches.")
    judge_extreme(27, fewest).ok   # True: 3/30 = 10%, and 26 leave 10.3%
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dtlib.checks import typed
from dtlib.checks._numbers import whole_answer
from dtlib.checks.feedback import Feedback


@dataclass(frozen=True)
class Choice:
    """What one "which of these" exercise asks, and what it says to each answer."""

    what: str  # how the messages name an answer: "a backend", "a strategy"
    options: Sequence[str]  # the names an answer may be
    right: str  # the option that is right for this job
    said_right: str  # the verdict on it
    why_not: Callable[[str], str]  # another option -> why it is wrong for this job
    synonyms: Mapping[str, str] = field(default_factory=dict)  # another name (by typed.key) -> its option
    # a text that is no option -> what it is (a device, a backend never offered), or None to read it as an option
    slip: Callable[[str], str | None] = lambda text: None
    none_of_them: Callable[[str], str] | None = None  # a text that is no option and no slip; typed's words if None


def judge_choice(answer: Any, exercise: Choice) -> Feedback:
    """``answer`` judged by ``exercise``, in the order the module describes."""
    if isinstance(answer, str) and typed.key(answer) not in {typed.key(name) for name in exercise.options}:
        slip = exercise.slip(typed.key(answer))
        if slip is not None:
            return Feedback(False, slip)
    read = typed.choice(answer, exercise.options, exercise.synonyms, exercise.what)
    if not typed.chosen(read, exercise.options):
        if isinstance(answer, str) and exercise.none_of_them is not None:
            return Feedback(False, exercise.none_of_them(answer.strip()))
        return Feedback(False, read)
    if read == exercise.right:
        return Feedback(True, exercise.said_right)
    return Feedback(False, exercise.why_not(read))


#: Units a number may have been given in by mistake, for an answer asked in bytes: name, bytes per unit, and how
#: to say it.
BYTE_UNITS = (("KB", 1e3, "10^3"), ("KiB", 2**10, "2^10"), ("MB", 1e6, "10^6"), ("MiB", 2**20, "2^20"),
              ("GB", 1e9, "10^9"), ("GiB", 2**30, "2^30"))


@dataclass(frozen=True)
class Known:
    """What one "how many" exercise computes, the numbers its usual slips give, and what it says to each."""

    unit: str  # the answer's unit, as typed.number reads it: "bytes"
    expected: float
    right: Callable[[float], str]  # the verdict on a right answer
    otherwise: Callable[[float], str]  # a number that no slip explains
    slips: Mapping[float, str] = field(default_factory=dict)  # a number a usual slip gives -> what the slip was
    units: Sequence[tuple[str, float, str]] = ()  # (name, size in the answer's unit, how to say it)
    rtol: float = 0.01


def shown(number: float) -> str:
    """A number as a learner reads it: 112,256 or 0.1123, never a small number rounded to 0."""
    return f"{number:,.0f}" if abs(number) >= 1000 else f"{number:.6g}"


def judge_known(answer: Any, exercise: Known) -> Feedback:
    """``answer`` judged by ``exercise``, in the order the module describes."""
    read = typed.number(answer, exercise.unit)  # a Decimal, a tensor, "112,256 bytes" ...
    if isinstance(read, str):
        return Feedback(False, read)
    value = float(read)
    if value <= 0:
        return Feedback(False, f"{value:g} is not a number of {exercise.unit}: the answer is a positive count.")

    def near(number: float, target: float) -> bool:
        return abs(number - target) <= exercise.rtol * abs(target)

    if near(value, exercise.expected):
        return Feedback(True, exercise.right(value))
    slip = next((said for target, said in exercise.slips.items() if near(value, target)), None)
    if slip is not None:
        return Feedback(False, f"{shown(value)} {exercise.unit}: {slip}")
    for unit, size, power in exercise.units:
        converted = value * size
        if near(converted, exercise.expected):
            return Feedback(False, f"{shown(value)} looks like the answer in {unit} ({power} {exercise.unit}): that "
                                   f"is {shown(converted)} {exercise.unit}, the right amount. Give the answer in "
                                   f"{exercise.unit}.")
        slip = next((said for target, said in exercise.slips.items() if near(converted, target)), None)
        if slip is not None:
            return Feedback(False, f"{shown(value)} looks like {unit} ({power} {exercise.unit}), that is "
                                   f"{shown(converted)} {exercise.unit}; give the answer in {exercise.unit}. "
                                   f"And {slip}")
    return Feedback(False, exercise.otherwise(value))


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
