"""The numbers a checker's message shows: where the answer and the expected value differ, visibly."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dtlib.checks import rank_functions
from dtlib.checks.rank_functions import _contrast


def test_two_values_are_shown_where_they_first_differ_with_the_digits_that_differ():
    assert _contrast([1.0, 2.0, 3.00001], [1.0, 2.0, 3.0]) == ("[1, 2, 3.00001]", "[1, 2, 3]")
    got, want = _contrast([21.981, 24.33, 26.1, 28.5, 30.12, 31.0], [21.981, 24.33, 26.1, 28.5, 30.121, 31.0])
    assert got == "[..., 30.12, 31] (from index 4)" and want == "[..., 30.121, 31] (from index 4)"
    assert _contrast([float("nan")] * 2, [1.0, 2.0]) == ("[nan, nan]", "[1, 2]")
    assert _contrast("not numbers", [1.0]) == ("'not numbers'", "[1]")


def _sum_rounded(rank, world_size, x):
    dist.all_reduce(x)
    return torch.round(x, decimals=2)


@pytest.mark.timeout(120)
def test_a_sum_rounded_to_two_decimals_is_refused_with_the_digits_that_differ():
    """The message once read "returned [21.98, 24.33, ...], expected [21.98, 24.33, ...]": the same numbers."""
    feedback = rank_functions.sum_of_ranks(_sum_rounded)
    assert not feedback.ok
    assert "close, but not to float32's precision" in feedback.message, feedback.message
    returned = feedback.message.split(" returned ", 1)[1].split(", and the sum is", 1)[0]
    expected = feedback.message.split("and the sum is ", 1)[1].split(": close", 1)[0]
    assert returned != expected, feedback.message
