"""dtlib.checks: each checker accepts the right answer and refuses wrong ones, saying precisely what is wrong.

Rank functions defined here travel to the ranks by value (``register_pickle_by_value``), as a notebook cell's
functions do, so the ranks never import this module (or pytest). Each checker runs on the fewest ranks that give
the verdict a test asserts: 2 (and the one more every checker adds) unless the message names a larger world.
"""

from __future__ import annotations

import re
import sys
from decimal import Decimal

import cloudpickle
import numpy as np
import pytest
import torch
import torch.distributed as dist

from dtlib import checks
from dtlib.checks import training
from dtlib.launch.spawn import resolve_backend
from dtlib.measure.counting import rank_without_communication, spawn_counting
from dtlib.ring import send_recv

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _assert_verdict(feedback, ok, fragments):
    assert feedback.ok is ok, feedback.message
    for fragment in fragments:
        assert fragment in feedback.message, feedback.message


def test_feedback_shows_a_mark_and_is_truthy_only_when_ok():
    assert repr(checks.Feedback(True, "fine")) == "✓ fine"
    assert repr(checks.Feedback(False, "nope")) == "✗ nope"
    assert checks.Feedback(True, "") and not checks.Feedback(False, "")


# -- notebook 00: the backend "auto" picks ------------------------------------------------------


_PICKED = resolve_backend("auto", 2)
_NOT_PICKED = "nccl" if _PICKED == "gloo" else "gloo"
BACKEND = [
    (_PICKED, True, "Right"),
    (_PICKED.upper(), True, "Right"),
    (f"  {_PICKED.capitalize()}\n", True, "Right"),  # as typed, with spaces and a capital
    (dist.Backend(_PICKED), True, "Right"),  # torch's own constant
    (None, False, "No answer yet"),
    (42, False, "not int 42"),
    (["gloo"], False, "not list"),
    ("tcp", False, "not a backend name"),
    ("mpi", False, "'auto' never picks it"),
    ("ucc", False, "experimental backend"),
    ("auto", False, "the question is which backend it then picks"),
    ("cpu", False, "is a device, not a backend"),
    ("cuda", False, "(nccl is the one for cuda tensors)"),
    ("gloo or nccl", False, "Pick one"),
    (_NOT_PICKED, False, "GPU"),
]


@pytest.mark.parametrize(("answer", "ok", "fragment"), BACKEND)
def test_backend_choice(answer, ok, fragment):
    _assert_verdict(checks.backend_choice(answer, world_size=2), ok, [fragment])


def test_the_backend_bank_holds_many_kinds():
    assert sum(ok for _, ok, _ in BACKEND) >= 3 and len({said for _, ok, said in BACKEND if not ok}) >= 8


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="needs a machine with fewer than 2 GPUs")
def test_backend_choice_says_why_nccl_is_wrong_without_gpus():
    _assert_verdict(checks.backend_choice("nccl", world_size=2), False, ["one CUDA GPU per rank"])


# -- notebook 01: the sum of the ranks -----------------------------------------------------------


def _sum_right(rank, world_size, x):
    dist.all_reduce(x)
    return x


def _sum_right_as_a_list(rank, world_size, x):
    total = x.clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total.tolist()


def _sum_right_by_gathering(rank, world_size, x):
    pieces = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(pieces, x)
    return torch.stack(pieces).sum(0)


def _sum_right_by_reduce_and_broadcast(rank, world_size, x):
    dist.reduce(x, dst=0)
    dist.broadcast(x, src=0)
    return x


def _sum_throwaway_collective_then_closed_form(rank, world_size, x):
    dist.all_reduce(torch.tensor([float(rank)], device=x.device))  # a collective on a tensor that is not x
    return torch.full_like(x, world_size * (world_size - 1) / 2)


def _sum_by_reduce(rank, world_size, x):
    dist.reduce(x, dst=0)
    return x


def _sum_async_without_wait(rank, world_size, x):
    dist.all_reduce(x, async_op=True)  # never waited for
    return x


def _sum_hard_coded_world_size(rank, world_size, x):
    dist.all_reduce(x, op=dist.ReduceOp.AVG)
    return x * 3  # the mean times the notebook's 3 ranks


def _sum_by_max(rank, world_size, x):
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x


def _sum_double_counted(rank, world_size, x):
    total = x * world_size
    dist.all_reduce(total)
    return total


def _sum_of_the_elements(rank, world_size, x):
    total = x.sum()
    dist.all_reduce(total)
    return total


def _sum_in_half_precision(rank, world_size, x):
    total = x.half()
    dist.all_reduce(total)
    return total


def _sum_rounded_first(rank, world_size, x):
    total = x.round()
    dist.all_reduce(total)
    return total


def _sum_as_integers(rank, world_size, x):
    dist.all_reduce(x)
    return x.long()


def _raises(rank, world_size, x):
    raise KeyError("missing")


def _hangs(rank, world_size, x):
    if rank == 0:
        dist.barrier()
    return x


def _sum_by_arithmetic(rank, world_size):
    return torch.tensor([float(world_size * (world_size - 1) // 2)])  # right number, no collective


def _every_call(rank, world_size):
    from dtlib.ring import send_recv

    value = torch.ones(2)
    dist.all_reduce(value)
    dist.all_reduce(value)
    dist.broadcast(value, src=0)
    dist.all_gather([torch.empty(2) for _ in range(world_size)], value)
    send_recv.ring_shift(value, torch.empty(2), rank, world_size)
    dist.barrier()
    return rank


def _sum_right_in_halves(rank, world_size, x):  # right: the all-reduce in two calls
    half = x.numel() // 2
    first, second = x[:half].clone(), x[half:].clone()
    dist.all_reduce(first)
    dist.all_reduce(second)
    return torch.cat([first, second])


def _sum_right_by_an_unwaited_functional_call(rank, world_size, x):  # right: torch waits for it on first use
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_reduce(x, "sum", dist.group.WORLD)


def _sum_functional_result_unused(rank, world_size, x):
    from torch.distributed import _functional_collectives as funcol

    funcol.all_reduce(x, "sum", dist.group.WORLD)
    return x


def _sum_reading_the_checkers_frames(rank, world_size, x):  # a hostile answer: every rank's input, found by walking
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        found = frame.f_locals.get("inputs")
        if isinstance(found, list) and len(found) == world_size:
            return sum(found)
        frame = frame.f_back
    return x


SUM_RIGHT = [_sum_right, _sum_right_as_a_list, _sum_right_by_gathering, _sum_right_by_reduce_and_broadcast,
             _sum_right_in_halves, _sum_right_by_an_unwaited_functional_call]

#: (wrong answer, what the message must say): one of each kind
SUM_WRONG = [
    (_sum_throwaway_collective_then_closed_form, ["called dist.all_reduce, but on [0], not on its own x"]),
    (lambda rank, world_size, x: x, ["it returned its own x: was dist.all_reduce called"]),
    (_sum_functional_result_unused, ["called the functional all_reduce", "Use what it returns"]),
    (_sum_reading_the_checkers_frames, ["it returned its own x"]),  # the other ranks' inputs are out of reach
    (_sum_by_reduce, ["does not hold the result: dist.reduce leaves it on its dst alone, here rank 0"]),
    (_sum_async_without_wait, ["call .wait()"]),
    (_sum_hard_coded_world_size, ["With 4 ranks", "it holds 3/4 of the sum: a fixed 3"]),
    (_sum_by_max, ["the largest value of each slot: ReduceOp.MAX"]),
    (_sum_double_counted, ["world_size times too big"]),
    (_sum_of_the_elements, ["it returned one number, the total of x's", "not x.sum()"]),
    (_sum_in_half_precision, ["it computed in float16"]),
    (_sum_rounded_first, ["called dist.all_reduce on its x rounded to whole numbers"]),
    (_sum_as_integers, ["it returned whole numbers"]),
    (lambda rank, world_size, x: None, ["it returned None"]),
    (lambda rank, world_size, x: "three", ["it returned 'three'"]),
    (lambda rank, world_size: 3, ["Your function raised on a rank", "TypeError"]),  # the old signature
    (_raises, ["raised KeyError"]),
    ("not a function", ["Pass your function itself"]),
]


#: the wrong answers whose message needs more than 2 ranks (and 3): the world size each is judged with
SUM_WORLD = {_sum_hard_coded_world_size: 3}  # its fixed 3 is right on 3 ranks and 3/4 of the sum on 4


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fn", SUM_RIGHT)
def test_sum_of_ranks_takes_right_answers_written_differently(fn):
    _assert_verdict(checks.sum_of_ranks(fn, world_size=2), True, ["with 2 ranks and with 3"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("fn", "fragments"), SUM_WRONG)
def test_sum_of_ranks_names_each_kind_of_wrong_answer(fn, fragments):
    _assert_verdict(checks.sum_of_ranks(fn, world_size=SUM_WORLD.get(fn, 2)), False, fragments)


def test_the_rank_exercises_own_their_data():
    """Each call draws new data: random float32 fractions, rank-dependent, a length that is not the world size,
    and one of the two world sizes judged is odd."""
    from dtlib.checks.rank_functions import SUM_OF_RANKS

    def draw(size, seed):
        return SUM_OF_RANKS.inputs(size, torch.Generator().manual_seed(seed))

    first, again, other = draw(4, 1), draw(4, 1), draw(4, 2)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], other[0])
    assert all(x.dtype == torch.float32 and x.numel() != 4 for x in first)
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[0], first[0].round())
    assert {size % 2 for size in (3, 3 + 1)} == {0, 1}


@pytest.mark.timeout(60)
def test_sum_of_ranks_reports_a_hang_instead_of_hanging():
    # The ranks must reach the barrier before the timeout for the message to name it: 3 s missed at load 10.
    _assert_verdict(checks.sum_of_ranks(_hangs, world_size=2, timeout=8), False, ["hung", "barrier"])


@pytest.mark.timeout(60)
def test_the_counter_sees_each_collective_send_recv_and_barrier_a_rank_makes():
    values, calls = spawn_counting(_every_call, 2)
    assert values == [0, 1]
    expected = {"all_reduce": 2, "broadcast": 1, "all_gather": 1, "send": 1, "recv": 1, "barrier": 1}
    assert calls == [expected, expected]
    values, calls = spawn_counting(_sum_by_arithmetic, 2)
    assert calls == [{}, {}] and rank_without_communication(calls) == 0


def test_a_barrier_alone_moves_no_data():
    assert rank_without_communication([{"all_reduce": 1}, {"barrier": 1}]) == 1
    assert rank_without_communication([{"all_reduce": 1}, {"send": 2, "recv": 2}]) is None


# -- notebook 02: an average without ReduceOp.AVG ------------------------------------------------


def _average_right(rank, world_size, values):
    dist.all_reduce(values)
    return values / world_size


def _average_dividing_first(rank, world_size, values):
    share = values / world_size
    dist.all_reduce(share, op=dist.ReduceOp.SUM)
    return share


def _average_with_avg(rank, world_size, values):
    dist.all_reduce(values, op=dist.ReduceOp.AVG)
    return values


def _average_as(kind):
    def average(rank, world_size, values):
        dist.all_reduce(values)
        mean = values / world_size
        return {"list": mean.tolist(), "tuple": tuple(mean.tolist()), "numpy": mean.numpy()}[kind]

    return average


def _average_throwaway_collective_then_closed_form(rank, world_size, values):
    from dtlib.ring.send_recv import starting_values

    dist.all_reduce(torch.ones(1, device=values.device))  # a collective, on a tensor that is not values
    return torch.stack([starting_values(r, world_size) for r in range(world_size)]).mean(0)


def _average_dividing(how):
    def average(rank, world_size, values):
        dist.all_reduce(values)
        return {"floor": lambda: values // world_size, "twice": lambda: values / world_size / world_size,
                "by one less": lambda: values / (world_size - 1), "as integers": lambda: values.long() // world_size,
                "by its length": lambda: values / values.numel(), "by four": lambda: values / 4,
                "not at all": lambda: values, "over the slots too": lambda: (values / world_size).mean()}[how]()

    return average


def _average_wrong_collective(how):
    def average(rank, world_size, values):
        if how == "reduce":
            dist.reduce(values, dst=0)
        elif how == "max":
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
        elif how == "async":
            dist.all_reduce(values, async_op=True)  # never waited for
        else:  # what an async all-reduce read before its wait() would look like: the rank's own values
            dist.all_reduce(values.clone())
        return values if how == "max" else values / world_size

    return average


_average_by_four = _average_dividing("by four")
_average_twice = _average_dividing("twice")
_average_by_one_less = _average_dividing("by one less")

AVERAGE_RIGHT = [_average_right, _average_dividing_first, _average_as("list"), _average_as("numpy")]

AVERAGE_WRONG = [
    (_average_throwaway_collective_then_closed_form, ["called dist.all_reduce, but on [1], not on its own values"]),
    (_average_dividing("by its length"), ["the number of values each rank holds (values.numel())"]),
    (_average_by_four, ["With 5 ranks, rank 0 holds the sum divided by 4", "not by a fixed number"]),
    (_average_wrong_collective("reduce"), ["does not hold the result: dist.reduce"]),
    (_average_wrong_collective("async"), ["call .wait()"]),
    (_average_wrong_collective("max"), ["holds the largest values, not the mean: ReduceOp.MAX"]),
    (_average_wrong_collective("unfinished"), ["the all-reduce had not finished", ".wait()"]),
    (_average_dividing("not at all"), ["holds the sum of the ranks' values: divide by world_size"]),
    (lambda rank, world_size, values: values, ["still holds its own values"]),
    (_average_dividing("floor"), ["rounded down", "not with //"]),
    (_average_twice, ["divided by world_size twice"]),
    (_average_by_one_less, ["divided by world_size - 1"]),
    (_average_dividing("as integers"), ["returned integers", "keep them as floats"]),
    (_average_dividing("over the slots too"), ["returned one number, the mean over the slots too"]),
    (lambda rank, world_size, values: None, ["return the averaged tensor"]),
]


#: the wrong answers whose message needs more than 2 ranks (and 3): the world size each is judged with
AVERAGE_WORLD = {
    _average_by_four: 4,  # dividing by a fixed 4 is right on the notebook's 4 ranks and wrong on 5
    _average_twice: 3,  # dividing twice: on 2 ranks, by 4, which may be the number of values each rank holds
    _average_by_one_less: 3,  # dividing by world_size - 1: on 2 ranks that is not dividing at all
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fn", AVERAGE_RIGHT)
def test_average_of_ranks_takes_right_answers_written_differently(fn):
    _assert_verdict(checks.average_of_ranks(fn, world_size=2), True, ["holds the mean", "with 2 ranks and with 3"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("fn", "fragments"), AVERAGE_WRONG)
def test_average_of_ranks_names_each_kind_of_wrong_answer(fn, fragments):
    _assert_verdict(checks.average_of_ranks(fn, world_size=AVERAGE_WORLD.get(fn, 2)), False, fragments)


def test_the_rank_exercise_banks_hold_many_kinds():
    for right, wrong in ((SUM_RIGHT, SUM_WRONG), (AVERAGE_RIGHT, AVERAGE_WRONG)):
        assert len(right) >= 3 and len(wrong) >= 8
        assert len({tuple(says) for _, says in wrong}) == len(wrong)


@pytest.mark.timeout(60)
def test_average_with_reduce_op_avg_is_right_where_gloo_has_it_and_explained_where_not():
    feedback = checks.average_of_ranks(_average_with_avg, world_size=2)
    assert feedback.ok or "no ReduceOp.AVG" in feedback.message, feedback.message


# -- notebook 03: one phase of the ring -------------------------------------------------------


def _gather_by_adding(chunks, rank, world_size):
    import torch

    from dtlib.ring import send_recv

    for step in range(world_size - 1):
        send, receive = (rank - step) % world_size, (rank - 1 - step) % world_size
        incoming = torch.empty_like(chunks[receive])
        send_recv.ring_shift(chunks[send], incoming, rank, world_size)
        chunks[receive] += incoming  # wrong: the all-gather phase copies


def _gather_nothing(chunks, rank, world_size):
    pass


def _gather_wrong_chunks(chunks, rank, world_size):
    import torch

    from dtlib.ring import send_recv

    for step in range(world_size - 1):
        send, receive = (rank + step) % world_size, (rank - 1 - step) % world_size  # wrong: sends rank + step
        incoming = torch.empty_like(chunks[receive])
        send_recv.ring_shift(chunks[send], incoming, rank, world_size)
        chunks[receive].copy_(incoming)


def _gather_the_notebook_stub(chunks, rank, world_size):
    import torch

    from dtlib.ring import send_recv

    for _ in range(world_size - 1):
        send = receive = rank  # notebook 03's starting point
        incoming = torch.empty_like(chunks[receive])
        send_recv.ring_shift(chunks[send], incoming, rank, world_size)
        chunks[receive].copy_(incoming)


def _gather_without_copy(chunks, rank, world_size):
    import torch

    from dtlib.ring import send_recv

    for step in range(world_size - 1):  # notebook 03's solution without chunks[receive].copy_(incoming)
        send, receive = (rank - step) % world_size, (rank - 1 - step) % world_size
        incoming = torch.empty_like(chunks[receive])
        send_recv.ring_shift(chunks[send], incoming, rank, world_size)


def _gather_by_assignment(chunks, rank, world_size):
    import torch

    from dtlib.ring import send_recv

    for step in range(world_size - 1):
        send, receive = (rank - step) % world_size, (rank - 1 - step) % world_size
        incoming = torch.empty_like(chunks[receive])
        send_recv.ring_shift(chunks[send], incoming, rank, world_size)
        chunks[receive] = incoming  # wrong: replaces the list entry, the buffer never sees it


def _scatter_without_add(chunks, rank, world_size):
    import torch

    from dtlib.ring import send_recv

    for step in range(world_size - 1):  # dtlib's reduce-scatter without chunks[receive] += incoming
        send, receive = (rank - 1 - step) % world_size, (rank - 2 - step) % world_size
        incoming = torch.empty_like(chunks[receive])
        send_recv.ring_shift(chunks[send], incoming, rank, world_size)


def _rank_0_skips_the_ring(chunks, rank, world_size):
    from dtlib.ring import send_recv

    if rank != 0:
        send_recv.ring_all_gather_phase(chunks, rank, world_size)


def _gather_for_four_ranks(chunks, rank, world_size):
    import torch

    from dtlib.ring import send_recv

    for step in range(3):  # wrong: the notebook's 4 ranks, hard-coded
        send, receive = (rank - step) % 4, (rank - 1 - step) % 4
        incoming = torch.empty_like(chunks[receive])
        send_recv.ring_shift(chunks[send], incoming, rank, world_size)
        chunks[receive].copy_(incoming)


def _gather_by_broadcast(chunks, rank, world_size):
    import torch.distributed as dist

    for owner in range(world_size):  # the right buffer, but no ring: each owner broadcasts its chunk
        dist.broadcast(chunks[owner], src=owner)


def _gather_straight_into_the_chunk(chunks, rank, world_size):
    from dtlib.ring import send_recv

    for step in range(world_size - 1):  # right, written another way: receive into the chunk itself
        send_recv.ring_shift(chunks[(rank - step) % world_size], chunks[(rank - 1 - step) % world_size], rank,
                               world_size)


def _gather_by_passing_on_what_arrived(chunks, rank, world_size):
    import torch

    from dtlib.ring import send_recv

    outgoing = chunks[rank].clone()  # right, written another way: pass on the tensor that arrived last
    for step in range(1, world_size):
        incoming = torch.empty_like(chunks[(rank - step) % world_size])
        send_recv.ring_shift(outgoing, incoming, rank, world_size)
        chunks[(rank - step) % world_size].copy_(incoming)
        outgoing = incoming


def _gather_leftwards(chunks, rank, world_size):
    import torch

    from dtlib.ring import send_recv

    for step in range(world_size - 1):  # wrong: the chunks of the ring that runs the other way
        send, receive = (rank + step) % world_size, (rank + 1 + step) % world_size
        incoming = torch.empty_like(chunks[receive])
        send_recv.ring_shift(chunks[send], incoming, rank, world_size)
        chunks[receive].copy_(incoming)


def _junk_shifts_then_the_formula(chunks, rank, world_size):
    import torch

    from dtlib.ring import send_recv

    for _ in range(world_size - 1):  # a probe's: shifts that carry nothing, then numbers that know the inputs
        send_recv.ring_shift(torch.zeros(1, dtype=chunks[0].dtype), torch.empty(1, dtype=chunks[0].dtype), rank,
                               world_size)
    start, total = 0, sum(10.0**r for r in range(world_size))  # the inputs of an older checker
    for chunk in chunks:
        chunk.copy_(torch.arange(start, start + chunk.numel(), dtype=chunk.dtype) * total)
        start += chunk.numel()


def _gather_twice(chunks, rank, world_size):
    from dtlib.ring import send_recv

    send_recv.ring_all_gather_phase(chunks, rank, world_size)
    send_recv.ring_all_gather_phase(chunks, rank, world_size)  # right again, at twice the bytes


def _gather_in_float16(chunks, rank, world_size):
    import torch

    from dtlib.ring import send_recv

    for step in range(world_size - 1):  # wrong: half the bytes on the wire, and 3 digits left of each number
        send, receive = (rank - step) % world_size, (rank - 1 - step) % world_size
        incoming = torch.empty_like(chunks[receive], dtype=torch.float16)
        send_recv.ring_shift(chunks[send].half(), incoming, rank, world_size)
        chunks[receive].copy_(incoming)


def _gather_in_int32(chunks, rank, world_size):
    import torch

    from dtlib.ring import send_recv

    for step in range(world_size - 1):  # wrong: whole numbers only
        send, receive = (rank - step) % world_size, (rank - 1 - step) % world_size
        incoming = torch.empty_like(chunks[receive], dtype=torch.int32)
        send_recv.ring_shift(chunks[send].int(), incoming, rank, world_size)
        chunks[receive].copy_(incoming)


def _gather_by_send_and_recv_without_copy(chunks, rank, world_size):
    import torch
    import torch.distributed as dist

    for step in range(world_size - 1):  # wrong: its own transfers, and what arrives is dropped
        send, receive = (rank - step) % world_size, (rank - 1 - step) % world_size
        incoming = torch.empty_like(chunks[receive])
        ops = [dist.P2POp(dist.isend, chunks[send], (rank + 1) % world_size),
               dist.P2POp(dist.irecv, incoming, (rank - 1) % world_size)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _gather_sending_copies(chunks, rank, world_size):  # right: a copy of the chunk carries the same numbers
    import torch

    from dtlib.ring import send_recv

    for step in range(world_size - 1):
        send, receive = (rank - step) % world_size, (rank - 1 - step) % world_size
        incoming = torch.empty_like(chunks[receive])
        send_recv.ring_shift(chunks[send].clone(), incoming, rank, world_size)
        chunks[receive].copy_(incoming)


RING = [
    (_gather_sending_copies, "all_gather", True, ["all-gather phase works"]),
    (send_recv.ring_all_gather_phase, "all_gather", True, ["with 4 ranks (uneven chunks) and with 5",
                                                             "on new numbers each time"]),
    (send_recv.ring_reduce_scatter_phase, "reduce_scatter", True, ["reduce-scatter phase works"]),
    (_gather_by_adding, "all_gather", False, ["added twice"]),
    (_gather_nothing, "all_gather", False, ["never reached it", "never called ring_shift"]),
    (_gather_without_copy, "all_gather", False, ["what arrived never landed in chunks: copy it in with copy_"]),
    (_gather_by_assignment, "all_gather", False, ["never landed in the buffer", "chunks[receive].copy_(incoming)"]),
    (_gather_straight_into_the_chunk, "all_gather", True, ["all-gather phase works"]),
    (_gather_by_passing_on_what_arrived, "all_gather", True, ["all-gather phase works"]),
    (_gather_wrong_chunks, "all_gather", False, ["In ring step 2 of 3, rank 3 sent chunk 0 (3 elements) to rank 0",
                                                 "received into a buffer of 2"]),
    (_gather_the_notebook_stub, "all_gather", False, ["In ring step 1 of 3, rank 3 sent chunk 3 (2 elements)",
                                                      "to rank 0, which received into a buffer of 3"]),
    (_gather_leftwards, "all_gather", False, ["the chunk a rank sends at a step must be the very chunk"]),
    (_junk_shifts_then_the_formula, "all_gather", False, ["In ring step 1 of 3, rank 0 sent a tensor of 1 elements "
                                                          "that holds none of its chunks"]),
    (_rank_0_skips_the_ring, "all_gather", False, ["The ring hung"]),
    (_gather_for_four_ranks, "all_gather", False, ["works with 4 ranks but not with 5", "never the number 4"]),
    (_gather_by_broadcast, "all_gather", False, ["called broadcast", "the exercise is the ring itself"]),
    (_gather_twice, "all_gather", False, ["sent 6 chunks and received 6", "3 steps for 4 ranks"]),
    (_scatter_without_add, "reduce_scatter", False, ["was never added to chunks", "chunks[receive] += incoming"]),
    (_gather_in_float16, "all_gather", False, ["rank 0 sent float16 and received into float16, while the buffer "
                                               "holds float64", "rounds every partial sum"]),
    (_gather_in_int32, "all_gather", False, ["sent int32 and received into int32"]),
    (_gather_by_send_and_recv_without_copy, "all_gather", False, ["sent 2 times with dist.send and never called "
                                                                  "ring_shift"]),
]


#: A ring needs 3 ranks (and 4): the phases whose message names the notebook's 4 ranks (and 5) run on 4.
RING_WORLD = {send_recv.ring_all_gather_phase: 4, _gather_wrong_chunks: 4, _gather_the_notebook_stub: 4,
              _junk_shifts_then_the_formula: 4, _gather_for_four_ranks: 4, _gather_twice: 4}
RING_HANGS = {_rank_0_skips_the_ring}  # judged hung once the timeout passes: a short one, as for sum_of_ranks


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("phase", "which", "ok", "fragments"), RING)
def test_ring_phase(phase, which, ok, fragments):
    feedback = checks.ring_phase(phase, which=which, world_size=RING_WORLD.get(phase, 3),
                                 timeout=3 if phase in RING_HANGS else 10)
    _assert_verdict(feedback, ok, fragments)


def test_the_ring_bank_holds_many_kinds():
    assert sum(ok for _, _, ok, _ in RING) >= 3 and sum(not ok for _, _, ok, _ in RING) >= 8


def test_ring_phase_refuses_bad_arguments():
    assert "which must be" in checks.ring_phase(_gather_nothing, which="broadcast").message
    assert "function itself" in checks.ring_phase("my_phase").message


# -- notebook 04: the gradient-averaging hook ------------------------------------------------------


# The bank of wrong and right hooks is in tests/checks/test_training_checks.py.


def test_the_hooks_oracle_is_the_mean_of_the_ranks_gradients():
    """One process on every rank's samples: its gradient is the mean of the ranks' gradients (the loss is a mean)."""
    from dtlib.train import data, models

    world_size, per_rank = 3, training.SAMPLES_PER_RANK
    x, y = data.regression(per_rank * world_size, seed=1).tensors
    grads = []
    for rank in range(world_size):
        model = models.build("mlp", seed=0)
        part = slice(rank * per_rank, (rank + 1) * per_rank)
        models.loss_fn("mlp", model(x[part]), y[part]).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert torch.allclose(training._one_process_gradient(world_size), torch.stack(grads).mean(0), atol=1e-6)


# -- notebook 05: bytes of model state under FULL_SHARD, and the wrap ---------------------------------

FULL_SHARD_BYTES = 16 * 28_064 / 4  # 112,256: 16 bytes per fp32 parameter with Adam, sharded over 4 ranks


@pytest.mark.parametrize(
    ("answer", "ok", "fragments"),
    [
        (FULL_SHARD_BYTES, True, ["112,256 bytes per rank"]),
        (int(FULL_SHARD_BYTES), True, ["112,256 bytes per rank"]),
        (FULL_SHARD_BYTES / 1e6, False, ["0.112256 looks like the answer in MB", "112,256 bytes", "in bytes"]),
        (FULL_SHARD_BYTES / 2**20, False, ["the answer in MiB", "112,256 bytes"]),
        (FULL_SHARD_BYTES / 2**30, False, ["the answer in GiB", "112,256 bytes"]),
        (16 * 28_064 / 1e3, False, ["looks like KB", "449,024 bytes", "as DDP does"]),
        (16 * 28_064, False, ["449,024 bytes: that is every rank holding everything"]),
        (0.2, False, ["0.2 bytes is off by a factor of 1.78e-06"]),
        (None, False, ["No answer yet"]),
        ("112256", True, ["112,256 bytes per rank"]),  # typed as text: the same number (dtlib.checks.typed)
        ("112,256 bytes", True, ["112,256 bytes per rank"]),
        (Decimal(112256), True, ["112,256 bytes per rank"]),
        ("about 112 kB", False, ["not the text 'about 112 kB'"]),
        (np.int64(FULL_SHARD_BYTES), True, ["112,256 bytes per rank"]),  # computed with numpy
        (torch.tensor(16 * 28_064) / 4, True, ["112,256 bytes per rank"]),  # or with torch
        (4 * 28_064 / 4, False, ["counts the parameters only"]),
        (12 * 28_064 / 4, False, ["misses the gradients"]),
        (float("nan"), False, ["Answer with a finite number of bytes, not nan"]),
        (-FULL_SHARD_BYTES, False, ["a positive count"]),
    ],
)
def test_fsdp_memory(answer, ok, fragments):
    feedback = checks.fsdp_memory(answer)
    _assert_verdict(feedback, ok, fragments)
    assert not re.search(r"(^|\s)0 bytes|factor of 0\.00", feedback.message)  # no small number shown as 0


def _wrap_blocks_then_root(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _wrap_by_type_and_keep_the_root_gathered(model, mesh):
    from torch.distributed.fsdp import fully_shard

    from dtlib.train.models import Block

    for module in model.modules():  # right, written another way: units found by type
        if isinstance(module, Block):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)  # backward needs the root's parameters first
    return model


def _wrap_blocks_with_a_policy(model, mesh):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(reduce_dtype=torch.float32)}
    for index in reversed(range(len(model.blocks))):  # right: the order among blocks does not matter
        fully_shard(model.blocks[index], **policy)
    fully_shard(model, **policy)
    return model


def _wrap_root_only(model, mesh):
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=mesh)
    return model


def _wrap_blocks_only(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return model


def _wrap_root_first(model, mesh):
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=mesh)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return model


def _wrap_one_block(model, mesh):
    from torch.distributed.fsdp import fully_shard

    fully_shard(model.blocks[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _wrap_blocks_as_one_group(model, mesh):
    from torch.distributed.fsdp import fully_shard

    fully_shard(list(model.blocks), mesh=mesh)  # one unit for both blocks
    return fully_shard(model, mesh=mesh)


def _wrap_every_linear(model, mesh):
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    for module in list(model.modules()):
        if isinstance(module, nn.Linear):
            fully_shard(module, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _wrap_in_ddp(model, mesh):
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def _wrap_without_the_mesh(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)  # the default mesh: the accelerator's type, unnamed, whatever the ranks compute on
    return fully_shard(model)



def _wrap_in_bfloat16(model, mesh):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def _wrap_blocks_in_reverse(model, mesh):  # right: the order of the blocks does not matter, the root last does
    from torch.distributed.fsdp import fully_shard

    for block in reversed(list(model.blocks)):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


WRAPS = [
    (_wrap_blocks_in_reverse, True, ["Each block is a unit and the root comes last, with 2 ranks and with 3"]),
    (_wrap_in_bfloat16, False, ["your layers computed in bfloat16", "MixedPrecisionPolicy"]),
    (_wrap_blocks_then_root, True, ["224,632 bytes of model state", "(16P/N = 224,512)"]),
    (_wrap_by_type_and_keep_the_root_gathered, True, ["Each block is a unit and the root comes last"]),
    (_wrap_blocks_with_a_policy, True, ["Each block is a unit and the root comes last"]),
    (lambda model, mesh: model, False, ["Nothing was sharded"]),
    (lambda model: model, False, ["my_wrap(model, mesh)"]),
    (_wrap_without_the_mesh, False, ["not over the mesh you were given", "pass mesh=mesh to every fully_shard"]),
    (_wrap_root_only, False, ["Only the root is a unit: forward gathers 112,256 bytes"]),
    (_wrap_one_block, False, ["Only some blocks are units"]),
    (_wrap_blocks_only, False, ["the root is not"]),
    (_wrap_root_first, False, ["fully_shard(model) came before the blocks"]),
    (_wrap_in_ddp, False, ["Return the model you were given"]),
    ("fully_shard", False, ["Pass your function itself"]),
    (_wrap_blocks_as_one_group, False, ["Your 2 blocks are 1 unit", "groups its modules into one unit"]),
    (_wrap_every_linear, False, ["Your units are smaller than a block", "less than a unit per block would"]),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("wrap, ok, fragments", WRAPS)
def test_fsdp_wrap(wrap, ok, fragments):
    """A right wrap trains as DDP does past an update (2 steps: the second loss follows the first step's averaged
    gradients); a wrong one is named from how it left the model and what forward computed in, seen in 1 step."""
    _assert_verdict(checks.fsdp_wrap(wrap, steps=2 if ok else 1), ok, fragments)


def test_the_wrap_bank_holds_many_kinds():
    assert sum(ok for _, ok, _ in WRAPS) >= 3 and sum(not ok for _, ok, _ in WRAPS) >= 8


# --- the skeleton every rank-function exercise shares ----------------------------------------------------------


def _world_size_everywhere(rank, world_size):
    import torch.distributed as dist

    size = torch.tensor(1.0)
    dist.all_reduce(size)
    return size.item()


def _rank_only(rank, world_size):
    return float(rank)


@pytest.mark.timeout(120)
def test_a_new_exercise_is_a_table_and_the_first_matching_hint_explains():
    """A made-up exercise (return the world size, counted by a collective) on the skeleton: right, wrong
    (its first hint that holds wins over a later one that holds too), and not a function."""
    from dtlib.checks.skeleton import RankExercise, judge

    exercise = RankExercise(
        expected=float, read=float, same=lambda value, expected: value == expected,
        hints=[(lambda a: a.value == a.rank, lambda a: f"first: rank {a.rank} of {a.size}"),
               (lambda a: True, lambda a: "second")],
        otherwise=lambda a: "otherwise", no_collective=lambda rank, expected, calls: f"silent {rank}",
        right=lambda first, second, values: f"right with {first} and {second}",
        hang=lambda err, name: "hung", failure=lambda err: "failed")
    verdicts = [judge(fn, exercise, 2, 60) for fn in (_world_size_everywhere, _rank_only,
                                                      lambda rank, world_size: float(world_size), 3)]
    assert [(v.ok, v.message) for v in verdicts] == [
        (True, "right with 2 and 3"), (False, "first: rank 0 of 2"), (False, "silent 0"),
        (False, "Pass your function itself, not int.")]


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
    _assert_verdict(feedback, True, [f"{tp_name} group ([0, 1, 2, 3], ...) is inside one node",
                                     f"{dp_name} group ([0, 4], ...) crosses nodes"])


@pytest.mark.parametrize("shape, names, says", MESH_WRONG)
def test_mesh_for_nodes_refuses_each_kind_of_wrong_mesh(shape, names, says):
    _assert_verdict(checks.mesh_for_nodes(shape, names, nodes=2, gpus_per_node=4, tp_size=4), False, [says])


def test_mesh_for_nodes_banks_hold_many_kinds_and_namings():
    assert len(MESH_RIGHT) >= 5 and len({names[0] for _, names, _ in MESH_RIGHT}) >= 5
    assert len(MESH_WRONG) >= 8 and len({says for _, _, says in MESH_WRONG}) == len(MESH_WRONG)


def test_mesh_for_nodes_with_unnamed_roles_picks_the_dimension_that_stays_in_a_node():
    square = checks.mesh_for_nodes((2, 2), ("a", "b"), nodes=2, gpus_per_node=2, tp_size=2)
    _assert_verdict(square, True, ["With \"b\" for tensor parallelism", "b group ([0, 1], ...)"])


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


def _cell(source: str, **globals_) -> object:
    """A function as a notebook cell defines it: its module cannot be imported, so it travels by value."""
    namespace = {"__name__": "a_notebook_cell", "dist": dist, **globals_}
    exec(source, namespace)  # noqa: S102 - the test's own source
    return namespace[source.split("def ", 1)[1].split("(", 1)[0]]


def test_an_answer_using_an_unpicklable_global_gets_a_verdict_that_names_it():
    """Checkers promise never to raise on an answer; dtlib.spawn's own TypeError reached the learner, naming
    "args[0] (function)" and not the global that could not travel."""
    import threading

    answer = _cell("def my_average(rank, world_size, values):\n    with lock:\n        dist.all_reduce(values)\n"
                   "        return values / world_size\n", lock=threading.Lock())
    feedback = checks.average_of_ranks(answer)
    _assert_verdict(feedback, False, ["cannot be sent to the ranks: it uses the global lock (lock)",
                                      "pass it as an argument, or create it inside the function"])
    assert "args[0]" not in feedback.message


def test_a_rank_that_exits_is_named_not_the_gloo_error_of_the_rank_it_left():
    answer = _cell("def leaves(rank, world_size, values):\n    import os\n    if rank == 1:\n        os._exit(3)\n"
                   "    dist.all_reduce(values)\n    return values / world_size\n")
    _assert_verdict(checks.average_of_ranks(answer, world_size=2), False,
                    ["A rank left your function before the end (rank 1 exited with code 3"])
