"""dtlib.measure.dtensor_ops: DTensor's operators and collectives, every rank played in one process.

The oracle: the same MLP on two live ranks, its collectives counted as c10d's dispatcher sees them
(``count_collectives``): the trace must name the same collectives, forward and backward; and on a (dp, tp) mesh of
four, FSDP2 over tensor parallelism (notebook 11), the same collectives on the same mesh dimensions
(``count_by_group``); and torch's ``context_parallel`` on four CPU ranks (notebook 12), the same collectives.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.attention import SDPBackend, sdpa_kernel

from dtlib import calls
from dtlib.launch.device import rank_device
from dtlib.launch.spawn import spawn
from dtlib.measure import dtensor_ops
from dtlib.measure.counting import count_by_group, count_collectives

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


def _fsdp_over_tp(mesh, device: torch.device | str) -> nn.Module:
    mlp = parallelize_module(_mlp(device), mesh["tp"], PLAN)
    return fully_shard(mlp, mesh=mesh["dp"])


def _traced_2d_step(mesh) -> None:
    mlp = _fsdp_over_tp(mesh, "cpu")
    mlp.set_reshard_after_backward(False)  # FSDP frees its gathered weights by resizing storage LocalTensor lacks
    x = torch.randn(4, 16, requires_grad=True)
    dtensor_ops.note("forward")
    y = mlp(x)
    dtensor_ops.note("backward")
    y.sum().backward()


def _live_2d_counts(rank: int, world_size: int) -> tuple[dict, dict]:
    device = rank_device()
    mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("dp", "tp"))
    mlp = _fsdp_over_tp(mesh, device)  # FSDP's defaults: what a learner writes
    groups = {"dp": mesh["dp"].get_group(), "tp": mesh["tp"].get_group()}
    y, forward = count_by_group(mlp, groups, torch.randn(4, 16).to(device).requires_grad_())
    _, backward = count_by_group(lambda: y.sum().backward(), groups)
    return forward, backward


def _by_dimension(lines: list[str]) -> dict[str, dict[str, int]]:
    """The collectives of trace lines as count_by_group gives them: {mesh dimension: {call as dtlib names it: n}}."""
    counts: dict[str, dict[str, int]] = {}
    for line in lines:
        found = re.match(r"\s*(c10d|_c10d_functional)::(\w+)\(.*[(,] (dp|tp)[,)]", line)
        op = calls.op_of(found[1], found[2]) if found else None
        if op is not None:
            row = counts.setdefault(found[3], {})
            row[op.call] = row.get(op.call, 0) + 1
    return counts


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")  # the MLP's output is a view; nothing writes into it
def test_on_a_2d_mesh_the_trace_names_each_collective_and_its_mesh_dimension_as_live_ranks_count_them():
    lines = dtensor_ops.trace(_traced_2d_step, mesh_shape=(2, 2), mesh_dim_names=("dp", "tp"))
    forward_at, backward_at = lines.index("-- forward --"), lines.index("-- backward --")
    live_forward, live_backward = spawn(_live_2d_counts, world_size=4, output="none")[0]
    assert live_forward == {"dp": {"all_gather_single": 1}, "tp": {"all_reduce": 1}}
    assert live_backward == {"tp": {"all_reduce": 1}, "dp": {"reduce_scatter_single": 1}}
    assert _by_dimension(lines[forward_at:backward_at]) == live_forward
    assert _by_dimension(lines[backward_at:]) == live_backward
    # parallelize_module's scatters run on tp; no group is left unnamed on a named mesh
    assert all(" tp, 0, " in line for line in lines[:forward_at] if "c10d" in line)
    assert not any("ScriptObject" in line or " group," in line for line in lines)
    # an output's placements follow the operator that made them, never one left out
    for before, line in zip(lines, lines[1:], strict=False):
        if line.strip().startswith("-> output"):
            assert before.startswith("aten::"), (before, line)
    assert not dist.is_initialized()


def _cp_step(mesh, device: torch.device | str, run) -> tuple:
    """Notebook 12's step: attention over a sequence sharded by ``context_parallel``, in the math backend's operators
    (the CPU's fused kernel has no sharding rule of its own); ``run(phase, fn, *args)`` runs forward, then backward."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 16).to(device) for _ in range(3))
    with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.MATH):
            out, forward = run("forward", F.scaled_dot_product_attention, q, k, v)
        _, backward = run("backward", lambda: out.sum().backward())
    return forward, backward


def _noted(phase: str, fn, *args) -> tuple:
    dtensor_ops.note(phase)
    return fn(*args), None


def _live_cp_counts(rank: int, world_size: int) -> tuple[dict[str, int], dict[str, int]]:
    device = rank_device()
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("cp",))
    return _cp_step(mesh, device, lambda phase, fn, *args: count_collectives(fn, *args))


@pytest.mark.timeout(300)
def test_context_parallel_traced_names_the_collectives_live_ranks_call():
    lines = dtensor_ops.trace(lambda mesh: _cp_step(mesh, "cpu", _noted), mesh_shape=(4,), mesh_dim_names=("cp",))
    forward_at, backward_at = lines.index("-- forward --"), lines.index("-- backward --")
    live_forward, live_backward = spawn(_live_cp_counts, world_size=4, output="none")[0]
    assert live_forward == {"all_gather_into_tensor": 2}
    assert live_backward == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}
    assert _collectives(lines[forward_at:backward_at]) == ["all_gather_into_tensor"] * 2
    assert sorted(_collectives(lines[backward_at:])) == ["all_gather_into_tensor"] * 2 + ["reduce_scatter_tensor"] * 2
    assert all(line.endswith(", cp)") for line in lines if "c10d" in line)
    assert not dist.is_initialized()


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
