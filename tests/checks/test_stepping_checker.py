"""Notebook 15's checker: FSDP2's collectives predicted, judged against a trace of the real thing on live ranks."""

from __future__ import annotations

import pytest

from dtlib.checks import fsdp_collectives, stepping

pytestmark = pytest.mark.timeout(180)

RIGHT = ["AG0", "AG1", "AG2", "AG2", "AG1", "RS2", "AG0", "RS1", "RS0"]


def test_the_truth_is_traced_not_held_and_each_block_is_named_by_its_size():
    assert stepping.observed() == tuple(("all_gather" if item[:2] == "AG" else "reduce_scatter", int(item[2]))
                                        for item in RIGHT)


@pytest.mark.parametrize("answer", [
    RIGHT,
    [("all_gather" if item[:2] == "AG" else "reduce_scatter", int(item[2])) for item in RIGHT],
    [f"{'all-gather' if item[:2] == 'AG' else 'reduce scatter'} (block {item[2]})" for item in RIGHT],
    tuple(item.lower() for item in RIGHT),
])
def test_a_right_prediction_passes_however_it_is_written(answer):
    assert fsdp_collectives(answer).ok


@pytest.mark.parametrize(("answer", "fragments"), [
    (["AG0", "AG1", "AG2", "RS2", "RS1", "RS0"], ["#4", "freed its gathered parameters"]),  # reshard False's order
    (["AG0", "AG1", "AG2", "AG2", "RS2", "AG1", "RS1", "AG0", "RS0"], ["#5", "prefetches"]),  # no prefetch
    (["AG0", "AG1", "AG2", "AG2", "AG1", "RS2", "AG0", "RS0", "RS1"], ["#8", "last block's first"]),
    (RIGHT[:-1], ["predicted 8", "called 9", "fewer"]),
    (RIGHT + ["RS0"], ["predicted 10", "more"]),
    ([], ["no collective"]),
    ("AG0 AG1", ["Predict a list"]),
    (["AG3"], ["block, 0, 1 or 2"]),
    ([0, 1], ["neither (operation, block)"]),
    (["broadcast 0"], ["name an all-gather or a reduce-scatter"]),
])
def test_a_wrong_prediction_is_refused_at_its_first_wrong_collective_with_why(answer, fragments):
    said = fsdp_collectives(answer)
    assert not said.ok
    for fragment in fragments:
        assert fragment in said.message, said.message
