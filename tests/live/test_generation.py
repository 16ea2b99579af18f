"""One generation of live ranks (:class:`dtlib.live.generation.Generation`): answers are numbered by command.

The oracle is the cell each answer came from: a rank still in an earlier cell answers it late, and that answer
must never be read as the newer cell's.
"""

from __future__ import annotations

import pickle
import time

import pytest

from dtlib.launch.spawn import resolve_start_method
from dtlib.live.generation import Generation


@pytest.mark.timeout(180)
def test_a_late_answer_to_an_earlier_command_is_never_taken_for_the_next_ones(leftovers):
    """A rank left behind in a cell the kernel gave up on answered it during the next cell, and that answer was
    taken for the next cell's: a value from the cell before. Answers now carry their command's number."""
    ranks = Generation(2, "gloo", resolve_start_method("auto"))
    try:
        assert not ranks.wait({0, 1}, time.monotonic() + 120)  # both ranks ready
        pids = [state.process.pid for state in ranks.job.ranks]
        ranks.send(("run", ("import time\ntime.sleep(1)\n'previous'", 1)))  # given up on: no wait for its answers
        ranks.send(("run", ("'next'", 2)))
        assert not ranks.wait({0, 1}, time.monotonic() + 60)
        assert [pickle.loads(ranks.answers[rank][1]) for rank in (0, 1)] == ["next", "next"]
        assert ranks.dropped == {0: 1, 1: 1}  # the earlier cell's answers came, and were dropped
    finally:
        ranks.close(graceful=True)
    leftovers.assert_clean(pids)
