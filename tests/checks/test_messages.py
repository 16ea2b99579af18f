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


def test_a_hang_message_says_where_each_rank_was_and_never_blames_a_rank_outside_the_answer():
    """From the ranks' stacks (most recent call first): a rank in a collective waited there; a rank in its own code
    (time.sleep) was running it, in no collective; ranks all past the answer were slow, not stuck."""
    from dtlib.checks.skeleton import same_collectives_hang
    from dtlib.errors import WorkerTimeout

    in_all_reduce = ('File "/x/torch/distributed/distributed_c10d.py", line 2800 in all_reduce\n'
                     'File "<cell>", line 4 in fn')
    sleeping = 'File "<cell>", line 3 in fn'
    recording = 'File "/x/dtlib/checks/skeleton.py", line 200 in _recorded'
    said = same_collectives_hang(WorkerTimeout(5, {0: in_all_reduce, 1: sleeping}, []), "fn")
    assert "rank 0 waited in all_reduce (line 4, in fn); rank 1 was still running line 3 of fn, in no collective" \
        in said, said
    said = same_collectives_hang(WorkerTimeout(5, {0: recording}, [1]), "fn")
    assert said.startswith("It did not finish within the checker's 5 s, but no rank was waiting: rank 0 was "
                           "outside"), said
    assert "same collectives" not in said
