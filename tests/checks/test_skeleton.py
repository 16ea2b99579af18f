"""What every rank-function checker holds an answer to, whatever its exercise (dtlib.checks.skeleton.judge):
transfers that finish in the order NCCL runs them, and a job left as the answer found it.

Each principle is tested through ``sum_of_ranks``, the simplest checker, with a right answer beside the wrong
one: the principle lives in the skeleton, so every checker built on it inherits these verdicts. Oracle: NCCL's
documented rules (dtlib.launch.nccl_order) and the state torch reports after the answer (``dist.is_initialized``,
the groups that exist, works never waited for). Rank functions travel by value, as a notebook cell's do.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from torch.distributed import reduce

import dtlib
from dtlib import checks

cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: A hang is waited out in full, so its tests wait 3 s, as the other checkers' hang tests do: the timeout counts
#: from the moment every rank is ready to call the answer (dtlib.spawn), and from there both ranks of these hangs
#: were in place within 0.3 s in 40 runs of 40 beside eight busy loops on two cores (load 12).
HANG_S = 3


def _ring(rank, world_size, x, post):
    total, current, incoming = x.clone(), x.clone(), torch.empty_like(x)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    for _ in range(world_size - 1):
        post(current, incoming, right, left, rank)
        total += incoming
        current = incoming.clone()
    return total


def _isend_then_irecv(current, incoming, right, left, rank):
    sending, receiving = dist.isend(current, right), dist.irecv(incoming, left)
    sending.wait()
    receiving.wait()


def _batched(current, incoming, right, left, rank):
    ops = [dist.P2POp(dist.isend, current, right), dist.P2POp(dist.irecv, incoming, left)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _even_sends_first(current, incoming, right, left, rank):
    if rank % 2 == 0:
        dist.send(current, right)
        dist.recv(incoming, left)
    else:
        dist.recv(incoming, left)
        dist.send(current, right)


def _every_rank_sends_first(current, incoming, right, left, rank):
    dist.send(current, right)
    dist.recv(incoming, left)


def ring_unbatched(rank, world_size, x):
    return _ring(rank, world_size, x, _isend_then_irecv)


def ring_batched(rank, world_size, x):
    return _ring(rank, world_size, x, _batched)


def ring_even_odd(rank, world_size, x):
    return _ring(rank, world_size, x, _even_sends_first)


def ring_blocking(rank, world_size, x):
    return _ring(rank, world_size, x, _every_rank_sends_first)


@pytest.mark.parametrize("answer", [ring_batched, ring_even_odd])
def test_transfers_posted_together_or_in_meeting_order_pass(answer):
    feedback = checks.sum_of_ranks(answer, world_size=2)
    assert feedback.ok, feedback.message


def test_an_unbatched_ring_that_gloo_finishes_is_refused_for_nccl():
    feedback = checks.sum_of_ranks(ring_unbatched, world_size=2)
    assert not feedback.ok
    assert feedback.message.startswith("On NCCL these transfers hang: rank 0 waits in dist.isend to rank 1, "
                                       "rank 1 waits in dist.isend to rank 0."), feedback.message
    assert "dist.batch_isend_irecv" in feedback.message


def test_a_ring_of_blocking_sends_hangs_and_is_said_to_wait_in_its_transfers():
    feedback = checks.sum_of_ranks(ring_blocking, world_size=2, timeout=HANG_S)
    assert not feedback.ok
    assert feedback.message.startswith("It hung: rank 0 in dist.send, rank 1 in dist.send."), feedback.message
    assert "even ranks send first" in feedback.message


def _exchanged_in_halves(rank, world_size, x, receive_tags):
    """Every rank sends every other its x in two halves, tagged 1 and 2, and receives theirs with
    ``receive_tags``, in that order, all in one batch; then sums what it holds."""
    half, ops, parts = x.numel() // 2, [], []
    for peer in (peer for peer in range(world_size) if peer != rank):
        ops += [dist.P2POp(dist.isend, x[:half], peer, tag=1), dist.P2POp(dist.isend, x[half:], peer, tag=2)]
        theirs = {1: torch.empty_like(x[:half]), 2: torch.empty_like(x[half:])}
        ops += [dist.P2POp(dist.irecv, theirs[tag], peer, tag=tag) for tag in receive_tags]
        parts.append(theirs)
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return x + sum(torch.cat([theirs[1], theirs[2]]) for theirs in parts)


def halves_received_by_tag_in_reverse(rank, world_size, x):  # gloo pairs by tag: right there, wrong on NCCL
    return _exchanged_in_halves(rank, world_size, x, receive_tags=(2, 1))


def halves_received_in_the_order_sent(rank, world_size, x):  # the tags repeat the order: NCCL runs it right
    return _exchanged_in_halves(rank, world_size, x, receive_tags=(1, 2))


def test_an_answer_whose_tags_pair_other_messages_than_nccls_order_is_refused_and_told_why():
    """gloo pairs by tag, so the reversed answer gave right sums there; strict mode pairs as NCCL does, and the
    checker names the pair of transfers instead of the wrong sums that follow."""
    feedback = checks.sum_of_ranks(halves_received_by_tag_in_reverse, world_size=2)
    assert not feedback.ok
    said = ("Rank 0's 1st dist.batch_isend_irecv's isend to rank 1 has tag=1, and rank 1's 1st "
            "dist.batch_isend_irecv's irecv from rank 0 has tag=2. NCCL ignores tags")
    assert feedback.message.startswith(said), feedback.message
    assert checks.sum_of_ranks(halves_received_in_the_order_sent, world_size=2).ok


def _exchanged_unevenly(rank, world_size, x, receive_tags):
    """As :func:`_exchanged_in_halves`, cut after the first number instead of in the middle."""
    ops, parts = [], []
    for peer in (peer for peer in range(world_size) if peer != rank):
        ops += [dist.P2POp(dist.isend, x[:1], peer, tag=1), dist.P2POp(dist.isend, x[1:], peer, tag=2)]
        theirs = {1: torch.empty_like(x[:1]), 2: torch.empty_like(x[1:])}
        ops += [dist.P2POp(dist.irecv, theirs[tag], peer, tag=tag) for tag in receive_tags]
        parts.append(theirs)
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return x + sum(torch.cat([theirs[1], theirs[2]]) for theirs in parts)


def uneven_parts_received_by_tag_in_reverse(rank, world_size, x):  # NCCL's pairing meets 1 number with the rest
    return _exchanged_unevenly(rank, world_size, x, receive_tags=(2, 1))


def receives_one_number_short(rank, world_size, x):
    if rank == 0:
        dist.send(x, 1)
    elif rank == 1:
        dist.recv(x[1:].contiguous(), 0)
    dist.all_reduce(x)
    return x


@pytest.mark.parametrize("answer", [uneven_parts_received_by_tag_in_reverse, receives_one_number_short])
def test_a_send_that_meets_a_smaller_receive_is_named_as_such_not_as_gloos_abort(answer):
    """gloo aborts the receiving rank ("Is there a distributed collective mismatch in your code?"); the checker
    says that a send met a smaller receive, with the bytes of each, and that tags do not keep messages apart."""
    feedback = checks.sum_of_ranks(answer, world_size=2)  # no hang: the default timeout only bounds a broken run
    assert not feedback.ok
    assert re.match(r"Rank [01] was stopped by gloo: \d+ bytes arrived for a buffer of \d+\. The ranks' transfers "
                    r"did not pair up in size", feedback.message), feedback.message
    assert "whatever their tags" in feedback.message


def ring_that_unpacks_its_batch(rank, world_size, x):
    def post(current, incoming, right, left, rank):
        sending, receiving = dist.batch_isend_irecv([dist.P2POp(dist.isend, current, right),
                                                     dist.P2POp(dist.irecv, incoming, left)])
        sending.wait()
        receiving.wait()
    return _ring(rank, world_size, x, post)


def test_a_batch_unpacked_as_one_work_per_transfer_fails_as_on_nccl_and_is_told_why():
    """NCCL's batch_isend_irecv returns one work for the batch; gloo's, one per transfer: strict mode, NCCL's."""
    feedback = checks.sum_of_ranks(ring_that_unpacks_its_batch, world_size=2)
    assert not feedback.ok
    assert "not enough values to unpack (expected 2, got 1)" in feedback.message, feedback.message
    assert "NCCL returns one work for the whole batch" in feedback.message, feedback.message


def receives_into_a_larger_buffer(rank, world_size, x):
    """Right on gloo, which fills the start of the larger buffer; NCCL needs the counts to agree."""
    total = x.clone()
    for peer in range(world_size):
        if peer == rank:
            continue
        room = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
        ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, room, peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        total += room[: x.numel()]
    return total


def test_a_receive_larger_than_its_send_is_refused_though_gloo_gave_the_right_sums():
    inputs = [torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0])]
    sums = dtlib.spawn(receives_into_a_larger_buffer, 2, rank_args=inputs, output="none")
    assert [s.tolist() for s in sums] == [[11.0, 22.0]] * 2  # right on gloo, strict mode or not
    feedback = checks.sum_of_ranks(receives_into_a_larger_buffer, world_size=2)
    assert not feedback.ok
    assert feedback.message.startswith("Rank 0's 1st dist.batch_isend_irecv's isend to rank 1 sends "), feedback.message
    assert "NCCL needs both ends to agree in count and type" in feedback.message


def destroys_the_group(rank, world_size, x):
    dist.all_reduce(x)
    dist.destroy_process_group()
    return x


def adds_a_group(rank, world_size, x):
    dist.all_reduce(x, group=dist.new_group())
    return x


def never_waits_for_its_isend(rank, world_size, x):
    dist.all_reduce(x)
    if rank == 0:
        dist.isend(x.new_ones(1), 1)  # received, but its work never waited for
    elif rank == 1:
        dist.recv(x.new_empty(1), 0)
    return x


def never_waits_for_an_async_all_reduce(rank, world_size, x):
    spare = x.clone()
    dist.all_reduce(x)
    dist.all_reduce(spare, async_op=True)
    return x


def sends_to_nobody(rank, world_size, x):
    dist.all_reduce(x)
    if rank == 0:
        dist.isend(x.new_ones(1), 1)  # rank 1 receives nothing
    return x


@pytest.mark.parametrize(("answer", "said"), [
    (destroys_the_group, "Rank 0's function destroyed the process group (dist.destroy_process_group)."),
    (adds_a_group, "Rank 0's function created 1 process group and left it"),
    (never_waits_for_its_isend, "Rank 0 never waited for its dist.isend to rank 1"),
    (never_waits_for_an_async_all_reduce, "Rank 0 never waited for its dist.all_reduce(..., async_op=True)"),
    (sends_to_nobody, "Rank 0's dist.isend to rank 1 is never matched: rank 1 posts no receive for it."),
])
def test_an_answer_right_in_value_that_leaves_the_job_broken_is_refused(answer, said):
    feedback = checks.sum_of_ranks(answer, world_size=2)
    assert not feedback.ok
    assert feedback.message.startswith(said), feedback.message


def sums_inside_a_buffer_64_times_its_size(rank, world_size, x):
    buffer = torch.zeros(64 * x.numel(), dtype=x.dtype, device=x.device)
    buffer[: x.numel()] = x
    dist.all_reduce(buffer)
    return buffer[: x.numel()]


def sums_beside_a_count(rank, world_size, x):  # right: a few numbers beside the input cost a few bytes
    both = torch.cat([x, torch.ones(1, dtype=x.dtype, device=x.device)])
    dist.all_reduce(both)
    return both[:-1]


def test_collectives_send_at_most_a_stated_multiple_of_the_ranks_own_input():
    """skeleton.SENT_LIMIT: a buffer 64 times the input is refused, with the bytes it sent; a count beside the
    input passes."""
    feedback = checks.sum_of_ranks(sums_inside_a_buffer_64_times_its_size, world_size=2)
    assert not feedback.ok and "but rank 0's collectives sent" in feedback.message, feedback.message
    assert "64 times as much" in feedback.message, feedback.message
    assert checks.sum_of_ranks(sums_beside_a_count, world_size=2).ok


def sums_through_files(rank, world_size, x):
    import os
    import tempfile

    folder = os.path.join(tempfile.gettempdir(), f"dtlib-channel-{os.getppid()}")
    os.makedirs(folder, exist_ok=True)
    torch.save(x.cpu(), os.path.join(folder, f"{rank}.pt"))
    dist.all_reduce(torch.zeros(1, device=x.device))  # a barrier, the only collective: every file is written
    total = sum(torch.load(os.path.join(folder, f"{r}.pt")) for r in range(world_size))
    dist.all_reduce(x)  # a collective that carries x too, so that only the files tell
    return total.to(x.device)


def sums_and_writes_a_log(rank, world_size, x):  # right: a file written and read by its own rank is no channel
    import os
    import tempfile

    dist.all_reduce(x)
    log = os.path.join(tempfile.gettempdir(), f"dtlib-log-{os.getpid()}.txt")
    with open(log, "w") as out:
        out.write(f"rank {rank}: {x.tolist()}\n")
    with open(log) as back:
        back.read()
    os.remove(log)
    return x


def test_a_file_one_rank_writes_and_another_reads_is_no_channel():
    feedback = checks.sum_of_ranks(sums_through_files, world_size=2)
    assert not feedback.ok and "a file that rank" in feedback.message and "is not a channel" in feedback.message, \
        feedback.message
    assert checks.sum_of_ranks(sums_and_writes_a_log, world_size=2).ok


def one_all_reduce_more_on_rank_0(rank, world_size, x):
    dist.all_reduce(x)
    if rank == 0:
        dist.all_reduce(x.new_zeros(1))  # no other rank calls it
    return x


def test_a_collective_left_over_on_one_rank_is_named_in_the_answer_not_in_the_checker():
    # The checker's own all-reduce waits until every rank has returned, so it cannot pair with rank 0's extra one:
    # the hang is reported where the answer is, never in the checker's code.
    feedback = checks.sum_of_ranks(one_all_reduce_more_on_rank_0, world_size=2, timeout=HANG_S)
    assert not feedback.ok
    line = one_all_reduce_more_on_rank_0.__code__.co_firstlineno + 3
    assert feedback.message.startswith(f"It hung: rank 0 waited in all_reduce (line {line}, in "
                                       "one_all_reduce_more_on_rank_0), while rank 1 returned without calling it."), \
        feedback.message


def hunts_for_the_other_inputs(rank, world_size, x):
    """Sums every rank's input found in what the rank was sent (its frames' pickled bytes, its process's
    arguments), and all-reduces a copy of its own so that a collective carried its data."""
    import multiprocessing

    import cloudpickle as pickler

    dist.all_reduce(x.clone())
    sent = [value for value in multiprocessing.current_process()._args if isinstance(value, bytes)]
    frame = sys._getframe()
    while frame is not None:
        sent += [value for value in frame.f_locals.values() if isinstance(value, bytes)]
        frame = frame.f_back
    for payload in sent:
        try:
            _, args, _ = pickler.loads(payload)
        except Exception:  # noqa: BLE001, S112 - not a call's payload
            continue
        for value in args:
            if isinstance(value, list) and len(value) == world_size:
                return torch.stack([torch.as_tensor(given) for given in value]).sum(0).to(x.dtype)
    return x


def test_a_rank_is_sent_its_own_input_alone():
    feedback = checks.sum_of_ranks(hunts_for_the_other_inputs, world_size=2)
    assert not feedback.ok, feedback.message
    assert "made from its own input alone" in feedback.message, feedback.message  # it found no other input


def hands_data_through_the_store(rank, world_size, x):
    """Publishes its input in the process group's store and reads the others' there; all-reduces a copy of its
    own so that a collective carried its data."""
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    store.set(f"mine/{rank}", repr(x.tolist()))
    dist.all_reduce(x.clone())
    values = [eval(store.get(f"mine/{other}").decode()) for other in range(world_size)]  # noqa: S307
    return torch.tensor(values, dtype=x.dtype).sum(0)


def hands_data_through_the_store_and_tidies_up(rank, world_size, x):
    """The same channel, its keys deleted once every rank has read them: the store's count of keys is as before."""
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    dist.reduce(x.clone(), dst=0)  # a collective carried its data, and gave nobody else the sum
    store.set(f"mine/{rank}", repr(x.tolist()))
    store.wait([f"mine/{other}" for other in range(world_size)])
    values = [eval(store.get(f"mine/{other}").decode()) for other in range(world_size)]  # noqa: S307
    dist.barrier()
    store.delete_key(f"mine/{rank}")
    return torch.tensor(values, dtype=x.dtype).sum(0)


@pytest.mark.parametrize("answer", [hands_data_through_the_store, hands_data_through_the_store_and_tidies_up])
def test_the_store_is_not_a_channel(answer):
    feedback = checks.sum_of_ranks(answer, world_size=2)
    assert not feedback.ok
    assert feedback.message.startswith("The ranks' functions wrote to the process group's store (rank 0 wrote "
                                       "'mine/0'), even if they deleted it after."), feedback.message


# -- inputs that expose shortcuts (01's and 02's rank inputs) ------------------------------------------------------


def sum_rounded_to_4_decimals(rank, world_size, x):
    dist.all_reduce(x)
    return torch.round(x, decimals=4)


def sum_over_a_float16_wire(rank, world_size, x):
    y = x.half()
    dist.all_reduce(y)
    return y.float()


def sum_over_a_bfloat16_wire(rank, world_size, x):
    y = x.bfloat16()
    dist.all_reduce(y)
    return y.float()


def sum_in_float64(rank, world_size, x):
    y = x.double()
    dist.all_reduce(y)
    return y


@pytest.mark.parametrize(("answer", "said"), [
    (sum_rounded_to_4_decimals, "Digits were lost on the way"),
    (sum_over_a_float16_wire, "Rank 0's collectives carried float16"),
    (sum_over_a_bfloat16_wire, "Rank 0's collectives carried bfloat16"),
])
def test_digits_lost_on_the_way_show_at_the_small_slots(answer, said):
    feedback = checks.sum_of_ranks(answer, world_size=2)
    assert not feedback.ok
    assert "close, but not to float32's precision" in feedback.message and said in feedback.message, \
        feedback.message


def test_more_precision_than_asked_passes():
    feedback = checks.sum_of_ranks(sum_in_float64, world_size=2)
    assert feedback.ok, feedback.message


def mean_over_numel_minus_2(rank, world_size, values):
    dist.all_reduce(values)
    return values / (values.numel() - 2)


def test_a_length_tied_to_the_world_size_is_never_drawn_at_both_sizes():
    feedback = checks.average_of_ranks(mean_over_numel_minus_2, world_size=2)
    assert not feedback.ok and "holds the sum divided by" in feedback.message, feedback.message


@pytest.mark.parametrize("size", [2, 3, 4, 7])
def test_the_inputs_lengths_and_magnitudes(size):
    from dtlib.checks.rank_functions import _vectors

    generator = torch.Generator().manual_seed(size)
    offsets = set()
    for _ in range(20):
        here, there = _vectors(size, generator), _vectors(size + 1, generator)
        assert len(here) == size and all(x.dtype == torch.float32 for x in here)
        offsets.add((here[0].numel() - size) % 2 != (there[0].numel() - size - 1) % 2)
        magnitudes = here[0].abs().log10().floor()
        assert magnitudes.min() <= -1 and magnitudes.max() >= 1  # small slots and large ones in every draw
    assert offsets == {True}  # length - world_size never the same at both sizes


# -- strict mode reaches a collective imported by name -----------------------------------------------------------------


def reduce_imported_by_name(rank, world_size):
    x = torch.full((2,), float(rank + 1))
    reduce(x, dst=0)  # `from torch.distributed import reduce` in the cell: shipped by value, looked up by reference
    return x.tolist()


def test_a_collective_imported_by_name_is_held_to_nccls_contract_too():
    import dtlib

    root, other = dtlib.spawn(reduce_imported_by_name, 2, strict=True, timeout=60)
    assert root == [3.0, 3.0]
    assert all(value != value for value in other)  # NaN: NCCL leaves a reduce's other ranks undefined


@pytest.mark.parametrize(("world_size", "said"), [(1, "world_size must be >= 2, got 1"), (0, ">= 2, got 0"),
                                                  (2.5, "must be a whole number"), ("2", "must be a finite number")])
def test_a_world_size_no_collective_can_be_judged_on_is_a_clear_error(world_size, said):
    with pytest.raises(ValueError, match=said):
        checks.sum_of_ranks(sums_beside_a_count, world_size=world_size)
    with pytest.raises(ValueError, match="a collective needs two ranks"):
        checks.fixed_barrier(sums_beside_a_count, world_size=world_size)


# --- the skeleton every rank-function exercise shares ----------------------------------------------------------


def _world_size_everywhere(rank, world_size):
    import torch.distributed as dist

    import dtlib

    size = torch.tensor(1.0, device=dtlib.rank_device())
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


def test_a_rank_that_unpickles_the_skeletons_rank_function_loads_no_checker():
    """Every rank of every check imports ``dtlib.checks`` to unpickle the skeleton's rank function. The package
    loads each checker on first use, so the rank loads the skeleton alone: not every checker, with the predictions'
    measurements, FSDP's runner and DCP behind them (about 0.15 s of CPU in each rank of every check when it did).
    The checkers themselves are all there for whoever asks for one."""
    loaded = set(json.loads(subprocess.run(
        [sys.executable, "-c", "import json, sys, dtlib.checks.skeleton; print(json.dumps(sorted(sys.modules)))"],
        capture_output=True, text=True, check=True, timeout=120).stdout))
    checkers = {f"dtlib.checks.{module}" for module in checks._HOMES.values()} - {"dtlib.checks.feedback"}
    assert not loaded & checkers, sorted(loaded & checkers)
    assert "torch.distributed.checkpoint" not in loaded
    assert all(callable(getattr(checks, name)) for name in checks.__all__) and set(checks.__all__) <= set(dir(checks))
