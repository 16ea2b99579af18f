"""Checkers of a function every rank runs, ``fn(rank, world_size)``: its result and its communication.

Each is an exercise written as data (:class:`dtlib.checks.skeleton.RankExercise`: the right value, how to
read a rank's answer, a table of hints for wrong ones); :func:`dtlib.checks.skeleton.judge` runs the
learner's function on two world sizes, names a hang, and refuses an answer worked out without communicating.

Example: ``dtlib.checks.sum_of_ranks(lambda rank, world_size: rank)`` says the all-reduce is missing.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from dtlib.checks._numbers import as_number, constant_divisor, equals
from dtlib.checks.skeleton import UNREADABLE, Answer, RankExercise, judge, reduce_hint, same_collectives_hang
from dtlib.errors import WorkerError, WorkerTimeout, torch_call_in
from dtlib.feedback import Feedback
from dtlib.ring.send_recv import starting_values


def _raised(err: WorkerError) -> str:
    return f"Your function raised on a rank:\n{err.failures[0].headline()}"


def _sum_hung(err: WorkerError) -> str:
    return f"Your function hung: does every rank call the same collective? Details:\n{err}"


def _should_return(answer: Answer, hint: str) -> str:
    return f"With {answer.size} ranks, rank {answer.rank} should return {answer.expected}, but {hint}"


SUM_OF_RANKS = RankExercise(
    expected=lambda size: size * (size - 1) // 2,
    read=lambda value: value,
    same=equals,
    hints=[
        (lambda a: a.returned is None, lambda a: _should_return(
            a, "it returned None: return the tensor (or its .item()) after the all-reduce.")),
        (lambda a: a.called("reduce") and not a.called("all_reduce"), reduce_hint),
        (lambda a: all(equals(v, r) for r, v in enumerate(a.values)), lambda a: _should_return(
            a, "each rank returned its own rank: was dist.all_reduce called before returning?")),
        (lambda a: equals(a.value, a.expected * a.size), lambda a: _should_return(
            a, "the sum came out world_size times too big: add each rank's number once, not the total.")),
        (lambda a: a.size != a.world_size and equals(a.value, a.world_size * (a.world_size - 1) // 2),
         lambda a: _should_return(a, f"it returned {as_number(a.value)!r}, the answer for {a.world_size} ranks: let "
                                     "the collective add up the ranks that are there instead of writing the answer "
                                     "for one world size.")),
        (lambda a: a.called("all_reduce") and a.size > 2 and equals(a.value, a.size - 1), lambda a: _should_return(
            a, f"it returned {a.size - 1}, the largest rank: ReduceOp.MAX keeps the largest value; add them with "
               "ReduceOp.SUM (all_reduce's default).")),
    ],
    otherwise=lambda a: _should_return(a, f"it returned {a.returned!r}."),
    no_collective=lambda rank, expected: (
        f"Rank {rank} returned {expected}, but no collective was called: each rank worked the sum out alone, which "
        "no rank can do with numbers only the others hold. Put the rank's own number in a tensor and use "
        "dist.all_reduce to add them up."),
    right=lambda first, second: (f"Every rank returned the sum, with {first} ranks and with {second}: the all-reduce "
                                 "added every rank's number."),
    hang=lambda err, name: _sum_hung(err),
    failure=lambda err: _sum_hung(err) if any("still running" in f.message for f in err.failures) else _raised(err),
)


def sum_of_ranks(fn: Callable[[int, int], Any], world_size: int = 3, timeout: float = 30.0) -> Feedback:
    """Notebook 01: ``fn(rank, world_size)`` must return, on every rank, 0 + 1 + ... + (world_size - 1),
    computed through a collective; it runs with ``world_size`` ranks and with one more.

    Example: ``sum_of_ranks(lambda rank, world_size: rank)`` says the all-reduce is missing.
    """
    return judge(fn, SUM_OF_RANKS, world_size, timeout)


def _starting(size: int) -> torch.Tensor:
    """Every rank's starting values, (ranks, slots), in float64."""
    return torch.stack([starting_values(r, size) for r in range(size)]).double()


def _as_float64(value: Any) -> Any:
    try:
        return torch.as_tensor(value, dtype=torch.float64)  # a list, tuple or numpy array is fine too
    except (TypeError, ValueError, RuntimeError):
        return UNREADABLE


def _floating(value: Any) -> bool:
    """Whether a returned value holds floating-point numbers (a tensor, array, list or tuple of them)."""
    try:
        return torch.as_tensor(value).is_floating_point()
    except (TypeError, ValueError, RuntimeError):
        return True  # not for this hint to judge


def _close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    return got.shape == expected.shape and torch.allclose(got, expected)


AVERAGE_OF_RANKS = RankExercise(
    expected=lambda size: _starting(size).mean(0),
    read=_as_float64,
    same=_close,
    hints=[
        (lambda a: a.value is UNREADABLE or a.value.shape != a.expected.shape,
         lambda a: f"Rank {a.rank} returned {a.returned!r}; return the averaged tensor of {a.size} values."),
        (lambda a: a.called("reduce") and not a.called("all_reduce"), reduce_hint),
        (lambda a: a.called("all_reduce") and a.value is not UNREADABLE
         and _close(a.value, _starting(a.size).max(0).values),
         lambda a: f"Rank {a.rank} holds the largest values, not the mean: ReduceOp.MAX keeps the largest; sum with "
                   "ReduceOp.SUM, then divide by world_size."),
        (lambda a: a.value is not UNREADABLE and a.called("all_reduce")
         and _close(a.value, _starting(a.size)[a.rank] / a.size),
         lambda a: f"Rank {a.rank} holds its own values divided by world_size: the all-reduce had not finished "
                   "when you divided. With async_op=True, call .wait() on the work it returns before using the "
                   "tensor."),
        (lambda a: not _floating(a.returned),
         lambda a: f"Rank {a.rank} returned integers ({a.value.tolist()}): the mean of the ranks' values is not a "
                   "whole number, so keep them as floats and divide with /, not with //."),
        (lambda a: _close(a.value, a.expected.floor()),
         lambda a: f"Rank {a.rank} holds the mean rounded down ({a.value.tolist()}): divide with /, not with //, "
                   "which throws the fraction away."),
        (lambda a: _close(a.value, _starting(a.size).sum(0)),
         lambda a: f"Rank {a.rank} holds the sum {a.value.tolist()}: divide by world_size."),
        (lambda a: _close(a.value, _starting(a.size)[a.rank]),
         lambda a: f"Rank {a.rank} still holds its own values: call dist.all_reduce on them."),
        (lambda a: constant_divisor(a.value, _starting(a.size).sum(0)) == a.size * a.size,
         lambda a: f"With {a.size} ranks, rank {a.rank} holds the sum divided by world_size twice: divide once."),
        (lambda a: a.size == a.world_size > 2  # in the second run, world_size - 1 is the first's hard-coded size
                   and constant_divisor(a.value, _starting(a.size).sum(0)) == a.size - 1,
         lambda a: f"With {a.size} ranks, rank {a.rank} holds the sum divided by world_size - 1: the mean divides "
                   "by the number of ranks that added their values, world_size."),
        (lambda a: constant_divisor(a.value, _starting(a.size).sum(0)) is not None,
         lambda a: f"With {a.size} ranks, rank {a.rank} holds the sum divided by "
                   f"{constant_divisor(a.value, _starting(a.size).sum(0))}: divide by world_size "
                   "(dist.get_world_size()), not by a fixed number."),
    ],
    otherwise=lambda a: (f"With {a.size} ranks, rank {a.rank} returned {a.value.tolist()}, expected "
                         f"{a.expected.tolist()}."),
    no_collective=lambda rank, expected: (
        f"Rank {rank} holds the mean, but no collective was called: it computed every rank's values itself, which "
        "works only because starting_values is a formula; a real rank holds data no other rank has. Use "
        "dist.all_reduce on the rank's own values, then divide by world_size."),
    right=lambda first, second: (
        f"Every rank holds the mean, with {first} ranks and with {second}. all_reduce(SUM) / world_size works on "
        "every backend and torch version; DDP averages gradients with the same sum and division, dividing first so "
        "that fp16 sums cannot overflow (notebook 04)."),
    hang=same_collectives_hang,
    failure=lambda err: ("This torch's gloo has no ReduceOp.AVG: sum with ReduceOp.SUM, then divide."
                         if "AVG" in err.failures[0].headline() else _raised(err)),
)


def average_of_ranks(fn: Callable[[int, int], Any], world_size: int = 4, timeout: float = 30.0) -> Feedback:
    """Notebook 02: ``fn(rank, world_size)`` must return, on every rank, the mean over ranks of
    ``dtlib.ring.send_recv.starting_values(rank, world_size)`` (older torch's gloo has no ``ReduceOp.AVG``),
    computed through a collective; it runs with ``world_size`` ranks and with one more. A tensor, a
    list, a tuple or a numpy array of the right numbers is right.

    Example: ``average_of_ranks(lambda rank, world_size: None)`` says nothing came back.
    """
    return judge(fn, AVERAGE_OF_RANKS, world_size, timeout)


def _stuck_in(stack: str, function_name: str) -> str:
    """From a faulthandler stack (most recent call first): "all_reduce (line 4, in fn)"."""
    inside = torch_call_in(stack)  # the collective is torch's frame
    line = next((n for n, name in re.findall(r"line (\d+) in (\w+)", stack) if name == function_name), "")
    return (inside or "a collective") + (f" (line {line}, in {function_name})" if line else "")


def _ranks(ranks: list[int]) -> str:
    """"rank 1", "ranks 1 and 2", "ranks 1, 2 and 3"."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def _hang_message(err: WorkerTimeout, function_name: str) -> str:
    stuck = "; ".join(f"rank {rank} waited in {_stuck_in(stack, function_name)}" for rank, stack in err.stacks.items())
    if not err.finished_ranks:
        return (f"It hung: {stuck}, and no rank returned: each waited for a call that no other rank made. Every "
                "rank must call the same collectives in the same order.")
    return (f"It hung: {stuck}, while {_ranks(err.finished_ranks)} returned without calling it. Every rank must call "
            "the same collectives in the same order: move the collective out of the `if rank == ...` branch.")


def _loss(value: Any) -> Any:
    number = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
    return float(number) if isinstance(number, (int, float)) and not isinstance(number, bool) else UNREADABLE


def _divisor(answer: Answer) -> float:
    """The constant the sum was divided by, if the answer is the sum over a whole number > 1 of it."""
    divisor = answer.expected * answer.size / answer.value if answer.value else 0.0
    return divisor if divisor > 1.5 and abs(divisor - round(divisor)) < 1e-6 else 0.0


def _failed(err: WorkerError) -> str:
    raised = [failure for failure in err.failures if failure.exc_type is not None]
    hint = "" if raised else " (a rank dying inside a collective: the ranks called different ones or shapes)"
    return f"A rank failed{hint}:\n{(raised or err.failures)[0].headline()[:300]}"


FIXED_BARRIER = RankExercise(
    expected=lambda size: (size + 1) / 2,
    read=_loss,
    same=lambda value, expected: abs(value - expected) < 1e-6,
    hints=[
        (lambda a: a.value is UNREADABLE,
         lambda a: f"Rank {a.rank} returned {a.returned!r}: return the mean loss as a number on every rank "
                   "(loss.item()), not only on rank 0."),
        (lambda a: a.called("reduce") and not a.called("all_reduce"), reduce_hint),
        (lambda a: abs(a.value - (a.rank + 1)) < 1e-6,
         lambda a: f"Rank {a.rank} returned its own loss {a.value:g}: it never took part in the all_reduce. Call "
                   "dist.all_reduce on every rank."),
        (lambda a: abs(a.value - a.expected * a.size) < 1e-6,
         lambda a: f"Rank {a.rank} returned the sum {a.value:g}: divide by world_size for the mean."),
        (lambda a: _divisor(a) > 0,
         lambda a: f"With {a.size} ranks, rank {a.rank} returned {a.value:g}, the sum divided by "
                   f"{round(_divisor(a))}: divide by world_size (dist.get_world_size()), not a constant."),
        (lambda a: a.called("all_reduce") and abs(a.value - a.size) < 1e-6 and a.rank + 1 != a.size,
         lambda a: f"Rank {a.rank} returned {a.value:g}, the largest loss: ReduceOp.MAX keeps the largest; sum with "
                   "ReduceOp.SUM, then divide by world_size."),
    ],
    otherwise=lambda a: (f"Rank {a.rank} returned {a.value:g}, expected the mean {a.expected:g}: all_reduce (SUM) "
                         "once on every rank, then divide by world_size once."),
    no_collective=lambda rank, expected: (
        f"Rank {rank} returned the mean {expected:g}, but no collective was called: it worked the mean out from a "
        "formula, while a real rank knows only its own loss. Call dist.all_reduce on the loss on every rank, then "
        "divide by world_size."),
    right=lambda first, second: (
        f"Every rank returned the mean loss, with {first} ranks ({(first + 1) / 2:g}) and with {second} "
        f"({(second + 1) / 2:g}): every rank called the same collective, so none waited for ever."),
    hang=lambda err, name: _hang_message(err, name),
    failure=_failed,
)


def fixed_barrier(fn: Callable[[int, int], Any], world_size: int = 2, timeout: float = 5.0) -> Feedback:
    """Notebook 08's exercise: ``fn(rank, world_size)`` must return, on every rank, the mean over ranks of
    each rank's loss ``rank + 1``, every rank calling the same collectives in the same order. It runs with
    ``world_size`` ranks and with one more, and the mean must come through a collective.

    Example: ``fixed_barrier(lambda rank, world_size: rank + 1)`` says rank 0 kept its own loss.
    """
    return judge(fn, FIXED_BARRIER, world_size, timeout)
