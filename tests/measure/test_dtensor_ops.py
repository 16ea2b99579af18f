"""dtlib.measure.dtensor_ops: DTensor's operators and collectives, every rank played in one process.

The oracle: the same MLP on two live ranks, its collectives counted as c10d's dispatcher sees them
(``count_collectives``): the trace must name the same collectives, forward and backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from dtlib.launch.device import rank_device
from dtlib.launch.spawn import spawn
from dtlib.measure import dtensor_ops
from dtlib.measure.counting import count_collectives

pytestmark = pytest.mark.skipif(dtensor_ops.unavailable() is not None, reason=str(dtensor_ops.unavailable()))
PLAN = {"0": ColwiseParallel(), "2": RowwiseParallel()}


def _mlp(device: torch.device | str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)).to(device)


def _traced_step(mesh) -> None:
    mlp = parallelize_module(_mlp("cpu"), mesh, PLAN)
    x = torch.randn(4, 16, requires_grad=True)
    dtensor_ops.note("forward")
    y = mlp(x)
    dtensor_ops.note("backward")
    y.sum().backward()


def _live_counts(rank: int, world_size: int) -> tuple[dict[str, int], dict[str, int]]:
    device = rank_device()
    mlp = parallelize_module(_mlp(device), init_device_mesh(device.type, (world_size,)), PLAN)
    x = torch.randn(4, 16).to(device).requires_grad_()
    y, forward = count_collectives(mlp, x)
    _, backward = count_collectives(lambda: y.sum().backward())
    return forward, backward


def _collectives(lines: list[str]) -> list[str]:
    return [line.strip().split("(")[0].split("::")[-1] for line in lines if "c10d" in line]


@pytest.mark.timeout(180)
def test_the_trace_names_the_collectives_live_ranks_call_forward_and_backward():
    lines = dtensor_ops.trace(_traced_step, mesh_shape=(2,))
    forward_at, backward_at = lines.index("-- forward --"), lines.index("-- backward --")
    live_forward, live_backward = spawn(_live_counts, world_size=2, output="none")[0]
    assert live_forward == live_backward == {"all_reduce": 1}
    assert _collectives(lines[forward_at:backward_at]) == ["all_reduce"]
    assert _collectives(lines[backward_at:]) == ["all_reduce"]
    # the operator that made it: the row-parallel matmul's output is a partial sum, and DTensor adds the summands
    assert any("addmm" in line and "S(1)" in line and "S(0)" in line for line in lines[forward_at:backward_at])
    assert any("P(sum)->R" in line for line in lines[forward_at:backward_at])
    assert not dist.is_initialized()  # the fake group is gone


def test_a_note_outside_a_trace_is_refused():
    with pytest.raises(RuntimeError, match="inside trace's fn"):
        dtensor_ops.note("forward")


@pytest.mark.parametrize("shape", [(), (0,), (2, -1), ("2",), (1.5,)])
def test_a_mesh_shape_that_is_not_positive_whole_numbers_is_refused(shape):
    with pytest.raises(ValueError, match="mesh_shape must be"):
        dtensor_ops.trace(_traced_step, mesh_shape=shape)
    assert not dist.is_initialized()


def test_a_process_group_already_in_the_process_is_named_not_replaced():
    dist.init_process_group("fake", rank=0, world_size=2)
    try:
        with pytest.raises(RuntimeError, match="already initialised"):
            dtensor_ops.trace(_traced_step)
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


def test_an_error_in_fn_reaches_the_caller_and_leaves_no_group_behind():
    def broken(mesh) -> None:
        raise KeyError("mine")

    with pytest.raises(KeyError, match="mine"):
        dtensor_ops.trace(broken)
    assert not dist.is_initialized()
