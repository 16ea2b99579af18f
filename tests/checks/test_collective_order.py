"""Notebook 15's checker: FSDP2's collectives predicted, judged against a trace of the real thing on live ranks."""

from __future__ import annotations

import pytest

from dtlib.checks import collective_order, fsdp_collectives

pytestmark = pytest.mark.timeout(180)

RIGHT = ["AG0", "AG1", "AG2", "AG2", "AG1", "RS2", "AG0", "RS1", "RS0"]


def test_the_truth_is_traced_not_held_and_each_block_is_named_by_its_size():
    assert collective_order.observed() == tuple(("all_gather" if item[:2] == "AG" else "reduce_scatter", int(item[2]))
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
    (RIGHT[:6], ["predicted 6", "fewer", "one block ahead"]),  # stops before backward's prefetch: said as one
    (RIGHT + ["RS0"], ["predicted 10", "more"]),
    ([], ["no collective"]),
    ("AG0 AG1", ["Predict a list"]),
    (["AG3"], ["numbered 0, 1 and 2"]),
    ([0, 1], ["neither (operation, block)"]),
    (["broadcast 0"], ["name an all-gather or a reduce-scatter"]),
])
def test_a_wrong_prediction_is_refused_at_its_first_wrong_collective_with_why(answer, fragments):
    said = fsdp_collectives(answer)
    assert not said.ok
    for fragment in fragments:
        assert fragment in said.message, said.message


@pytest.mark.parametrize("answer", [
    ["all_gather_single 0", "all_gather_single 1", "all_gather_single 2", "all_gather_single 2",
     "all_gather_single 1", "reduce_scatter_single 2", "all_gather_single 0", "reduce_scatter_single 1",
     "reduce_scatter_single 0"],  # torch's own names, as the traces print them
    ["AG0", "AG1", "AG2", "AG2 again", "AG1 (prefetch)", "RS2", "AG0 (prefetch)", "RS1", "RS0"],
    ["AG[0]", "AG(block=1)", "AG.2", "AG 2", "AG_1", "RS2", "AG0", "RS1", "RS0"],  # brackets, dots, keywords
])
def test_torchs_names_and_notes_after_the_block_are_read(answer):
    assert fsdp_collectives(answer).ok


def test_a_negative_block_is_refused_not_read_as_positive_and_prefetching_everything_is_explained():
    said = fsdp_collectives([("all_gather", -1)])
    assert not said.ok and "numbered 0, 1 and 2" in said.message
    said = fsdp_collectives(["AG0", "AG-1"])  # a hyphen read as a minus: said so, and how to write block 1
    assert not said.ok and "-1 is no block" in said.message and "'AG1'" in said.message
    said = fsdp_collectives(["AG0", "AG1", "AG2", "AG2", "AG1", "AG0", "RS2", "RS1", "RS0"])
    assert not said.ok and "#6" in said.message and "one block ahead" in said.message
    assert "AG0 AG1 AG2 AG2" not in fsdp_collectives(RIGHT).message  # the ✓ does not spell the answer out
