"""dtlib.errors: the exceptions dtlib.spawn raises (RankFailure, WorkerError, WorkerTimeout), and the reader of
TORCH_DISTRIBUTED_DEBUG=DETAIL's mismatch errors (fingerprint_summary) against torch's own errors.

The rank function defined here travels to the ranks by value, as a notebook cell's functions do."""

from __future__ import annotations

import os
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import dtlib
from dtlib import errors
from dtlib.errors import RankFailure, WorkerError, WorkerTimeout, fingerprint_summary

cloudpickle.register_pickle_by_value(sys.modules[__name__])

TRACEBACK = 'Traceback (most recent call last):\n  File "cell.py", line 2, in fn\nValueError: bad shape\n'


def test_headline_of_a_raised_exception():
    """A rank that raised: 'rank N raised Type: message'."""
    assert RankFailure(1, "ValueError", "bad shape", TRACEBACK).headline() == "rank 1 raised ValueError: bad shape"


def test_headline_of_a_dead_process():
    """A rank that died without raising: 'rank N <what happened>'."""
    failure = RankFailure(2, None, "was killed by SIGKILL without returning a result", "", -9)
    assert failure.headline() == "rank 2 was killed by SIGKILL without returning a result"


def test_worker_error_with_one_failure():
    """One failure: the headline, then that rank's remote traceback; .rank and .failures point at it."""
    failure = RankFailure(1, "ValueError", "bad shape", TRACEBACK)
    err = WorkerError([failure])
    assert isinstance(err, RuntimeError)
    assert (err.rank, err.failures) == (1, [failure])
    assert str(err) == f"rank 1 raised ValueError: bad shape\n--- remote traceback of rank 1 ---\n{TRACEBACK.rstrip()}"


def test_worker_error_without_traceback_has_no_traceback_section():
    """A failure with no traceback text adds no empty traceback section."""
    err = WorkerError([RankFailure(0, None, "exited with code 3 without returning a result", "", 3)])
    assert str(err) == "rank 0 exited with code 3 without returning a result"


def test_worker_error_with_several_failures_sorted_by_rank():
    """Several failures: a summary line naming the ranks, one headline each, then the tracebacks, all in rank order."""
    late = RankFailure(2, "KeyError", "'w'", "tb of rank 2\n")
    early = RankFailure(0, None, "exited with code 1 without returning a result", "", 1)
    err = WorkerError([late, early])
    assert err.failures == [early, late]
    assert err.rank == 0
    assert str(err) == (
        "2 ranks failed (0, 2):\n"
        "  rank 0 exited with code 1 without returning a result\n"
        "  rank 2 raised KeyError: 'w'\n"
        "--- remote traceback of rank 2 ---\n"
        "tb of rank 2"
    )


@given(st.lists(st.integers(min_value=0, max_value=1000), min_size=1, max_size=8, unique=True))
def test_worker_error_orders_any_failures_by_rank(ranks):
    """Property: whatever order the failures arrive in, they are kept and reported in rank order."""
    err = WorkerError([RankFailure(rank, "ValueError", f"m{rank}", "") for rank in ranks])
    assert [f.rank for f in err.failures] == sorted(ranks)
    assert err.rank == min(ranks)
    message = str(err)
    positions = [message.index(f"rank {rank} raised ValueError: m{rank}") for rank in sorted(ranks)]
    assert positions == sorted(positions)


def test_worker_timeout_attributes():
    """WorkerTimeout keeps the timeout, each running rank's stack (by rank), and the finished ranks (sorted)."""
    err = WorkerTimeout(3.0, {2: "stack of 2\n", 0: "stack of 0\n"}, [3, 1])
    assert isinstance(err, WorkerError) and isinstance(err, TimeoutError)
    assert err.timeout == 3.0
    assert list(err.stacks) == [0, 2]
    assert (err.running_ranks, err.finished_ranks) == ([0, 2], [1, 3])
    assert [(f.rank, f.exc_type, f.message, f.traceback) for f in err.failures] == [
        (0, None, "was still running after 3 s", "stack of 0\n"),
        (2, None, "was still running after 3 s", "stack of 2\n"),
    ]
    assert err.rank == 0


def test_worker_timeout_message():
    """The message says how long, which ranks ran and which finished, then each running rank's stack."""
    err = WorkerTimeout(2.5, {1: "  File x.py, line 3 in barrier\n"}, [])
    assert str(err) == (
        "timed out after 2.5 s: rank(s) 1 still running (finished: none); every rank was stopped.\n"
        "--- Python stack of rank 1 at the timeout ---\n"
        "  File x.py, line 3 in barrier"
    )


def test_rank_failure_is_immutable():
    """A RankFailure is a frozen record."""
    failure = RankFailure(0, "ValueError", "m", "")
    with pytest.raises(AttributeError):
        failure.rank = 1


def test_torch_call_in_names_the_innermost_torch_distributed_frame_of_a_stack():
    from dtlib.errors import torch_call_in

    stack = ('  File "/venv/torch/distributed/distributed_c10d.py", line 5356 in barrier\n'
             '  File "/venv/torch/distributed/c10d_logger.py", line 83 in wrapper\n'
             '  File "/venv/torch/distributed/distributed_c10d.py", line 10 in outer\n'
             '  File "/tmp/ipykernel_1/2.py", line 4 in log_progress\n')
    assert torch_call_in(stack) == "barrier"  # most recent call first
    assert torch_call_in('  File "/tmp/ipykernel_1/2.py", line 4 in log_progress\n') is None


_OPTIONS = ("TensorOptions(dtype=float (default), device=cpu, layout=Strided (default), requires_grad=false (default), "
            "pinned_memory=false (default), memory_format=(nullopt))")


@pytest.mark.parametrize(("message", "said"), [
    # torch 2.13's own texts, from live ranks: float32 against int32, and an all-reduce against a barrier
    (f"Detected mismatch between collectives on ranks. Rank 1 is running collective: CollectiveFingerPrint("
     f"SequenceNumber=0, OpType=ALLREDUCE, TensorShape=[4], TensorDtypes=Int, TensorDeviceTypes={_OPTIONS}), but "
     f"Rank 0 is running collective: CollectiveFingerPrint(SequenceNumber=0, OpType=ALLREDUCE, TensorShape=[4], "
     f"TensorDtypes=Float, TensorDeviceTypes={_OPTIONS}).Collectives differ in the following aspects: Tensor "
     f"Tensor dtypes: Intvs Float", "this rank's all_reduce (int32[4]) does not match"),
    ("Detected mismatch between collectives on ranks. Rank 1 is running collective: CollectiveFingerPrint("
     "SequenceNumber=1OpType=BARRIER), but Rank 0 is running collective: CollectiveFingerPrint(SequenceNumber=0"
     "OpType=GATHER).Collectives differ in the following aspects: Sequence number: 1vs 0 Op type: BARRIERvs GATHER",
     "this rank's barrier does not match"),
    ("Detected mismatch between collectives on ranks. Rank 0 is running collective: CollectiveFingerPrint("
     "SequenceNumber=3, OpType=ALLREDUCE, TensorShape=[2, 4], TensorDtypes=BFloat16, ...",
     "all_reduce (bfloat16[2, 4])"),
])
def test_a_collective_check_error_names_this_ranks_call_and_only_that(message, said):
    line = errors.collective_mismatch(message)
    assert line is not None and said in line and "before any data moved" in line and "--no-check" in line
    assert "GATHER" not in line and "gather" not in line  # torch's word on the other side, wrong here, is left out


@pytest.mark.parametrize("message", ["Connection closed by peer", "Detected mismatch between collectives", ""])
def test_other_errors_are_not_said_to_be_a_collective_mismatch(message):
    assert errors.collective_mismatch(message) is None


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
