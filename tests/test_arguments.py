"""dtlib.arguments: the one place that checks the numbers callers pass; each refusal names the argument."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dtlib import arguments


def test_accepted_values_come_back_in_the_type_the_code_needs():
    assert arguments.finite("x", 7) == 7.0 and isinstance(arguments.finite("x", np.float32(0.5)), float)
    assert arguments.whole("world_size", 8.0) == 8 and arguments.whole("n", np.int64(3)) == 3
    assert arguments.count("steps", np.int64(3)) == 3 and arguments.count("offset", -2) == -2
    assert type(arguments.count("steps", np.int8(2))) is int
    assert arguments.seconds("timeout", 30) == 30.0
    assert arguments.seconds("timeout", None) is None and arguments.seconds("timeout", math.inf) is None


@pytest.mark.parametrize("check, value, message", [
    (arguments.finite, math.nan, "x must be a finite number, got nan"),
    (arguments.finite, math.inf, "x must be a finite number, got inf"),
    (arguments.finite, True, "x must be a finite number, got True"),
    (arguments.finite, "7", "x must be a finite number, got '7'"),
    (arguments.finite, -1, "x must be >= 0, got -1"),
    (arguments.whole, 2.5, "x must be a whole number, got 2.5"),
    (arguments.whole, 0, "x must be >= 1, got 0"),
    (arguments.count, 3.0, r"x must be a whole number \(an int\), got 3.0"),
    (arguments.count, False, r"x must be a whole number \(an int\), got False"),
    (lambda name, value: arguments.count(name, value, 1), 0, "x must be >= 1, got 0"),
    (arguments.seconds, 0, "x must be a positive number of seconds or None, got 0"),
    (arguments.seconds, -1.5, "x must be a positive number of seconds or None, got -1.5"),
    (arguments.seconds, math.nan, "x must be a positive number of seconds or None, got nan"),
    (arguments.seconds, "10", "x must be a positive number of seconds or None, got '10'"),
])
def test_wrong_values_are_refused_by_name(check, value, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        check("x", value)
