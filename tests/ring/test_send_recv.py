"""dtlib.ring.send_recv: the send/recv ring against ``dist.all_reduce`` and the
simulator. The collectives themselves run in notebook 02's cells, whose checked outputs the gate compares."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

import dtlib
from dtlib import ring
from dtlib.ring import send_recv


def _ring_against_oracles(rank, world_size, length):
    generator = torch.Generator().manual_seed(rank)
    data = torch.randn(length, generator=generator, dtype=torch.float64).to(dtlib.rank_device())  # NCCL: its GPU
    ours = send_recv.ring_all_reduce(data.clone())
    theirs = data.clone()
    dist.all_reduce(theirs)
    return {"input": data.tolist(), "ours": ours.tolist(), "theirs": theirs.tolist()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("length", [1, 7, 12])  # shorter than N, uneven chunks, even chunks
def test_send_recv_ring_equals_dist_all_reduce_and_the_simulator(world_size, length):
    reports = dtlib.spawn(_ring_against_oracles, world_size, args=(length,), output="none")
    simulated = ring.simulate_all_reduce([r["input"] for r in reports]).outputs
    for rank, report in enumerate(reports):
        np.testing.assert_allclose(report["ours"], report["theirs"], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(report["ours"], simulated[rank], rtol=1e-12, atol=1e-12)


def _ring_on_a_matrix(rank, world_size):
    matrix = torch.full((3, 4), float(rank + 1), device=dtlib.rank_device())  # (3, 4), contiguous
    column_major = torch.full((4, 3), float(rank + 1), device=dtlib.rank_device()).t()  # (3, 4), not contiguous
    send_recv.ring_all_reduce(matrix)
    send_recv.ring_all_reduce(column_major)
    return matrix.tolist(), column_major.tolist()


@pytest.mark.timeout(60)
def test_ring_reduces_any_shape_in_place():
    for matrix, column_major in dtlib.spawn(_ring_on_a_matrix, 3, output="none"):
        assert matrix == column_major == [[6.0] * 4] * 3


def _shifts_as_posted(rank, world_size):
    """Each ``batch_isend_irecv`` that ``ring_shift`` makes, as (operation, peer) pairs, and what arrived."""
    posted = []
    original = dist.batch_isend_irecv

    def recording(ops):
        posted.append([(op.op.__name__, op.peer) for op in ops])
        return original(ops)

    dist.batch_isend_irecv = recording
    try:
        received = torch.empty(2, device=dtlib.rank_device())
        send_recv.ring_shift(torch.full((2,), float(rank), device=received.device), received, rank, world_size)
    finally:
        dist.batch_isend_irecv = original
    return posted, received.tolist()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_shift_posts_its_send_and_its_receive_together(world_size):
    """NCCL's contract, not gloo's leniency: a send and a receive between the same two ranks (every pair, at
    two ranks) posted as two separate calls may deadlock under NCCL, so each step posts both in one batch."""
    for rank, (posted, received) in enumerate(dtlib.spawn(_shifts_as_posted, world_size, output="none")):
        assert posted == [[("isend", (rank + 1) % world_size), ("irecv", (rank - 1) % world_size)]]
        assert received == [float((rank - 1) % world_size)] * 2  # the left-hand neighbour's tensor
