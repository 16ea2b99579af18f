"""dtlib.checks.ring_phases (notebook 03): one phase of the ring all-reduce, against right phases written
differently and one of each kind of wrong phase.

Phases defined here travel to the ranks by value, as a notebook cell's functions do.
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from verdicts import assert_verdict

from dtlib import checks
from dtlib.ring import send_recv

cloudpickle.register_pickle_by_value(sys.modules[__name__])


# -- notebook 03: one phase of the ring -------------------------------------------------------


def _gather_by_adding(chunks, rank, world_size):

    from dtlib.ring import send_recv

    for step in range(world_size - 1):
        send, receive = (rank - step) % world_size, (rank - 1 - step) % world_size
        incoming = torch.empty_like(chunks[receive])
        send_recv.ring_shift(chunks[send], incoming, rank, world_size)
        chunks[receive] += incoming  # wrong: the all-gather phase copies


def _gather_nothing(chunks, rank, world_size):
    pass


def _gather_wrong_chunks(chunks, rank, world_size):

    from dtlib.ring import send_recv

    for step in range(world_size - 1):
        send, receive = (rank + step) % world_size, (rank - 1 - step) % world_size  # wrong: sends rank + step
        incoming = torch.empty_like(chunks[receive])
        send_recv.ring_shift(chunks[send], incoming, rank, world_size)
        chunks[receive].copy_(incoming)


def _gather_the_notebook_stub(chunks, rank, world_size):

    from dtlib.ring import send_recv

    for _ in range(world_size - 1):
        send = receive = rank  # notebook 03's starting point
        incoming = torch.empty_like(chunks[receive])
        send_recv.ring_shift(chunks[send], incoming, rank, world_size)
        chunks[receive].copy_(incoming)


def _gather_without_copy(chunks, rank, world_size):

    from dtlib.ring import send_recv

    for step in range(world_size - 1):  # notebook 03's solution without chunks[receive].copy_(incoming)
        send, receive = (rank - step) % world_size, (rank - 1 - step) % world_size
        incoming = torch.empty_like(chunks[receive])
        send_recv.ring_shift(chunks[send], incoming, rank, world_size)


def _gather_by_assignment(chunks, rank, world_size):

    from dtlib.ring import send_recv

    for step in range(world_size - 1):
        send, receive = (rank - step) % world_size, (rank - 1 - step) % world_size
        incoming = torch.empty_like(chunks[receive])
        send_recv.ring_shift(chunks[send], incoming, rank, world_size)
        chunks[receive] = incoming  # wrong: replaces the list entry, the buffer never sees it


def _scatter_without_add(chunks, rank, world_size):

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

    from dtlib.ring import send_recv

    for step in range(3):  # wrong: the notebook's 4 ranks, hard-coded
        send, receive = (rank - step) % 4, (rank - 1 - step) % 4
        incoming = torch.empty_like(chunks[receive])
        send_recv.ring_shift(chunks[send], incoming, rank, world_size)
        chunks[receive].copy_(incoming)


def _gather_by_broadcast(chunks, rank, world_size):

    for owner in range(world_size):  # the right buffer, but no ring: each owner broadcasts its chunk
        dist.broadcast(chunks[owner], src=owner)


def _gather_straight_into_the_chunk(chunks, rank, world_size):
    from dtlib.ring import send_recv

    for step in range(world_size - 1):  # right, written another way: receive into the chunk itself
        send_recv.ring_shift(chunks[(rank - step) % world_size], chunks[(rank - 1 - step) % world_size], rank,
                               world_size)


def _gather_by_passing_on_what_arrived(chunks, rank, world_size):

    from dtlib.ring import send_recv

    outgoing = chunks[rank].clone()  # right, written another way: pass on the tensor that arrived last
    for step in range(1, world_size):
        incoming = torch.empty_like(chunks[(rank - step) % world_size])
        send_recv.ring_shift(outgoing, incoming, rank, world_size)
        chunks[(rank - step) % world_size].copy_(incoming)
        outgoing = incoming


def _gather_leftwards(chunks, rank, world_size):

    from dtlib.ring import send_recv

    for step in range(world_size - 1):  # wrong: the chunks of the ring that runs the other way
        send, receive = (rank + step) % world_size, (rank + 1 + step) % world_size
        incoming = torch.empty_like(chunks[receive])
        send_recv.ring_shift(chunks[send], incoming, rank, world_size)
        chunks[receive].copy_(incoming)


def _junk_shifts_then_the_formula(chunks, rank, world_size):

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

    from dtlib.ring import send_recv

    for step in range(world_size - 1):  # wrong: half the bytes on the wire, and 3 digits left of each number
        send, receive = (rank - step) % world_size, (rank - 1 - step) % world_size
        incoming = torch.empty_like(chunks[receive], dtype=torch.float16)
        send_recv.ring_shift(chunks[send].half(), incoming, rank, world_size)
        chunks[receive].copy_(incoming)


def _gather_in_int32(chunks, rank, world_size):

    from dtlib.ring import send_recv

    for step in range(world_size - 1):  # wrong: whole numbers only
        send, receive = (rank - step) % world_size, (rank - 1 - step) % world_size
        incoming = torch.empty_like(chunks[receive], dtype=torch.int32)
        send_recv.ring_shift(chunks[send].int(), incoming, rank, world_size)
        chunks[receive].copy_(incoming)


def _gather_by_send_and_recv_without_copy(chunks, rank, world_size):
    import torch.distributed as dist

    for step in range(world_size - 1):  # wrong: its own transfers, and what arrives is dropped
        send, receive = (rank - step) % world_size, (rank - 1 - step) % world_size
        incoming = torch.empty_like(chunks[receive])
        ops = [dist.P2POp(dist.isend, chunks[send], (rank + 1) % world_size),
               dist.P2POp(dist.irecv, incoming, (rank - 1) % world_size)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _gather_by_batched_sends_and_receives(chunks, rank, world_size):  # right: the ring, by its own transfers
    import torch.distributed as dist

    for step in range(world_size - 1):
        send, receive = (rank - step) % world_size, (rank - 1 - step) % world_size
        incoming = torch.empty_like(chunks[receive])
        ops = [dist.P2POp(dist.isend, chunks[send], (rank + 1) % world_size),
               dist.P2POp(dist.irecv, incoming, (rank - 1) % world_size)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        chunks[receive].copy_(incoming)


def _gather_sending_copies(chunks, rank, world_size):  # right: a copy of the chunk carries the same numbers

    from dtlib.ring import send_recv

    for step in range(world_size - 1):
        send, receive = (rank - step) % world_size, (rank - 1 - step) % world_size
        incoming = torch.empty_like(chunks[receive])
        send_recv.ring_shift(chunks[send].clone(), incoming, rank, world_size)
        chunks[receive].copy_(incoming)


def _gather_kept_aside_then_written(chunks, rank, world_size):  # right: what arrives waits in a dict of its own

    from dtlib.ring import send_recv

    got = {rank: chunks[rank].clone()}
    for step in range(world_size - 1):
        send, receive = (rank - step) % world_size, (rank - 1 - step) % world_size
        incoming = torch.empty_like(chunks[receive])
        send_recv.ring_shift(got[send], incoming, rank, world_size)
        got[receive] = incoming
    for index, chunk in got.items():
        chunks[index].copy_(chunk)


def _scatter_into_a_copy_then_written(chunks, rank, world_size):  # right: partial sums in a list of clones

    from dtlib.ring import send_recv

    sums = [chunk.clone() for chunk in chunks]
    for step in range(world_size - 1):
        send, receive = (rank - 1 - step) % world_size, (rank - 2 - step) % world_size
        incoming = torch.empty_like(sums[receive])
        send_recv.ring_shift(sums[send], incoming, rank, world_size)
        sums[receive] += incoming
    for chunk, total in zip(chunks, sums, strict=True):
        chunk.copy_(total)


def _gather_by_data_assignment(chunks, rank, world_size):

    from dtlib.ring import send_recv

    for step in range(world_size - 1):  # wrong: .data = re-points the view; the buffer never sees what arrived
        send, receive = (rank - step) % world_size, (rank - 1 - step) % world_size
        incoming = torch.empty_like(chunks[receive])
        send_recv.ring_shift(chunks[send], incoming, rank, world_size)
        chunks[receive].data = incoming


def _gather_wrong_chunks_by_a_name_imported(chunks, rank, world_size):
    from dtlib.ring.send_recv import ring_shift  # a name of its own: the checker still sees each step

    for step in range(world_size - 1):  # wrong: sends rank + step, and the sizes meet wrong (gloo would abort)
        send, receive = (rank + step) % world_size, (rank - 1 - step) % world_size
        incoming = torch.empty_like(chunks[receive])
        ring_shift(chunks[send], incoming, rank, world_size)
        chunks[receive].copy_(incoming)


RING = [
    (_gather_kept_aside_then_written, "all_gather", True, ["all-gather phase works"]),
    (_scatter_into_a_copy_then_written, "reduce_scatter", True, ["reduce-scatter phase works"]),
    (_gather_by_data_assignment, "all_gather", False, ["chunks[i].data = ...", "never landed in the buffer"]),
    (_gather_wrong_chunks_by_a_name_imported, "all_gather", False, ["In ring step 2 of 3, rank 3 sent chunk 0 "
                                                                    "(3 elements) to rank 0"]),
    (_gather_sending_copies, "all_gather", True, ["all-gather phase works", "one ring_shift per step"]),
    (_gather_by_batched_sends_and_receives, "all_gather", True, ["with sends and receives of your own instead of "
                                                                 "ring_shift", "all-gather phase works"]),
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
              _gather_wrong_chunks_by_a_name_imported: 4,
              _junk_shifts_then_the_formula: 4, _gather_for_four_ranks: 4, _gather_twice: 4}
RING_HANGS = {_rank_0_skips_the_ring}  # judged hung once the timeout passes: a short one, as for sum_of_ranks


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("phase", "which", "ok", "fragments"), RING)
def test_ring_phase(phase, which, ok, fragments):
    feedback = checks.ring_phase(phase, which=which, world_size=RING_WORLD.get(phase, 3),
                                 timeout=3 if phase in RING_HANGS else 10)
    assert_verdict(feedback, ok, fragments)


def test_the_ring_bank_holds_many_kinds():
    assert sum(ok for _, _, ok, _ in RING) >= 3 and sum(not ok for _, _, ok, _ in RING) >= 8


def test_ring_phase_refuses_bad_arguments():
    assert "which must be" in checks.ring_phase(_gather_nothing, which="broadcast").message
    assert "function itself" in checks.ring_phase("my_phase").message
