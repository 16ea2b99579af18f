"""Notebook 08's machinery: the exercise's checker (dtlib.checks.fixed_barrier), against right and wrong answers,
and the reader of TORCH_DISTRIBUTED_DEBUG=DETAIL's mismatch errors (dtlib.errors.fingerprint_summary).

The pitfalls themselves are written and run in the notebook's cells, whose checked outputs the gate compares.
Rank functions defined here travel to the ranks by value (``register_pickle_by_value``), as a
notebook cell's functions do, so the ranks never import this module.
"""

from __future__ import annotations

import os
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

import dtlib
from dtlib.checks import fixed_barrier
from dtlib.errors import fingerprint_summary

cloudpickle.register_pickle_by_value(sys.modules[__name__])


# -- TORCH_DISTRIBUTED_DEBUG=DETAIL ---------------------------------------------------------------


def _all_reduce_with_detail(rank: int, world_size: int, shapes: list[list[int]]) -> str:
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.set_debug_level_from_env()  # the ranks' torch was imported before the variable was set
    dist.init_process_group("gloo")
    try:
        dist.all_reduce(torch.ones(shapes[rank]))
        return "no error"
    except RuntimeError as err:
        return str(err)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shapes, differ", [([[4], [8]], ("4vs 8", "8vs 4")),  # torch's spacing, by rank
                                            ([[2, 4], [4, 2]], ("2 4vs 4 2", "4 2vs 2 4")), ([[3], [3]], None)])
def test_detail_names_mismatched_collectives_even_with_equal_element_counts(shapes, differ):
    """Notebook 08: under TORCH_DISTRIBUTED_DEBUG=DETAIL both ranks raise and name both shapes; equal shapes pass."""
    said = dtlib.spawn(_all_reduce_with_detail, 2, args=(shapes,), init_process_group=False, timeout=45,
                       output="none")
    if differ is None:
        assert said == ["no error", "no error"]
        return
    for rank, message in enumerate(said):
        lines = fingerprint_summary(message).splitlines()
        assert lines[0] == "Detected mismatch between collectives on ranks.", message
        mine, theirs = (shapes[rank], shapes[1 - rank])
        assert f"Rank {rank} is running collective" in lines[1] and f"TensorShape={mine}".replace(" ", "") in \
            lines[1].replace(" ", "")
        assert f"TensorShape={theirs}".replace(" ", "") in lines[2].replace(" ", "") and "TensorOptions" not in lines[2]
        assert lines[3] == f"Collectives differ in the following aspects: Tensor Tensor shapes: {differ[rank]}"


def test_fingerprint_summary_leaves_other_messages_readable():
    assert fingerprint_summary("  some other\n error ") == "some other error"


# -- the exercise's checker ---------------------------------------------------------------------


def _mean_loss_fixed(rank, world_size):
    loss = torch.tensor([float(rank + 1)])
    dist.all_reduce(loss)
    return (loss / world_size).item()


def _mean_loss_buggy(rank, world_size):
    loss = torch.tensor([float(rank + 1)])
    if rank == 0:
        dist.all_reduce(loss)
        loss /= world_size
    return loss.item()


def _sum_not_mean(rank, world_size):
    loss = torch.tensor([float(rank + 1)])
    dist.all_reduce(loss)
    return loss


def _raises(rank, world_size):
    raise KeyError("loss")


def _mean_by_two(rank, world_size):
    loss = torch.tensor([float(rank + 1)])
    dist.all_reduce(loss)
    return (loss / 2).item()  # right on 2 ranks only


def _every_rank_waits_to_receive(rank, world_size):
    loss = torch.tensor([float(rank + 1)])
    dist.recv(loss, src=(rank + 1) % world_size)  # nobody sends: every rank waits
    return loss.item()


@pytest.mark.timeout(60)
def test_checker_accepts_every_rank_calling_the_collective():
    feedback = fixed_barrier(_mean_loss_fixed)
    assert feedback.ok and "2 ranks (1.5)" in feedback.message and "3 (2)" in feedback.message, feedback.message


@pytest.mark.timeout(60)
def test_checker_reports_which_rank_hung_where():
    feedback = fixed_barrier(_mean_loss_buggy, timeout=3)
    assert not feedback.ok
    line = _mean_loss_buggy.__code__.co_firstlineno + 3  # the dist.all_reduce line
    assert f"rank 0 waited in all_reduce (line {line}, in _mean_loss_buggy)" in feedback.message, feedback.message
    assert "while rank 1 returned without calling it" in feedback.message, feedback.message


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("fn", "world_size", "fragment"),
    [
        (_mean_loss_buggy, 3, "while ranks 1 and 2 returned without calling it"),
        (_every_rank_waits_to_receive, 2, "rank 1 waited in recv"),
        (_every_rank_waits_to_receive, 2, "and no rank returned: each waited for a call that no other rank made"),
    ],
)
def test_checker_names_the_ranks_that_returned_whatever_their_number(fn, world_size, fragment):
    feedback = fixed_barrier(fn, world_size=world_size, timeout=3)
    assert not feedback.ok and fragment in feedback.message, feedback.message
    assert "rank(s)" not in feedback.message and "none" not in feedback.message


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("fn", "fragment"),
    [
        (lambda rank, world_size: rank + 1, "Rank 0 returned its own loss 1"),
        (_sum_not_mean, "returned the sum 3"),
        (lambda rank, world_size: 2.0, "returned 2, expected the mean 1.5"),
        (lambda rank, world_size: None, "returned None"),
        (_raises, "rank 0 raised KeyError"),
        ("mean_loss", "Pass your function itself"),
        (lambda rank, world_size: 1.5, "Rank 0 returned the mean 1.5, but no collective was called"),
        (lambda rank, world_size: (world_size + 1) / 2, "no collective was called"),
        (_mean_by_two, "With 3 ranks, rank 0 returned 3, the sum divided by 2"),
        (_mean_by_two, "not a constant"),
    ],
)
def test_checker_says_what_is_wrong(fn, fragment):
    feedback = fixed_barrier(fn)
    assert not feedback.ok and fragment in feedback.message, feedback.message


def _mean_by_max(rank, world_size):
    loss = torch.tensor(float(rank + 1))
    dist.all_reduce(loss, op=dist.ReduceOp.MAX)
    return loss.item()


def _mean_by_reduce(rank, world_size):
    loss = torch.tensor(float(rank + 1))
    dist.reduce(loss, dst=0)
    return loss.item() / world_size


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("fn", "fragment"), [(_mean_by_max, "the largest loss: ReduceOp.MAX keeps the largest"),
                                              (_mean_by_reduce, "dist.reduce leaves it on one rank only")])
def test_the_wrong_collective_is_named(fn, fragment):
    feedback = fixed_barrier(fn, world_size=2, timeout=10)
    assert not feedback.ok and fragment in feedback.message, feedback.message
