"""The one checker loop for exercises whose answer is a function every rank runs, ``fn(rank, world_size)``.

An exercise is data: the right value for a world size, how to read a rank's answer, and a table of hints,
each a test of a wrong answer and what to say about it. :func:`judge` does the rest, the same way for
every exercise: refuse what is not a function; run it with ``dtlib.spawn`` on ``world_size`` ranks and
on one more (an answer written for one size fails the other); name a hang or a failure; compare every
rank's answer, the first matching hint explaining a wrong one; and refuse a right answer that no
collective produced (:mod:`dtlib.measure.counting`).

Example: ``judge(fn, SUM_OF_RANKS, world_size=3, timeout=30)`` is a :class:`dtlib.feedback.Feedback`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dtlib.errors import WorkerError, WorkerTimeout
from dtlib.feedback import Feedback
from dtlib.measure.counting import rank_without_communication, spawn_counting

UNREADABLE = object()  # what ``read`` returns for an answer it cannot compare (a string, a wrong shape)


@dataclass(frozen=True)
class Answer:
    """One rank's wrong answer, as a hint sees it."""

    rank: int
    size: int  # the world size of this run
    world_size: int  # the one asked for: the first run's
    returned: Any  # what fn returned
    value: Any  # as ``read`` made it, or UNREADABLE
    expected: Any
    values: Sequence[Any]  # every rank's, as read
    calls: Sequence[dict[str, int]]  # every rank's collectives, {name: times} (dtlib.measure.counting)

    def called(self, name: str) -> bool:
        """Whether this rank's function called the collective ``name`` ("reduce", "all_reduce", ...)."""
        return bool(self.calls[self.rank].get(name))


@dataclass(frozen=True)
class RankExercise:
    """What one exercise asks, and what it says about each kind of wrong answer."""

    expected: Callable[[int], Any]  # the world size -> the right value, the same on every rank
    read: Callable[[Any], Any]  # what a rank returned -> a value to compare, or UNREADABLE
    same: Callable[[Any, Any], bool]  # (a rank's value, the expected one)
    hints: Sequence[tuple[Callable[[Answer], bool], Callable[[Answer], str]]]  # the first that holds explains
    otherwise: Callable[[Answer], str]  # when no hint holds (also for UNREADABLE, unless a hint takes it)
    no_collective: Callable[[int, Any], str]  # (the rank, the expected value): right, but nothing communicated
    right: Callable[[int, int], str]  # (the two world sizes): the message of a right answer
    hang: Callable[[WorkerTimeout, str], str]  # (the timeout, fn's name)
    failure: Callable[[WorkerError], str]  # a rank raised or died
    # every rank's collectives, {name: times}, once every value is right: what to say if they were more than
    # the exercise needs (an all-gather where one all-reduce does), or None
    excess: Callable[[Sequence[dict[str, int]]], str | None] = lambda calls: None


#: How every checker launches ranks: gloo, held to NCCL's contract (dtlib.launch.strict), on any machine. The
#: verdicts and their messages are then the same on a laptop and on a GPU box, and what NCCL leaves undefined
#: reads as NaN, so an answer that only gloo's leniency makes right is refused.
ON_GLOO = {"backend": "gloo", "strict": True}


def same_collectives_hang(err: WorkerTimeout, name: str) -> str:
    """What to say when a rank function hung and nothing more precise is known."""
    return "Your function hung: every rank must call the same collectives in the same order."


def reduce_hint(answer: Answer) -> str:
    """What to say when ``dist.reduce`` stood where ``dist.all_reduce`` belongs."""
    return (f"Rank {answer.rank} does not hold the result: dist.reduce leaves it on one rank only (dst), and the "
            "others' tensors are undefined afterwards (NCCL promises them nothing; the checker fills them with NaN). "
            "Use dist.all_reduce, which leaves it on every rank.")


def _holds_undefined(answer: Answer) -> bool:
    """Whether the rank's value holds NaN where the right one has none: what strict mode writes into a tensor
    that NCCL leaves undefined (dtlib.launch.strict)."""
    try:
        value, expected = torch.as_tensor(answer.value, dtype=torch.float64), torch.as_tensor(answer.expected,
                                                                                            dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        return False
    return bool(value.isnan().any()) and not bool(expected.isnan().any())


def undefined_hint(answer: Answer) -> str:
    """What to say when a rank returned numbers that NCCL leaves undefined (strict mode shows them as NaN)."""
    if answer.called("reduce"):
        return reduce_hint(answer)
    return (f"Rank {answer.rank}'s result holds NaN where numbers belong: it read a tensor before the collective "
            "writing it had finished. With async_op=True, call .wait() on the work it returns before reading or "
            "returning the tensor: NCCL writes it later, on its own stream, and the checker marks such numbers NaN.")


def judge(fn: Any, exercise: RankExercise, world_size: int, timeout: float) -> Feedback:
    """Run ``fn`` on ``world_size`` ranks and on one more, and judge it by ``exercise``."""
    if not callable(fn):
        return Feedback(False, f"Pass your function itself, not {type(fn).__name__}.")
    sizes = (world_size, world_size + 1)  # a second size refuses answers written for one world size
    for size in sizes:
        expected = exercise.expected(size)
        try:
            results, calls = spawn_counting(fn, size, timeout=timeout, **ON_GLOO)
        except WorkerTimeout as err:
            return Feedback(False, exercise.hang(err, getattr(fn, "__name__", "")))
        except WorkerError as err:
            return Feedback(False, exercise.failure(err))
        values = [exercise.read(value) for value in results]
        for rank, value in enumerate(values):
            if value is not UNREADABLE and exercise.same(value, expected):
                continue
            answer = Answer(rank, size, world_size, results[rank], value, expected, values, calls)
            hints = [*exercise.hints, (_holds_undefined, undefined_hint)]  # the exercise's own come first
            say = next((say for holds, say in hints if holds(answer)), exercise.otherwise)
            return Feedback(False, say(answer))
        silent = rank_without_communication(calls)  # right values, but did they travel?
        if silent is not None:
            return Feedback(False, exercise.no_collective(silent, expected))
        too_much = exercise.excess(calls)
        if too_much:
            return Feedback(False, too_much)
    return Feedback(True, exercise.right(*sizes))
