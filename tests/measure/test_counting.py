"""dtlib.measure.counting: the one observer of collectives, against torch's own CommDebugMode.

Oracle: ``CommDebugMode`` counts what torch dispatches, as the observer does, for every call both can see: c10d
collectives (however imported), DDP's C++ reducer, functional ones, DTensor's redistributions (those inside an
op's handler too), FSDP2's. Where CommDebugMode is blind (send, recv, barrier) the calls a rank made are the
oracle. The views (counts by call, by group, bytes by group) are one recording folded, so they must agree.
Rank functions travel by value, as a notebook cell's do.
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

import dtlib
from dtlib import calls
from dtlib.measure.counting import count_by_group, count_collectives, recording
from dtlib.measure.traffic import traffic

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _every_kind(rank: int, world_size: int) -> None:
    """One call of each kind both observers see, on the default group."""
    from torch.distributed import all_reduce  # imported by name, as a cell may
    from torch.distributed._functional_collectives import all_reduce as functional_all_reduce
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    torch.manual_seed(0)
    all_reduce(torch.ones(4))
    dist.all_gather_single(torch.empty(2 * world_size), torch.ones(2))
    dist.reduce_scatter_single(torch.empty(2), torch.ones(2 * world_size))
    dist.broadcast(torch.ones(3), src=0)
    dist.all_to_all_single(torch.empty(world_size), torch.ones(world_size))
    functional_all_reduce(torch.ones(2), "sum", dist.group.WORLD).wait()
    mesh = init_device_mesh("cpu", (world_size,))
    rows = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
    cols = distribute_tensor(torch.ones(4, 4), mesh, [Shard(1)])
    (rows + cols).redistribute(mesh, [Replicate()]).to_local()  # a redistribution inside the add's handler, then one
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    ddp(torch.randn(3, 4)).sum().backward()  # the reducer's all-reduce, from C++


def _both_observers(rank: int, world_size: int) -> tuple[dict[str, int], dict[str, int]]:
    from torch.distributed.tensor.debug import CommDebugMode

    oracle = CommDebugMode()
    with recording() as seen, oracle:
        _every_kind(rank, world_size)
    theirs: dict[str, int] = {}
    for packet, times in oracle.get_comm_counts().items():
        namespace, _, name = str(packet).partition(".")  # c10d.allreduce_, c10d_functional.all_reduce
        op = calls.op_of("_c10d_functional" if namespace == "c10d_functional" else namespace, name)
        if op is not None:
            theirs[op.call] = theirs.get(op.call, 0) + times
    ours: dict[str, int] = {}
    for collective in seen:
        if collective.kind != "barrier":  # CommDebugMode counts none (DDP's construction runs one on gloo)
            ours[collective.call] = ours.get(collective.call, 0) + 1
    return ours, theirs


@pytest.mark.timeout(120)
def test_the_observer_counts_what_commdebugmode_counts_for_every_kind_it_sees():
    for ours, theirs in dtlib.spawn(_both_observers, 2, output="none"):
        assert ours == theirs
        assert {"all_reduce", "all_gather_single", "reduce_scatter_single", "broadcast", "all_to_all_single",
                "all_gather_into_tensor"} <= set(ours), ours  # c10d's, and DTensor's functional gathers


def _what_commdebugmode_misses(rank: int, world_size: int) -> list[tuple[str, str, int, float]]:
    pair = dist.new_group([0, 1])
    with recording() as seen:
        t = torch.ones(2)
        if rank == 0:
            dist.send(t, 1, group=pair)
        else:
            dist.recv(t, 0, group=pair)
        dist.barrier()
    return [(c.call, c.kind, c.payload, c.sent) for c in seen]


@pytest.mark.timeout(60)
def test_sends_receives_and_barriers_are_recorded_with_what_they_move():
    sender, receiver = dtlib.spawn(_what_commdebugmode_misses, 2, output="none")
    assert sender == [("send", "send", 8, 8.0), ("barrier", "barrier", 0, 0.0)]
    assert receiver == [("recv", "none", 8, 0.0), ("barrier", "barrier", 0, 0.0)]


def _three_views(rank: int, world_size: int) -> tuple[dict, dict, list]:
    groups = {"world": dist.group.WORLD}
    counted = count_collectives(_every_kind, rank, world_size)[1]
    by_group = count_by_group(_every_kind, groups, rank, world_size)[1]
    with traffic(groups) as table:
        _every_kind(rank, world_size)
    return counted, by_group, [(row.group, row.call, row.calls) for row in table.rows()]


@pytest.mark.timeout(120)
def test_counts_by_call_by_group_and_the_traffic_table_are_one_recording_folded():
    for counted, by_group, rows in dtlib.spawn(_three_views, 2, output="none"):
        merged: dict[str, int] = {}
        for calls_of_group in by_group.values():
            for call, times in calls_of_group.items():
                merged[call] = merged.get(call, 0) + times
        assert merged == counted
        assert {call: times for _, call, times in rows} == {c: n for c, n in counted.items() if c != "barrier"}
        assert set(by_group) <= {"world", "other"}  # the mesh's own group is another communicator


def test_every_op_has_a_ring_kind_and_c10d_calls_use_the_names_the_course_teaches():
    from dtlib.ring.cost import RING_OF

    for op in (*calls.C10D.values(), *calls.FUNCTIONAL.values()):
        assert op.kind in RING_OF or op.kind == "barrier", op
    assert calls.op_of("c10d", "_allgather_base_").call == "all_gather_single"  # dist.all_gather_into_tensor too
    assert calls.op_of("c10d", "_reduce_scatter_base_").call == "reduce_scatter_single"
    assert calls.op_of("_c10d_functional", "wait_tensor") is None and calls.op_of("aten", "add") is None
