"""The numbers a caller passes, checked in one place: each function returns the value in the type the
code needs, or raises a ValueError that names the argument and says what it must be.

    finite("num_params", 7e9)          # 7e9; NaN, inf, True and "7e9" refused
    whole("world_size", 8.0)           # 8: any whole number (a formula's input); 8.5 refused
    count("steps", numpy.int64(3))     # 3: an int type only (what torch's samplers take); 3.0 and True refused
    seconds("timeout", 30)             # 30.0; None or inf mean no limit; 0 and -1 refused

Torch is not imported here: every layer of dtlib may use it.
"""

from __future__ import annotations

import math
import numbers
import operator


def finite(name: str, value: object, minimum: float = 0.0) -> float:
    """``value`` as a float, unless it is not a finite real number >= ``minimum``: NaN and infinity would
    otherwise flow through every formula (NaN compares False with everything, so no later ``<=`` catches
    it). Example: ``finite("num_params", 7e9)``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum:g}, got {value!r}")
    return float(value)


def whole(name: str, value: object, minimum: int = 1) -> int:
    """``value`` as an int: any whole number (``8``, ``8.0``, ``numpy.int64(8)``) >= ``minimum``.
    Example: ``whole("world_size", 8.0) == 8``."""
    number = finite(name, value, minimum)
    if not number.is_integer():
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    return int(number)


def count(name: str, value: object, minimum: int | None = None) -> int:
    """``value`` as an int, if it is an integer of any kind (``int``, ``numpy.int64``, a 0-d integer
    tensor: whatever ``operator.index`` takes; not ``bool``, not ``3.0``) and >= ``minimum`` if one is
    given: for counts handed to torch. Example: ``count("steps", 3) == 3``."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)  # type: ignore[call-overload]
    except TypeError:
        raise ValueError(f"{name} must be a whole number (an int), got {value!r}") from None
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return number


def seconds(name: str, value: object) -> float | None:
    """A time limit in seconds: a positive number, or None for no limit (an infinite one is no limit
    either). Example: ``seconds("timeout", 30) == 30.0``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds or None, got {value!r}")
    return None if math.isinf(value) else float(value)
