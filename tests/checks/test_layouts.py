"""dtlib.checks.layouts: micro-batches against a pipeline's bubble (notebook 10), a 2-D mesh on nodes (11)."""

from __future__ import annotations

import pytest
import torch

from dtlib import checks


@pytest.mark.parametrize("answer, ok, fragments", [
    (32, True, ["32 micro-batches of 2 samples", "3/35 = 8.6%", "m >= 27"]),
    (27, False, ["do not split 64 samples evenly"]),  # the bound alone: not a divisor
    (16, False, ["3/19 = 15.8%, above 10%"]),
    (8, False, ["3/11 = 27.3%"]),
    (64, False, ["fewer do too", "1 sample)"]),
    (0, False, ["at least one micro-batch"]),
    (-4, False, ["at least one micro-batch"]),
    (2.5, False, ["whole number"]),
    ("32", True, ["32 micro-batches of 2 samples"]),  # typed as text: the same number (dtlib.checks.typed)
    ("thirty-two", False, ["whole number"]),
    (True, False, ["whole number"]),
    (float("nan"), False, ["whole number"]),
    (128, False, ["do not split 64 samples evenly"]),
])
def test_pipeline_micro_batches(answer, ok, fragments):
    feedback = checks.pipeline_micro_batches(answer)
    assert feedback.ok is ok, feedback.message
    for fragment in fragments:
        assert fragment in feedback.message, feedback.message


def test_pipeline_micro_batches_takes_numpy_integers_and_other_settings():
    import numpy as np

    assert checks.pipeline_micro_batches(np.int64(32)).ok and checks.pipeline_micro_batches(torch.tensor(32)).ok
    assert checks.pipeline_micro_batches(torch.tensor(32.0)).ok and checks.pipeline_micro_batches(np.array(32)).ok
    assert not checks.pipeline_micro_batches(torch.tensor([32, 16])).ok
    assert "m >= 21" in checks.pipeline_micro_batches(21, target=0.13, batch=84).message  # rounded up: 20.08
    too_few = checks.pipeline_micro_batches(3, stages=4, target=0.5, batch=48)
    assert "at least one micro-batch per stage" in too_few.message
    assert "No count of micro-batches" in checks.pipeline_micro_batches(64, target=0.01).message
    with pytest.raises(ValueError, match="between 0 and 1"):
        checks.pipeline_micro_batches(32, target=10)
    assert checks.pipeline_micro_batches(16, stages=2, target=0.1).ok  # m >= 9: 16 is 64's first divisor there
    assert checks.pipeline_micro_batches(10, stages=2, target=0.1, batch=60).ok  # and 10 is 60's
    assert "fewer do too" in checks.pipeline_micro_batches(12, stages=2, target=0.1, batch=60).message
    assert not checks.pipeline_micro_batches(8, stages=2, target=0.1, batch=16).ok  # 1/9 = 11.1%


@pytest.mark.parametrize("shape, names, ok, fragments", [
    ((2, 4), ("dp", "tp"), True, ["[0, 1, 2, 3]", "inside one node", "[0, 4]"]),
    ([2, 4], ["dp", "tp"], True, []),  # lists are fine
    ((4, 2), ("tp", "dp"), False, ["spans nodes [0, 1]", "put \"tp\" last"]),
    ((2, 4), ("tp", "dp"), False, ["groups of 2 ranks", "asks for 4"]),
    ((4, 2), ("dp", "tp"), False, ["groups of 2 ranks"]),
    ((1, 8), ("dp", "tp"), False, ["8 ranks cannot fit in a node of 4"]),
    ((8, 1), ("dp", "tp"), False, ["groups of 1 rank;"]),
    ((2.5, 4), ("dp", "tp"), False, ["tuple of whole numbers"]),  # int() would truncate it to a right answer
    ("24", ("dp", "tp"), False, ["tuple of whole numbers"]),
    (("2", "4"), ("dp", "tp"), False, ["tuple of whole numbers"]),
    ((2, 4), {"dp", "tp"}, False, ["tuple of strings"]),  # a set has no order
    ((-2, -4), ("dp", "tp"), False, ["positive"]),
    ((2, 2), ("dp", "tp"), False, ["4 ranks; the job has 2 x 4 = 8"]),
    ((2, 4), ("data", "tp"), True, ["data group ([0, 4], "]),  # any names init_device_mesh takes
    ("x", ("dp", "tp"), False, ["tuple of whole numbers"]),
    ((2, 2, 2), ("dp", "tp", "pp"), False, ["two dimensions"]),
])
def test_mesh_for_nodes(shape, names, ok, fragments):
    feedback = checks.mesh_for_nodes(shape, names)
    assert feedback.ok is ok, feedback.message
    for fragment in fragments:
        assert fragment in feedback.message, feedback.message


def test_mesh_for_nodes_on_one_node_and_with_impossible_settings():
    one_node = checks.mesh_for_nodes((2, 4), ("dp", "tp"), nodes=1, gpus_per_node=8, tp_size=4)
    assert one_node.ok and "stays in the one node" in one_node.message and "crosses" not in one_node.message
    for tp_size, gpus in ((8, 4), (2, 3)):
        with pytest.raises(ValueError, match="choose a tp_size that divides gpus_per_node"):
            checks.mesh_for_nodes((2, 4), ("dp", "tp"), gpus_per_node=gpus, tp_size=tp_size)


def test_mesh_for_nodes_finds_a_tp_group_that_crosses_nodes():
    feedback = checks.mesh_for_nodes((4, 2), ("tp", "dp"), nodes=2, gpus_per_node=4, tp_size=4)
    assert not feedback.ok and "The tp group [0, 2, 4, 6] spans nodes [0, 1]" in feedback.message
    assert "put \"tp\" last" in feedback.message
