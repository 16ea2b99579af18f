"""Checkers of a function every rank runs, ``fn(rank, world_size)``: its result and its communication.

Each runs the learner's function with ``dtlib.spawn`` on two world sizes (one refuses an answer
written for one size), compares every rank's result with the right one, and counts the collectives
it called (:mod:`dtlib.measure.counting`), so that an answer worked out without communicating is refused.

Example: ``dtlib.checks.sum_of_ranks(lambda rank, world_size: rank)`` says the all-reduce is missing.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from dtlib.checks._numbers import as_number, constant_divisor, equals
from dtlib.errors import WorkerError, WorkerTimeout, torch_call_in
from dtlib.feedback import Feedback
from dtlib.measure.counting import rank_without_communication, spawn_counting
from dtlib.ring.send_recv import starting_values


def sum_of_ranks(fn: Callable[[int, int], Any], world_size: int = 3, timeout: float = 30.0) -> Feedback:
    """Notebook 01: ``fn(rank, world_size)`` must return, on every rank, 0 + 1 + ... + (world_size - 1),
    computed through a collective; it runs with ``world_size`` ranks and with one more.

    Example: ``sum_of_ranks(lambda rank, world_size: rank)`` says the all-reduce is missing.
    """
    if not callable(fn):
        return Feedback(False, f"Pass your function itself, not {type(fn).__name__}.")
    sizes = (world_size, world_size + 1)  # a second size refuses answers written for one world size
    for size in sizes:
        expected = size * (size - 1) // 2
        try:
            results, calls = spawn_counting(fn, size, timeout=timeout)
        except WorkerError as err:
            if any("still running" in failure.message for failure in err.failures):
                return Feedback(False, "Your function hung: does every rank call the same collective? "
                                       f"Details:\n{err}")
            return Feedback(False, f"Your function raised on a rank:\n{err.failures[0].headline()}")
        wrong = {rank: value for rank, value in enumerate(results) if not equals(value, expected)}
        if wrong:
            rank, value = next(iter(wrong.items()))
            if value is None:
                hint = "it returned None: return the tensor (or its .item()) after the all-reduce."
            elif all(equals(v, r) for r, v in enumerate(results)):
                hint = "each rank returned its own rank: was dist.all_reduce called before returning?"
            elif equals(value, expected * size):
                hint = "the sum came out world_size times too big: add each rank's number once, not the total."
            elif size != world_size and equals(value, world_size * (world_size - 1) // 2):
                hint = (f"it returned {as_number(value)!r}, the answer for {world_size} ranks: let the collective "
                        "add up the ranks that are there instead of writing the answer for one world size.")
            else:
                hint = f"it returned {value!r}."
            return Feedback(False, f"With {size} ranks, rank {rank} should return {expected}, but {hint}")
        silent = rank_without_communication(calls)
        if silent is not None:
            return Feedback(False, f"Rank {silent} returned {expected}, but no collective was called: each rank "
                                   "worked the sum out alone, which no rank can do with numbers only the others "
                                   "hold. Put the rank's own number in a tensor and use dist.all_reduce to add "
                                   "them up.")
    return Feedback(True, f"Every rank returned the sum, with {sizes[0]} ranks and with {sizes[1]}: the all-reduce "
                          "added every rank's number.")


def average_of_ranks(fn: Callable[[int, int], Any], world_size: int = 4, timeout: float = 30.0) -> Feedback:
    """Notebook 02: ``fn(rank, world_size)`` must return, on every rank, the mean over ranks of
    ``dtlib.ring.send_recv.starting_values(rank, world_size)`` (older torch's gloo has no ``ReduceOp.AVG``),
    computed through a collective; it runs with ``world_size`` ranks and with one more. A tensor, a
    list, a tuple or a numpy array of the right numbers is right.

    Example: ``average_of_ranks(lambda rank, world_size: None)`` says nothing came back.
    """
    import torch

    if not callable(fn):
        return Feedback(False, f"Pass your function itself, not {type(fn).__name__}.")
    sizes = (world_size, world_size + 1)  # a second size refuses a hard-coded world size
    for size in sizes:
        start = torch.stack([starting_values(r, size) for r in range(size)]).double()  # (ranks, slots)
        expected, total = start.mean(0), start.sum(0)
        try:
            results, calls = spawn_counting(fn, size, timeout=timeout)
        except WorkerTimeout:
            return Feedback(False, "Your function hung: every rank must call the same collectives in the same "
                                   "order.")
        except WorkerError as err:
            headline = err.failures[0].headline()
            if "AVG" in headline:
                return Feedback(False, "This torch's gloo has no ReduceOp.AVG: sum with ReduceOp.SUM, then divide.")
            return Feedback(False, f"Your function raised on a rank:\n{headline}")
        for rank, value in enumerate(results):
            try:
                got = torch.as_tensor(value, dtype=torch.float64)  # a list, tuple or numpy array is fine too
            except (TypeError, ValueError, RuntimeError):
                got = None
            if got is None or got.shape != expected.shape:
                return Feedback(False, f"Rank {rank} returned {value!r}; return the averaged tensor of "
                                       f"{size} values.")
            if torch.allclose(got, expected):
                continue
            if torch.allclose(got, total):
                return Feedback(False, f"Rank {rank} holds the sum {got.tolist()}: divide by world_size.")
            if torch.allclose(got, start[rank]):
                return Feedback(False, f"Rank {rank} still holds its own values: call dist.all_reduce on them.")
            divisor = constant_divisor(got, total)
            if divisor is not None:
                return Feedback(False, f"With {size} ranks, rank {rank} holds the sum divided by {divisor}: "
                                       "divide by world_size (dist.get_world_size()), not by a fixed number.")
            return Feedback(False, f"With {size} ranks, rank {rank} returned {got.tolist()}, expected "
                                   f"{expected.tolist()}.")
        silent = rank_without_communication(calls)
        if silent is not None:
            return Feedback(False, f"Rank {silent} holds the mean, but no collective was called: it computed "
                                   "every rank's values itself, which works only because starting_values is a "
                                   "formula; a real rank holds data no other rank has. Use dist.all_reduce on "
                                   "the rank's own values, then divide by world_size.")
    return Feedback(True, f"Every rank holds the mean, with {sizes[0]} ranks and with {sizes[1]}. "
                          "all_reduce(SUM) / world_size works on every backend and torch version; DDP averages "
                          "gradients with the same sum and division, dividing first so that fp16 sums cannot "
                          "overflow (notebook 04).")


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


def fixed_barrier(fn: Callable[[int, int], Any], world_size: int = 2, timeout: float = 5.0) -> Feedback:
    """Notebook 08's exercise: ``fn(rank, world_size)`` must return, on every rank, the mean over ranks of
    each rank's loss ``rank + 1``, every rank calling the same collectives in the same order. It runs with
    ``world_size`` ranks and with one more, and the mean must come through a collective.

    Example: ``fixed_barrier(lambda rank, world_size: rank + 1)`` says rank 0 kept its own loss.
    """
    if not callable(fn):
        return Feedback(False, f"Pass your function itself, not {type(fn).__name__}.")
    sizes = (world_size, world_size + 1)  # a second size refuses a hard-coded world size
    for size in sizes:
        expected = (size + 1) / 2
        try:
            results, calls = spawn_counting(fn, size, timeout=timeout)
        except WorkerTimeout as err:
            return Feedback(False, _hang_message(err, getattr(fn, "__name__", "")))
        except WorkerError as err:
            raised = [failure for failure in err.failures if failure.exc_type is not None]
            hint = "" if raised else " (a rank dying inside a collective: the ranks called different ones or shapes)"
            return Feedback(False, f"A rank failed{hint}:\n{(raised or err.failures)[0].headline()[:300]}")
        for rank, value in enumerate(results):
            number = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
            if not isinstance(number, (int, float)) or isinstance(number, bool):
                return Feedback(False, f"Rank {rank} returned {value!r}: return the mean loss as a number on every "
                                       "rank (loss.item()), not only on rank 0.")
            if abs(number - expected) < 1e-6:
                continue
            if abs(number - (rank + 1)) < 1e-6:
                return Feedback(False, f"Rank {rank} returned its own loss {number:g}: it never took part in the "
                                       "all_reduce. Call dist.all_reduce on every rank.")
            if abs(number - expected * size) < 1e-6:
                return Feedback(False, f"Rank {rank} returned the sum {number:g}: divide by world_size for the mean.")
            divisor = expected * size / number if number else 0.0
            if divisor > 1.5 and abs(divisor - round(divisor)) < 1e-6:
                return Feedback(False, f"With {size} ranks, rank {rank} returned {number:g}, the sum divided by "
                                       f"{round(divisor)}: divide by world_size (dist.get_world_size()), not a "
                                       "constant.")
            return Feedback(False, f"Rank {rank} returned {number:g}, expected the mean {expected:g}: all_reduce "
                                   "(SUM) once on every rank, then divide by world_size once.")
        silent = rank_without_communication(calls)
        if silent is not None:
            return Feedback(False, f"Rank {silent} returned the mean {expected:g}, but no collective was called: it "
                                   "worked the mean out from a formula, while a real rank knows only its own loss. "
                                   "Call dist.all_reduce on the loss on every rank, then divide by world_size.")
    return Feedback(True, f"Every rank returned the mean loss, with {sizes[0]} ranks ({(sizes[0] + 1) / 2:g}) and "
                          f"with {sizes[1]} ({(sizes[1] + 1) / 2:g}): every rank called the same collective, so none "
                          "waited for ever.")
