"""Reading a learner's numbers: what a value is, and which constant a wrong one was divided by.

Shared by the checkers in :mod:`dtlib.checks.rank_functions`, :mod:`dtlib.checks.training`, :mod:`dtlib.checks.layouts`
and :mod:`dtlib.checks.cluster`.
"""

from __future__ import annotations

from typing import Any

import torch

from dtlib.checks import typed


def as_number(value: Any) -> Any:
    """A one-element tensor or array as a Python number; anything else unchanged.

    Example: ``as_number(torch.tensor([3.0])) == 3.0``; ``as_number(None) is None``.
    """
    try:
        return value.item()
    except (AttributeError, RuntimeError, ValueError):
        return value


def equals(value: Any, number: float) -> bool:
    """Whether ``value`` is one number equal to ``number`` (a tensor of two elements is not, and never raises).

    Example: ``equals(torch.tensor([3.0]), 3)`` is True; ``equals(torch.tensor([3.0, 3.0]), 3)`` is False.
    """
    value = as_number(value)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == number


def constant_divisor(got: Any, total: Any) -> int | None:
    """The whole number c with got == total / c, if there is one: the constant a learner divided by.

    Example: ``constant_divisor([1.0, 2.0], [4.0, 8.0]) == 4``.
    """
    got, total = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(total, dtype=torch.float64)
    overlap = float((got * total).sum())
    if not 0 < overlap < float("inf"):
        return None
    whole = round(float((total * total).sum()) / overlap)  # least squares fit of total = c * got
    if whole >= 1 and torch.allclose(got, total / whole, rtol=1e-4, atol=1e-6):
        return whole
    return None


def constant_factor(got: Any, target: Any, rtol: float = 1e-4) -> float | None:
    """The number c with got == c * target, element by element (to ``rtol``), if there is one (shapes must match).

    Example: ``constant_factor([0.75, 1.5], [1.0, 2.0]) == 0.75``; ``constant_factor([1.0, 1.0], [1.0, 2.0])``
    is None.
    """
    try:
        got, target = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(target, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        return None
    norm = float((target * target).sum())
    if got.shape != target.shape or not 0 < norm < float("inf") or not bool(got.isfinite().all()):
        return None
    factor = float((got * target).sum()) / norm  # least squares fit of got = c * target
    return factor if torch.allclose(got, factor * target, rtol=rtol, atol=1e-6) else None


def whole_answer(answer: Any, what: str) -> int | str:
    """A typed answer as a whole number, or what to say about it (``what`` names its unit: "micro-batches").

    Example: ``whole_answer(torch.tensor(4.0), "stages") == 4``; ``whole_answer(2.5, "stages")`` is a message.
    """
    read = typed.number(answer, what, whole=True)  # a Decimal, a NumPy or tensor number, "4" ...
    if isinstance(read, str):
        return read
    if read != int(read):
        return f"Answer with a whole number of {what}, not {read!r}."
    return int(read)
