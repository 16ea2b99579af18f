"""dtlib.checks: each checker accepts the right answer and says precisely what is wrong."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dtlib import checks
from dtlib.launch import resolve_backend


def test_feedback_shows_a_mark_and_is_truthy_only_when_ok():
    assert repr(checks.Feedback(True, "fine")) == "✓ fine"
    assert repr(checks.Feedback(False, "nope")) == "✗ nope"
    assert checks.Feedback(True, "") and not checks.Feedback(False, "")


def test_backend_choice_accepts_what_auto_picks():
    expected = resolve_backend("auto", 2)
    assert checks.backend_choice(expected, world_size=2).ok
    assert checks.backend_choice(expected.upper(), world_size=2).ok


@pytest.mark.parametrize(
    ("answer", "fragment"),
    [(None, "No answer yet"), (42, "not a backend name"), ("tcp", "not a backend name"), ("mpi", "never picks MPI")],
)
def test_backend_choice_explains_bad_answers(answer, fragment):
    feedback = checks.backend_choice(answer, world_size=2)
    assert not feedback.ok
    assert fragment in feedback.message


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="needs a machine with fewer than 2 GPUs")
def test_backend_choice_says_why_nccl_is_wrong_without_gpus():
    feedback = checks.backend_choice("nccl", world_size=2)
    assert not feedback.ok and "one CUDA GPU per rank" in feedback.message


def _correct(rank, world_size):
    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    return value


def _double_counted(rank, world_size):
    value = torch.tensor([float(world_size * (world_size - 1) // 2)])
    dist.all_reduce(value)
    return value


def _hangs(rank, world_size):
    if rank == 0:
        dist.barrier()
    return 0


def _raises(rank, world_size):
    raise KeyError("missing")


@pytest.mark.timeout(60)
def test_sum_of_ranks_accepts_a_correct_function():
    feedback = checks.sum_of_ranks(_correct, world_size=3)
    assert feedback.ok, feedback.message


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("fn", "fragment"),
    [
        (lambda rank, world_size: torch.tensor([float(rank)]), "each rank returned its own rank"),
        (lambda rank, world_size: None, "returned None"),
        (_double_counted, "world_size times too big"),
        (lambda rank, world_size: "three", "it returned 'three'"),
        (_raises, "raised KeyError"),
        ("not a function", "Pass your function itself"),
    ],
)
def test_sum_of_ranks_says_what_is_wrong(fn, fragment):
    feedback = checks.sum_of_ranks(fn, world_size=3)
    assert not feedback.ok
    assert fragment in feedback.message, feedback.message


@pytest.mark.timeout(60)
def test_sum_of_ranks_reports_a_hang_instead_of_hanging():
    feedback = checks.sum_of_ranks(_hangs, world_size=2, timeout=3)
    assert not feedback.ok and "hung" in feedback.message and "barrier" in feedback.message


# -- notebook 03: one phase of the ring -------------------------------------------------------


def _gather_by_adding(chunks, rank, world_size):
    import torch

    from dtlib import collectives

    for step in range(world_size - 1):
        send, receive = (rank - step) % world_size, (rank - 1 - step) % world_size
        incoming = torch.empty_like(chunks[receive])
        collectives.ring_shift(chunks[send], incoming, rank, world_size)
        chunks[receive] += incoming  # wrong: the all-gather phase copies


def _gather_nothing(chunks, rank, world_size):
    pass


def _gather_wrong_chunks(chunks, rank, world_size):
    import torch

    from dtlib import collectives

    for step in range(world_size - 1):
        send, receive = (rank + step) % world_size, (rank - 1 - step) % world_size  # wrong: sends rank + step
        incoming = torch.empty_like(chunks[receive])
        collectives.ring_shift(chunks[send], incoming, rank, world_size)
        chunks[receive].copy_(incoming)


def _gather_the_notebook_stub(chunks, rank, world_size):
    import torch

    from dtlib import collectives

    for _ in range(world_size - 1):
        send = receive = rank  # notebook 03's starting point
        incoming = torch.empty_like(chunks[receive])
        collectives.ring_shift(chunks[send], incoming, rank, world_size)
        chunks[receive].copy_(incoming)


def _rank_0_skips_the_ring(chunks, rank, world_size):
    from dtlib import collectives

    if rank != 0:
        collectives.ring_all_gather_phase(chunks, rank, world_size)


@pytest.mark.timeout(60)
def test_ring_phase_accepts_dtlibs_own_phases():
    from dtlib import collectives

    assert checks.ring_phase(collectives.ring_all_gather_phase)
    assert checks.ring_phase(collectives.ring_reduce_scatter_phase, which="reduce_scatter")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("phase", "says"),
    [
        (_gather_by_adding, "added twice"),
        (_gather_nothing, "never reached it"),
        (_gather_wrong_chunks, "differ in size"),
        (_gather_the_notebook_stub, "differ in size"),
        (_rank_0_skips_the_ring, "The ring hung"),
    ],
)
def test_ring_phase_says_what_is_wrong(phase, says):
    feedback = checks.ring_phase(phase, timeout=5)
    assert not feedback.ok
    assert says in feedback.message, feedback.message


def test_ring_phase_refuses_bad_arguments():
    assert "which must be" in checks.ring_phase(_gather_nothing, which="broadcast").message
    assert "function itself" in checks.ring_phase("my_phase").message


# -- notebook 02: an average without ReduceOp.AVG ------------------------------------------------


def _average_right(rank, world_size):
    import torch.distributed as dist

    from dtlib.collectives import starting_values

    values = starting_values(rank, world_size)
    dist.all_reduce(values)
    return values / world_size


def _average_forgot_to_divide(rank, world_size):
    import torch.distributed as dist

    from dtlib.collectives import starting_values

    values = starting_values(rank, world_size)
    dist.all_reduce(values)
    return values


def _average_with_avg(rank, world_size):
    import torch.distributed as dist

    from dtlib.collectives import starting_values

    values = starting_values(rank, world_size)
    dist.all_reduce(values, op=dist.ReduceOp.AVG)
    return values


def _average_forgot_the_all_reduce(rank, world_size):
    from dtlib.collectives import starting_values

    return starting_values(rank, world_size)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("fn", "ok", "says"),
    [
        (_average_right, True, "holds the mean"),
        (_average_forgot_to_divide, False, "divide by world_size"),
        (_average_forgot_the_all_reduce, False, "still holds its own values"),
        (lambda rank, world_size: None, False, "return the averaged tensor"),
    ],
)
def test_average_of_ranks_says_what_is_wrong(fn, ok, says):
    feedback = checks.average_of_ranks(fn)
    assert feedback.ok is ok and says in feedback.message, feedback.message


@pytest.mark.timeout(60)
def test_average_with_reduce_op_avg_is_right_where_gloo_has_it_and_explained_where_not():
    feedback = checks.average_of_ranks(_average_with_avg)
    assert feedback.ok or "no ReduceOp.AVG" in feedback.message, feedback.message
