"""Checkers of a function every rank runs, ``fn(rank, world_size, given)``, on data the checker owns.

Each call draws new data: every rank gets its own random float32 numbers (on ``dtlib.rank_device()``), a
length that is not the world size, and one process works out the right answer from all of them (the oracle).
A function that ignores its input, or that knows it, cannot pass. Each is an exercise written as data
(:class:`dtlib.checks.skeleton.RankExercise`); :func:`dtlib.checks.skeleton.judge` runs it on two world sizes,
one of them odd, names a hang, records what every collective carried, and refuses an answer whose collectives
carried something other than the rank's own data.

Example: ``dtlib.checks.sum_of_ranks(lambda rank, world_size, x: x)`` says the all-reduce is missing.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dtlib import calls
from dtlib.checks._numbers import constant_factor
from dtlib.checks.feedback import Feedback
from dtlib.checks.skeleton import (
    UNREADABLE,
    Answer,
    Carried,
    RankExercise,
    dropped_functional,
    dropped_functional_hint,
    judge,
    reduce_hint,
    same_collectives_hang,
)
from dtlib.errors import WorkerError

#: The collectives that move a rank's data to others (a barrier and a receive carry none of the rank's own), by
#: the names every observer gives them (dtlib.calls: all_gather_single for c10d's, whichever spelling ran).
_SENDING = frozenset(op.call for op in (*calls.C10D.values(), *calls.FUNCTIONAL.values())
                     if op.kind not in ("none", "barrier"))


def _raised(err: WorkerError) -> str:
    cause = err.cause()
    if cause.exc_type is None:  # it exited or was killed: the other ranks' errors only followed from it
        return (f"A rank left your function before the end ({cause.headline()}); the others then lost it in a "
                "collective. Every rank must run to the end of the function and return its value.")
    return f"Your function raised on a rank:\n{cause.headline()}"


def _vectors(size: int, generator: torch.Generator) -> list[torch.Tensor]:
    """Every rank's numbers: float32, random, fractional, about 10 * (rank + 1) times a scale of 0.01 to 100 that
    differs from slot to slot (rounding, a 16-bit wire or an integer cast then shows at the small slots). The
    length is drawn too, and ``length - size`` always has the parity of ``size``, so that no answer written for
    a length of ``world_size`` plus a constant passes at both world sizes a checker runs (``size`` and one more)."""
    length = size + 2 + size % 2 + 2 * int(torch.randint(0, 3, (), generator=generator))
    scales = 10.0 ** (torch.randperm(length, generator=generator) % 5 - 2).double()
    return [((torch.randn(length, generator=generator, dtype=torch.float64) * 3 + 10 * (rank + 1)) * scales).float()
            for rank in range(size)]


def _losses(size: int, generator: torch.Generator) -> list[torch.Tensor]:
    """Every rank's loss: a float32 scalar between 1 and 4, as a cross-entropy's would be."""
    return [torch.empty((), dtype=torch.float32).uniform_(1.0, 4.0, generator=generator) for _ in range(size)]


def _stacked(inputs: Sequence[Any]) -> torch.Tensor:
    return torch.stack([torch.as_tensor(given, dtype=torch.float64) for given in inputs])


def _as_float64(value: Any) -> Any:
    try:
        return torch.as_tensor(value, dtype=torch.float64)  # a list, tuple or numpy array is fine too
    except (TypeError, ValueError, RuntimeError):
        return UNREADABLE


def _close(got: Any, expected: Any) -> bool:
    """Whether ``got`` is ``expected`` to about 1%% of a percent: for hints, which recognise what a wrong answer
    computed (its own input, a sum, a mean), not for the verdict (:func:`_exact`)."""
    got, expected = _as_float64(got), _as_float64(expected)
    if got is UNREADABLE or expected is UNREADABLE or got.shape != expected.shape:
        return False
    return torch.allclose(got, expected, rtol=1e-5, atol=1e-5)


#: How far a right float32 answer may be from the float64 oracle, relative to each slot: float32's rounding
#: (2^-24) in each of the few additions and the one division a sum or a mean of up to 8 ranks takes.
FLOAT32_RTOL = 1e-6


def _exact(got: Any, expected: Any) -> bool:
    """The verdict's comparison, at float32's precision, slot by slot: a sum or mean rounded to a few decimals,
    or carried in 16 bits, differs at the inputs' small slots by far more than float32's own rounding."""
    got, expected = _as_float64(got), _as_float64(expected)
    if got is UNREADABLE or expected is UNREADABLE or got.shape != expected.shape:
        return False
    return torch.allclose(got, expected, rtol=FLOAT32_RTOL, atol=0.0)


def _floating(value: Any) -> bool:
    """Whether a returned value holds floating-point numbers (a tensor, array, list or tuple of them)."""
    try:
        return torch.as_tensor(value).is_floating_point()
    except (TypeError, ValueError, RuntimeError):
        return True  # not for this hint to judge


def _low_precision(a: Answer) -> bool:
    return isinstance(a.returned, torch.Tensor) and a.returned.dtype in (torch.float16, torch.bfloat16)


def _carries(entry: Carried, own: torch.Tensor, size: int) -> bool:
    """Whether a collective sent the rank's own data: itself, or scaled (to 1%: a float16 copy still counts). A
    single number is proportional to any other, so a loss counts only as itself, / world_size or * world_size."""
    carried_in = getattr(torch, entry.dtype, None) if entry.dtype else None  # a 16-bit copy rounds the number
    if isinstance(carried_in, torch.dtype) and not carried_in.is_floating_point and entry.sent.shape == own.shape:
        scale = float((entry.sent * own).sum()) / max(float((own * own).sum()), 1e-300)  # fixed point: x * scale
        return scale > 0 and float((entry.sent - scale * own).abs().max()) <= 1.0 + 1e-9  # cut to whole units
    factor = constant_factor(entry.sent, own.flatten(), rtol=1e-2)
    if factor is None or factor == 0:
        return False
    precision = max(1e-6, torch.finfo(carried_in).eps if isinstance(carried_in, torch.dtype)
                    and carried_in.is_floating_point else 0.0)
    return own.numel() > 1 or any(abs(factor - c) < precision * c for c in (1.0, 1.0 / size, float(size)))


def _carried_by(entries: Sequence[Carried], own: torch.Tensor, size: int) -> bool:
    """Whether a rank's collectives carried its own data: one of them all of it (:func:`_carries`), or all of it
    inside what they sent together, in order: in halves, or packed beside other numbers (a count, say)."""
    sending = [entry for entry in entries if entry.call in _SENDING]
    if any(_carries(entry, own, size) for entry in sending):
        return True
    together, width = torch.cat([entry.sent for entry in sending] or [own.new_zeros(0)]), own.numel()
    return any(_carries(Carried("", together[start:start + width], torch.zeros(0)), own, size)
               for start in range(together.numel() - width + 1))


def _stand_in(a: Answer) -> Carried | None:
    """A collective that sent a rank's data when none of the rank's sent its own: a stand-in travelled."""
    sending = [entry for entry in a.carried[a.rank] if entry.call in _SENDING]
    if not sending or _carried_by(sending, a.own, a.size):
        return None
    return sending[0]


def _short(tensor: Any) -> str:
    values = [round(float(v), 4) for v in torch.as_tensor(tensor, dtype=torch.float64).flatten()[:4]]
    more = ", ..." if torch.as_tensor(tensor).numel() > 4 else ""
    return "[" + ", ".join(f"{v:g}" for v in values) + more + "]"


def _contrast(value: Any, expected: Any) -> tuple[str, str]:
    """``value`` and ``expected`` shown where they first differ, with as many digits as it takes to see it: four
    numbers from the first wrong one on (named by its index when it is not among the first four), so that a
    message never reads "returned [21.98, 24.33, ...], expected [21.98, 24.33, ...]". Example:
    ``_contrast([1.0, 2.0, 3.00001], [1.0, 2.0, 3.0])`` is ``("[1, 2, 3.00001]", "[1, 2, 3]")``."""
    try:
        got = torch.as_tensor(value, dtype=torch.float64).flatten()
        want = torch.as_tensor(expected, dtype=torch.float64).flatten()
    except (TypeError, ValueError, RuntimeError):
        return repr(value)[:60], _short(expected)
    if got.shape != want.shape:
        return _short(got), _short(want)
    wrong = (~torch.isclose(got, want, rtol=1e-6, atol=1e-9)).nonzero().flatten().tolist()
    first = wrong[0] if wrong else 0
    start = 0 if first < 4 else first
    def differs(d: int) -> bool:
        return f"{float(got[first]):.{d}g}" != f"{float(want[first]):.{d}g}"
    digits = next((d for d in range(4, 13) if not wrong or differs(d)), 12)

    def shown(numbers: torch.Tensor) -> str:
        part = ", ".join(f"{float(v):.{digits}g}" for v in numbers[start:start + 4])
        return ("[" + ("..., " if start else "") + part + (", ..." if numbers.numel() > start + 4 else "") + "]"
                + (f" (from index {start})" if start else ""))
    return shown(got), shown(want)


def _lost_digits(a: Answer) -> bool:
    """Whether the rank's value is the right one to 1% (to 10% where its collectives carried whole numbers, which
    cut a small number's digits by more), but not to float32's precision: digits lost on the way."""
    got, want = _as_float64(a.value), _as_float64(a.expected)
    whole = any(entry.dtype.startswith(("int", "uint")) for entry in a.carried[a.rank]) if a.carried else False
    return (got is not UNREADABLE and got.shape == want.shape
            and torch.allclose(got, want, rtol=1e-1 if whole else 1e-2, atol=0.0))


#: What a narrow dtype keeps of a float32 number, said of the dtype a collective carried.
_KEEPS_DIGITS = {"float16": "which keeps about 3 significant digits", "bfloat16": "which keeps about 2"}
_WHOLE = "which holds whole numbers only (a scale applied first keeps as many decimals as it has zeros, no more)"


def _lost_digits_said(what: str) -> Callable[[Answer], str]:
    def say(a: Answer) -> str:
        got, want = _contrast(a.value, a.expected)
        narrow = sorted({entry.dtype for entry in a.carried[a.rank] if entry.dtype not in ("", "float32", "float64")}
                        if a.carried else set())
        how = (f"Rank {a.rank}'s collectives carried {' and '.join(narrow)}, "
               f"{' and '.join(_KEEPS_DIGITS.get(dtype, _WHOLE) for dtype in narrow)}: " if narrow else
               "Digits were lost on the way (rounded, cast to a whole number, or carried in 16 bits): ")
        return (f"With {a.size} ranks, rank {a.rank} returned {got}, and the {what} is {want}: close, but not to "
                f"float32's precision. {how}keep the numbers float32 from the input to the result.")
    return say


def _rounded_everywhere(a: Answer) -> bool:
    """Whether every rank sent its own input rounded to whole numbers (a rank whose input was already whole, or
    one whose stand-in only happens to equal its rounded input, does not make it so). Only for inputs of several
    numbers: a loss between 1 and 4 rounds to 1, 2, 3 or 4, which a stand-in such as rank + 1 often equals."""
    for rank, entries in enumerate(a.carried):
        own = torch.as_tensor(a.inputs[rank], dtype=torch.float64).flatten()
        if own.numel() < 2 or torch.equal(own, own.round()) or not any(
                entry.call in _SENDING and entry.sent.shape == own.shape and torch.equal(entry.sent, own.round())
                for entry in entries):
            return False
    return bool(a.carried)


def _stand_in_said(name: str, fix: str) -> Callable[[Answer], str]:
    def say(a: Answer) -> str:
        entry = _stand_in(a)
        assert entry is not None
        if _rounded_everywhere(a):
            return (f"Rank {a.rank} called dist.{entry.call} on its {name} rounded to whole numbers "
                    f"({_short(entry.sent)}, where its {name} is {_short(a.own)}): pass the {name} as it is, in "
                    "float32, and the collective keeps the fractions.")
        own, part = a.own.flatten(), entry.sent.flatten()
        if 0 < part.numel() < own.numel() and any(torch.equal(own[start:start + part.numel()], part)
                                                  for start in range(own.numel() - part.numel() + 1)):
            return (f"Rank {a.rank} called dist.{entry.call} on part of its {name}, {part.numel()} of its "
                    f"{own.numel()} numbers ({_short(part)} of {_short(own)}): the others never left the rank. "
                    f"{fix}")
        return (f"Rank {a.rank} called dist.{entry.call}, but on {_short(entry.sent)}, not on its own {name} "
                f"({_short(a.own)}): a collective combines what each rank puts in, and only this rank holds its "
                f"{name}. {fix}")
    return say


def _kept_largest(a: Answer) -> bool:
    """Whether every rank's all-reduce left the ranks' largest values (ReduceOp.MAX), and this rank's answer holds
    no undefined numbers (those have a hint of their own)."""
    if a.value is not UNREADABLE and bool(torch.as_tensor(a.value).isnan().any()):
        return False
    largest, total = a.stacked.amax(0).flatten(), a.stacked.sum(0).flatten()
    return all(any(entry.call == "all_reduce" and _close(entry.received, largest) and not _close(entry.received, total)
                   for entry in entries) for entries in a.carried)


def _ratios(entries: Sequence[Carried], own: float) -> list[float]:
    """Each number a rank's collectives sent (up to 64 a call), divided by the rank's own one number."""
    return [value / own for entry in entries if entry.call in _SENDING and entry.sent.numel() <= 64
            for value in entry.sent.tolist()] if own else []


def _one_scale(inputs: Sequence[Any], carried: Sequence[Sequence[Carried]]) -> bool:
    """Whether every rank's collectives sent its own single number times one factor, the same on every rank (to
    1%): a loss carried in fixed point (``round(loss * 1000)`` as an integer), say. A stand-in has no such
    factor: the same number sent by every rank, or one unrelated to the rank's own, is a different multiple of
    each rank's input."""
    if not all(torch.as_tensor(given).numel() == 1 for given in inputs):
        return False
    ratios = [_ratios(entries, float(torch.as_tensor(inputs[rank]))) for rank, entries in enumerate(carried)]
    return any(factor != 0 and all(any(abs(other - factor) <= 1e-2 * abs(factor) for other in rest)
                                   for rest in ratios[1:]) for factor in ratios[0])


def _moved(name: str) -> Callable[[Sequence[Any], Sequence[Sequence[Carried]]], str | None]:
    """Once every value is right: each rank's collectives must have carried its own data (a single number may
    travel at any scale that is the same on every rank: :func:`_one_scale`)."""
    def check(inputs: Sequence[Any], carried: Sequence[Sequence[Carried]]) -> str | None:
        if _one_scale(inputs, carried):
            return None
        for rank, entries in enumerate(carried):
            own = torch.as_tensor(inputs[rank], dtype=torch.float64)
            if not _carried_by(entries, own.flatten(), len(inputs)):
                return (f"Every rank returned the right numbers, but no collective of rank {rank} carried its {name}: "
                        f"the numbers reached the other ranks some other way. Pass {name} (or {name} / world_size) "
                        "to the collective itself.")
        return None
    return check


def _factor(a: Answer, base: torch.Tensor) -> float | None:
    return constant_factor(a.value, base) if a.value is not UNREADABLE else None


#: How near a fitted factor must be to the one a hint names, relative: float32's rounding of a sum and two
#: divisions moves a factor of 1/9 by up to about 2e-7 of itself (an absolute 1e-6 on the divisor, 9, missed the
#: "divided twice" hint in 19 of 3,000 draws; this bound in none).
FACTOR_RTOL = 1e-5


def _is_factor(a: Answer, base: torch.Tensor, wanted: float) -> bool:
    factor = _factor(a, base)
    return factor is not None and abs(factor - wanted) <= FACTOR_RTOL * abs(wanted)


def _whole_divisor(a: Answer, base: torch.Tensor) -> int | None:
    """The whole number c > 1 that the answer is base / c, if it is."""
    factor = _factor(a, base)
    if not factor or factor <= 0:
        return None
    divisor = 1 / factor
    return round(divisor) if divisor > 1.5 and abs(divisor - round(divisor)) <= FACTOR_RTOL * divisor else None


def _shape_of(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return repr(value) if len(repr(value)) < 60 else type(value).__name__


# -- notebook 01: the sum over ranks ---------------------------------------------------------------------------------


def _sum_said(a: Answer, hint: str) -> str:
    return (f"With {a.size} ranks, rank {a.rank} should return the sum of every rank's x, "
            f"{_contrast(a.value, a.expected)[1]}, but {hint}")


SUM_OF_RANKS = RankExercise(
    expected=lambda inputs: _stacked(inputs).sum(0),
    read=_as_float64,
    same=_exact,
    inputs=_vectors,
    hints=[
        (lambda a: a.returned is None, lambda a: _sum_said(
            a, "it returned None: return the tensor after the all-reduce.")),
        (lambda a: a.value is not UNREADABLE and a.value.numel() == 1 and a.expected.numel() > 1
         and (_close(a.value, a.expected.sum()) or _close(a.value, a.own.sum())),
         lambda a: _sum_said(a, f"it returned one number, the total of x's {a.own.numel()} elements: the sum runs over "
                                "the ranks, slot by slot. All-reduce x itself, not x.sum().")),
        (lambda a: _stand_in(a) is not None,
         _stand_in_said("x", "Call dist.all_reduce(x), then return x.")),
        (lambda a: a.value is UNREADABLE or a.value.shape != a.expected.shape, lambda a: _sum_said(
            a, f"it returned {_shape_of(a.returned)}: return a tensor shaped like x, {a.own.numel()} numbers.")),
        (lambda a: a.called("reduce") and not a.called("all_reduce"), reduce_hint),
        (_kept_largest, lambda a: _sum_said(
            a, "it holds the largest value of each slot: ReduceOp.MAX keeps the largest; add with ReduceOp.SUM "
               "(all_reduce's default).")),
        (lambda a: dropped_functional(a, a.own), dropped_functional_hint),
        (lambda a: _close(a.value, a.own), lambda a: _sum_said(
            a, "it returned its own x: was dist.all_reduce called on x before returning?")),
        (lambda a: _low_precision(a), lambda a: _sum_said(
            a, f"it computed in {str(a.returned.dtype).removeprefix('torch.')}, which keeps about 3 significant "
               "digits: all-reduce x in its own dtype, float32.")),
        (lambda a: not _floating(a.returned), lambda a: _sum_said(
            a, "it returned whole numbers: x holds fractions; keep it float32 and do not round.")),
        (lambda a: _is_factor(a, a.expected, a.size), lambda a: _sum_said(
            a, "it came out world_size times too big: put each rank's x into the collective once, not x * "
               "world_size or a sum already made.")),
        (lambda a: _is_factor(a, a.expected, 1 / a.size), lambda a: _sum_said(
            a, "it holds the mean, the sum divided by world_size: ReduceOp.SUM (all_reduce's default), and no "
               "division.")),
        (lambda a: a.size != a.world_size and _is_factor(a, a.expected, a.world_size / a.size), lambda a: _sum_said(
            a, f"it holds {a.world_size}/{a.size} of the sum: a fixed {a.world_size}, the first run's world size, "
               f"stands where the {a.size} ranks of this run belong. Let the collective add up the ranks that are "
               "there (ReduceOp.SUM), with no fixed number.")),
        (_lost_digits, _lost_digits_said("sum")),
    ],
    otherwise=lambda a: _sum_said(a, f"it returned {_contrast(a.value, a.expected)[0]}: call dist.all_reduce(x) "
                                     "(ReduceOp.SUM) once on "
                                     "every rank and return x."),
    no_collective=lambda rank, expected, calls: (
        f"Rank {rank} returned the sum, but no collective was called. Use dist.all_reduce to add up the ranks' x."),
    right=lambda first, second, values: (f"Every rank returned the sum of every rank's x, with {first} ranks and with "
                                 f"{second}, on new random numbers each time: only a collective could have added "
                                 "them up."),
    hang=same_collectives_hang,
    failure=_raised,
    moved=_moved("x"),
)


def sum_of_ranks(fn: Callable[[int, int, torch.Tensor], Any], world_size: int = 3, timeout: float = 30.0,
                 seed: int | None = None) -> Feedback:
    """Notebook 01: ``fn(rank, world_size, x)`` gets this rank's ``x``, float32 numbers of its own on the rank's
    device, and must return, on every rank, the sum over ranks of ``x``, slot by slot, computed through a
    collective that carried ``x``. It runs with ``world_size`` ranks and with one more, on new numbers each call
    (``seed`` repeats a draw).

    Example: ``sum_of_ranks(lambda rank, world_size, x: x)`` says the all-reduce is missing.
    """
    return judge(fn, SUM_OF_RANKS, world_size, timeout, seed)


# -- notebook 02: the mean over ranks, without ReduceOp.AVG -----------------------------------------------------------


def _mean_said(a: Answer, hint: str) -> str:
    return f"With {a.size} ranks, rank {a.rank} {hint}"


AVERAGE_OF_RANKS = RankExercise(
    expected=lambda inputs: _stacked(inputs).mean(0),
    read=_as_float64,
    same=_exact,
    inputs=_vectors,
    hints=[
        (lambda a: _stand_in(a) is not None,
         _stand_in_said("values", "Call dist.all_reduce(values), then divide by world_size.")),
        (lambda a: a.value is not UNREADABLE and a.value.numel() == 1 and a.expected.numel() > 1
         and _close(a.value, a.expected.mean()),
         lambda a: _mean_said(a, "returned one number, the mean over the slots too: average over the ranks only, "
                                 "slot by slot, and return the whole tensor.")),
        (lambda a: a.value is UNREADABLE or a.value.shape != a.expected.shape,
         lambda a: _mean_said(a, f"returned {_shape_of(a.returned)}; return the averaged tensor of "
                                 f"{a.own.numel()} values, shaped like values.")),
        (lambda a: a.called("reduce") and not a.called("all_reduce"), reduce_hint),
        (_kept_largest, lambda a: _mean_said(
            a, "holds the largest values, not the mean: ReduceOp.MAX keeps the largest; sum with ReduceOp.SUM, then "
               "divide by world_size.")),
        (lambda a: dropped_functional(a, a.own) or dropped_functional(a, a.own / a.size), dropped_functional_hint),
        (lambda a: a.called("all_reduce") and _is_factor(a, a.own, 1 / a.size),
         lambda a: _mean_said(a, "holds its own values divided by world_size: the all-reduce had not finished when "
                                 "you divided. With async_op=True, call .wait() on the work it returns first.")),
        (lambda a: not _floating(a.returned),
         lambda a: _mean_said(a, "returned integers: the mean of the ranks' values has fractions, so keep them as "
                                 "floats and divide with /, not with //.")),
        (lambda a: _close(a.value, a.expected.floor()),
         lambda a: _mean_said(a, "holds the mean rounded down: divide with /, not with //, which throws the fraction "
                                 "away.")),
        (lambda a: _close(a.value, a.own), lambda a: _mean_said(
            a, "still holds its own values: call dist.all_reduce on them.")),
        (lambda a: _close(a.value, a.stacked.sum(0)), lambda a: _mean_said(
            a, "holds the sum of the ranks' values: divide by world_size.")),
        (lambda a: _whole_divisor(a, a.stacked.sum(0)) == a.own.numel(), lambda a: _mean_said(
            a, f"holds the sum divided by {a.own.numel()}, the number of values each rank holds (values.numel()): "
               "a mean over ranks divides by the number of ranks that added, world_size.")),
        (lambda a: _whole_divisor(a, a.stacked.sum(0)) == a.size * a.size, lambda a: _mean_said(
            a, "holds the sum divided by world_size twice: divide once.")),
        (lambda a: a.size == a.world_size and _whole_divisor(a, a.stacked.sum(0)) == a.size - 1, lambda a: _mean_said(
            a, "holds the sum divided by world_size - 1: the mean divides by the number of ranks that added their "
               "values, world_size.")),
        # divided by world_size itself is the mean: what is off is elsewhere (rounding, a dtype)
        (lambda a: _whole_divisor(a, a.stacked.sum(0)) not in (None, a.size), lambda a: _mean_said(
            a, f"holds the sum divided by {_whole_divisor(a, a.stacked.sum(0))}: divide by world_size "
               "(dist.get_world_size()), not by a fixed number.")),
        (lambda a: _low_precision(a), lambda a: _mean_said(
            a, f"computed in {str(a.returned.dtype).removeprefix('torch.')}, which keeps about 3 significant digits: "
               "average in float32, the dtype of values.")),
        (_lost_digits, _lost_digits_said("mean")),
    ],
    otherwise=lambda a: _mean_said(a, "returned {}, expected the mean {}: dist.all_reduce(values) (SUM), then divide "
                                      "by world_size.".format(*_contrast(a.value, a.expected))),
    no_collective=lambda rank, expected, calls: (
        f"Rank {rank} holds the mean, but no collective was called. Use dist.all_reduce on the rank's values, then "
        "divide by world_size."),
    right=lambda first, second, values: (
        f"Every rank holds the mean, with {first} ranks and with {second}, on new random values each time. "
        "all_reduce(SUM) / world_size works on every backend and torch version; DDP averages gradients with the "
        "same sum and division, dividing first so that fp16 sums cannot overflow (notebook 04)."),
    hang=same_collectives_hang,
    failure=lambda err: ("This torch's gloo has no ReduceOp.AVG: sum with ReduceOp.SUM, then divide."
                         if "AVG" in err.cause().headline() else _raised(err)),
    moved=_moved("values"),
)


def average_of_ranks(fn: Callable[[int, int, torch.Tensor], Any], world_size: int = 4, timeout: float = 30.0,
                     seed: int | None = None) -> Feedback:
    """Notebook 02: ``fn(rank, world_size, values)`` gets this rank's ``values``, float32 numbers of its own on
    the rank's device, and must return, on every rank, their mean over ranks, slot by slot (older torch's gloo
    has no ``ReduceOp.AVG``), computed through a collective that carried ``values``. It runs with ``world_size``
    ranks and with one more, on new numbers each call. A tensor, list, tuple or numpy array of the right numbers
    is right.

    Example: ``average_of_ranks(lambda rank, world_size, values: None)`` says nothing came back.
    """
    return judge(fn, AVERAGE_OF_RANKS, world_size, timeout, seed)


# -- notebook 08: every rank calls the collective ----------------------------------------------------------------------


def _loss(value: Any) -> Any:
    """One number, however it is held: a float, a one-number tensor, numpy array or list (``[mean]``)."""
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if hasattr(value, "item"):  # a tensor or a numpy number or array
        try:
            value = value.item()
        except (ValueError, RuntimeError):  # several numbers
            return UNREADABLE
    return float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else UNREADABLE


def _failed(err: WorkerError) -> str:
    raised = [failure for failure in err.failures if failure.exc_type is not None]
    hint = "" if raised else " (a rank dying inside a collective: the ranks called different ones or shapes)"
    return f"A rank failed{hint}:\n{(raised or err.failures)[0].headline()[:300]}"


def _one(value: float, expected: float) -> tuple[str, str]:
    """Two numbers shown with the digits that tell them apart (:func:`_contrast`, without its brackets)."""
    got, want = _contrast(value, expected)
    return got.strip("[]"), want.strip("[]")


def _near(value: Any, number: float) -> bool:
    """Equal to float32's precision (the losses' dtype): a loss rounded to 4 decimals "for the log" is not."""
    return value is not UNREADABLE and abs(value - number) <= FLOAT32_RTOL * max(1.0, abs(number))


FIXED_BARRIER = RankExercise(
    expected=lambda inputs: float(_stacked(inputs).mean()),
    read=_loss,
    same=_near,
    inputs=_losses,
    hints=[
        (lambda a: a.value is UNREADABLE,
         lambda a: (f"Rank {a.rank} returned None: return the mean loss on every rank, not only on rank 0."
                    if a.returned is None else f"Rank {a.rank} returned {_shape_of(a.returned)}: return the mean "
                    "loss as one number (loss.item()).")),
        (lambda a: _stand_in(a) is not None,
         _stand_in_said("loss", "Call dist.all_reduce(loss) on every rank, then divide by world_size.")),
        (lambda a: a.called("reduce") and not a.called("all_reduce"), reduce_hint),
        (lambda a: _near(a.value, float(a.own)),
         lambda a: f"Rank {a.rank} returned its own loss {a.value:.4g}: it never took part in the all_reduce. Call "
                   "dist.all_reduce on every rank."),
        (_kept_largest,
         lambda a: f"With {a.size} ranks, rank {a.rank}'s all_reduce left the largest loss, "
                   f"{float(a.stacked.max()):.4g}, and it returned {a.value:.4g}: ReduceOp.MAX keeps the largest; sum "
                   "with ReduceOp.SUM, then divide by world_size."),
        (lambda a: _near(a.value, float(a.stacked.sum())),
         lambda a: f"Rank {a.rank} returned the sum {a.value:.4g}: divide by world_size for the mean."),
        # divided by world_size itself is the mean, off elsewhere: a loss rounded to 4 decimals for the log, say
        (lambda a: _whole_divisor(a, a.stacked.sum()) not in (None, a.size),
         lambda a: f"With {a.size} ranks, rank {a.rank} returned {a.value:.4g}, the sum divided by "
                   f"{_whole_divisor(a, a.stacked.sum())}: divide by world_size (dist.get_world_size()), not a "
                   "constant."),
        (_lost_digits, _lost_digits_said("mean of the ranks' losses")),  # last: a loss near the mean is within 1%
    ],
    otherwise=lambda a: (f"With {a.size} ranks, rank {a.rank} returned {_one(a.value, a.expected)[0]}, expected the "
                         f"mean of the ranks' losses, {_one(a.value, a.expected)[1]}: all_reduce (SUM) the loss once "
                         "on every rank, then divide by world_size once, and return it as it is (not rounded)."),
    no_collective=lambda rank, expected, calls: (
        f"Rank {rank} returned the mean, but no collective was called. Call dist.all_reduce on the loss on every "
        "rank, then divide by world_size."),
    right=lambda first, second, values: (
        f"Every rank returned the mean of the ranks' losses, with {first} ranks and with {second}: every rank "
        "called the same collective, so none waited for ever."),
    hang=same_collectives_hang,
    failure=_failed,
    moved=_moved("loss"),
)


def fixed_barrier(fn: Callable[[int, int, torch.Tensor], Any], world_size: int = 2, timeout: float = 5.0,
                  seed: int | None = None) -> Feedback:
    """Notebook 08's exercise: ``fn(rank, world_size, loss)`` gets this rank's ``loss``, a float32 scalar of its
    own on the rank's device, and must return, on every rank, the mean of the ranks' losses as a number, every
    rank calling the same collectives in the same order. It runs with ``world_size`` ranks and with one more, on
    new losses each call, and the mean must come through a collective that carried the loss.

    Example: ``fixed_barrier(lambda rank, world_size, loss: loss.item())`` says rank 0 kept its own loss.
    """
    return judge(fn, FIXED_BARRIER, world_size, timeout, seed)
