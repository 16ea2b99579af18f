"""dtlib.collectives: each demo against the collective's definition; the send/recv ring against
``dist.all_reduce`` and the simulator."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

import dtlib
from dtlib import collectives, ring


def _start(n: int) -> np.ndarray:
    return np.array([collectives.starting_values(r, n).tolist() for r in range(n)])  # (ranks, slots)


@pytest.fixture(scope="module")
def results():
    """Every demo on 4 ranks, run once for the module."""
    return {name: collectives.demo(name, world_size=4) for name in collectives.COLLECTIVES}


@pytest.mark.timeout(240)
def test_every_demo_matches_its_definition(results):
    n = 4
    start = _start(n)
    expected = {
        "all_reduce_sum": [start.sum(0)] * n,
        "all_reduce_avg": [start.mean(0)] * n,
        "all_reduce_max": [start.max(0)] * n,
        "broadcast": [start[0]] * n,
        "all_gather": [start.ravel()] * n,
        "all_gather_single": [start.ravel()] * n,
        "gather": [start.ravel()] + [[]] * (n - 1),
        "scatter": [[start[0, r]] for r in range(n)],
        "reduce_scatter": [[start.sum(0)[r]] for r in range(n)],
        "all_to_all": [start[:, r] for r in range(n)],
        "barrier": list(start),
        "send_recv": [start[(r - 1) % n] for r in range(n)],
        "isend_irecv": [start[(r - 1) % n] for r in range(n)],
    }
    for name, result in results.items():
        assert result.before == start.tolist(), name
        if name == "reduce":
            np.testing.assert_allclose(result.after[0], start.sum(0), err_msg=name)  # only rank 0 is defined
            continue
        for rank in range(n):
            np.testing.assert_allclose(result.after[rank], expected[name][rank], err_msg=f"{name}, rank {rank}")


@pytest.mark.timeout(240)
def test_gloo_gaps_are_said_not_hidden(results):
    note = results["all_reduce_avg"].note  # torch 2.6's gloo refuses ReduceOp.AVG; 2.13's accepts it
    assert note == "" or "has no ReduceOp.AVG: summed, then divided" in note
    note = results["all_to_all"].note  # torch 2.6's gloo lacks the list form; later ones have it
    assert note == "" or "used all_to_all_single" in note


def test_unknown_names_and_odd_blocking_rings_are_refused():
    with pytest.raises(ValueError, match="unknown collective 'allreduce'"):
        collectives.demo("allreduce")
    with pytest.raises(ValueError, match="even world_size"):
        collectives.demo("send_recv", world_size=3)


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
