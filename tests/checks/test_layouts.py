"""dtlib.checks.layouts: micro-batches against a pipeline's bubble (notebook 10), a 2-D mesh on nodes (11)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from verdicts import assert_verdict

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
    ("32 microbatches", True, ["32 micro-batches of 2 samples"]),  # review: refused, the unit spelled as one word
    ("32 micro batches", True, ["32 micro-batches of 2 samples"]),
    pytest.param(10**400, False, ["that a float can hold"], id="10**400"),  # review: raised OverflowError
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


# -- notebook 11: a 2-D mesh laid onto nodes; any names init_device_mesh accepts, the structure judged ------------

#: (shape, names, the name that carries tensor parallelism): right however the dimensions are named
MESH_RIGHT = [
    ((2, 4), ("dp", "tp"), "tp"),
    ((2, 4), ("fsdp", "tp"), "tp"),
    ([2, 4], ["dp_shard", "tp"], "tp"),  # lists, torchtitan's name
    ((2, 4), ("data", "model"), "model"),
    ((2, 4), ("replicate", "tensor"), "tensor"),
    ((2, 4), ("DP", "TP"), "TP"),
    ((2, 4), ("rows", "cols"), "cols"),  # names that say neither: the structure says which
    ((2, 4), ("a", "b"), "b"),
    ((2, 4), ("pp", "tp"), "tp"),
    ((2, 4), ("fsdp", "x"), "x"),
]

#: (shape, names, what the message must say): one of each kind of wrong answer
MESH_WRONG = [
    ((4, 2), ("tp", "dp"), "The tp group [0, 2, 4, 6] spans nodes [0, 1]"),
    ((4, 2), ("tp", "fsdp"), "put \"tp\" last"),
    ((4, 2), ("rows", "cols"), "With \"rows\" for tensor parallelism"),  # the only dimension of 4 crosses nodes
    ((2, 4), ("tp", "fsdp"), "\"tp\" has size 2, and \"fsdp\" 4"),
    ((8, 1), ("dp", "tp"), "groups of 1 rank;"),
    ((1, 8), ("fsdp", "tp"), "8 ranks cannot fit in a node of 4"),
    ((8, 1), ("a", "b"), "Neither dimension of (8, 1) has 4 ranks"),
    ((2, 4), ("tp", "tp"), "repeat one"),
    ((2, 4), ("dp",), "one name per dimension"),
    ((2, 4), ("dp", "fsdp"), "say data parallelism"),
    ((2, 4), ("tensor", "mp"), "say tensor parallelism"),
    ((2, 2, 2), ("dp", "tp", "pp"), "two dimensions"),
    ((2, 2), ("dp", "tp"), "4 ranks; the job has 2 x 4 = 8"),
    ((-2, -4), ("dp", "tp"), "positive"),
    ((2.5, 4), ("dp", "tp"), "tuple of whole numbers"),
    ((2, 4), {"dp", "tp"}, "tuple of strings"),  # a set has no order
]


@pytest.mark.parametrize("shape, names, tp_name", MESH_RIGHT)
def test_mesh_for_nodes_accepts_any_names(shape, names, tp_name):
    feedback = checks.mesh_for_nodes(shape, names, nodes=2, gpus_per_node=4, tp_size=4)
    dp_name = next(name for name in names if name != tp_name)
    assert_verdict(feedback, True, [f"{tp_name} group ([0, 1, 2, 3], ...) is inside one node",
                                     f"{dp_name} group ([0, 4], ...) crosses nodes"])


@pytest.mark.parametrize("shape, names, says", MESH_WRONG)
def test_mesh_for_nodes_refuses_each_kind_of_wrong_mesh(shape, names, says):
    assert_verdict(checks.mesh_for_nodes(shape, names, nodes=2, gpus_per_node=4, tp_size=4), False, [says])


def test_mesh_for_nodes_banks_hold_many_kinds_and_namings():
    assert len(MESH_RIGHT) >= 5 and len({names[0] for _, names, _ in MESH_RIGHT}) >= 5
    assert len(MESH_WRONG) >= 8 and len({says for _, _, says in MESH_WRONG}) == len(MESH_WRONG)


def test_mesh_for_nodes_with_unnamed_roles_picks_the_dimension_that_stays_in_a_node():
    square = checks.mesh_for_nodes((2, 2), ("a", "b"), nodes=2, gpus_per_node=2, tp_size=2)
    assert_verdict(square, True, ["With \"b\" for tensor parallelism", "b group ([0, 1], ...)"])


def test_init_device_mesh_agrees_with_every_banked_mesh(monkeypatch):
    """The oracle: torch's own init_device_mesh on a fake 8-rank group, once as each rank. It accepts every
    right answer's names and puts each rank's group along the tensor-parallel name inside that rank's node;
    it refuses the repeated and the missing names."""
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    from torch.distributed.device_mesh import init_device_mesh

    def groups(shape, names, name):
        found = []
        for rank in range(8):
            dist.init_process_group("fake", rank=rank, world_size=8, store=fake_pg.FakeStore())
            try:
                found.append(init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))[name].mesh.tolist())
            finally:
                dist.destroy_process_group()
        return found

    for shape, names, tp_name in MESH_RIGHT:
        assert all(len(group) == 4 and len({rank // 4 for rank in group}) == 1
                   for group in groups(shape, names, tp_name)), names
    assert any(len({rank // 4 for rank in group}) > 1 for group in groups((4, 2), ("tp", "dp"), "tp"))
    for names in (("tp", "tp"), ("dp",)):
        with pytest.raises(RuntimeError, match="unique|same length"):
            groups((2, 4), names, names[0])
