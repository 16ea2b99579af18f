"""dtlib.ring.send_recv: the exercise's starting values; the send/recv ring against ``dist.all_reduce`` and the
simulator. The collectives themselves run in notebook 02's cells, whose checked outputs the gate compares."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

import dtlib
from dtlib import ring
from dtlib.ring import send_recv as collectives


def test_starting_values_say_which_rank_and_slot_they_came_from():
    assert collectives.starting_values(2, 4).tolist() == [20.5, 21.5, 22.5, 23.5]
    assert collectives.starting_values(0, 3, device="meta").device.type == "meta"  # made on the rank's device


def _ring_against_oracles(rank, world_size, length):
    generator = torch.Generator().manual_seed(rank)
    data = torch.randn(length, generator=generator, dtype=torch.float64)
    ours = collectives.ring_all_reduce(data.clone())
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
    matrix = torch.full((3, 4), float(rank + 1))  # (3, 4), contiguous
    column_major = torch.full((4, 3), float(rank + 1)).t()  # (3, 4), not contiguous
    collectives.ring_all_reduce(matrix)
    collectives.ring_all_reduce(column_major)
    return matrix.tolist(), column_major.tolist()


@pytest.mark.timeout(60)
def test_ring_reduces_any_shape_in_place():
    for matrix, column_major in dtlib.spawn(_ring_on_a_matrix, 3, output="none"):
        assert matrix == column_major == [[6.0] * 4] * 3
