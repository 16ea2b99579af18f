"""dtlib.checks.rank_functions: a function every rank runs, judged by its result and its collectives. The sum
(notebook 01) and the average (02) of the ranks' values and the mean loss of 08, each against right answers
written differently and one of each kind of wrong answer; the numbers a message shows.

Rank functions defined here travel to the ranks by value (``register_pickle_by_value``), as a notebook cell's
functions do, so the ranks never import this module (or pytest). Each checker runs on the fewest ranks that give
the verdict a test asserts: 2 (and the one more every checker adds) unless the message names a larger world.
"""

from __future__ import annotations

import sys
import time

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from verdicts import assert_verdict

from dtlib import checks
from dtlib.checks import rank_functions
from dtlib.checks.rank_functions import _contrast
from dtlib.measure.counting import rank_without_communication, spawn_counting
from dtlib.ring import send_recv

cloudpickle.register_pickle_by_value(sys.modules[__name__])


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


def _sum_gathered_single_rounded_first(rank, world_size, x):  # the one-tensor all-gather of 2.13's name
    every = x.new_empty(world_size * x.numel())
    dist.all_gather_single(every, x.round())
    return every.view(world_size, -1).sum(0)


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


def _sum_right_by_a_stacked_gather(rank, world_size, x):  # right: torch documents the stacked output, NCCL takes it
    out = torch.empty(world_size, x.numel(), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x)
    return out.sum(0)


def _sum_right_polled_until_completed(rank, world_size, x):  # right, if unusual: a completed work's result is there
    work = dist.all_reduce(x, async_op=True)
    while not work.is_completed():
        pass
    return x


def _sum_by_the_groups_own_method_unwaited(rank, world_size, x):
    dist.group.WORLD.allreduce([x])  # a ProcessGroup's method is async: x is NCCL's to write until wait()
    return x


def _sum_of_all_but_the_last(rank, world_size, x):
    dist.all_reduce(x[:-1])  # a view: the rest of x stays this rank's own
    return x


def _sum_by_min(rank, world_size, x):
    dist.all_reduce(x, op=dist.ReduceOp.MIN)
    return x


def _sum_in_fixed_point(rank, world_size, x):  # three decimals kept, the rest cut
    fixed = (x * 1000).long()
    dist.all_reduce(fixed)
    return fixed.float() / 1000


def _average_into_a_temporary(rank, world_size, values):
    dist.all_reduce(values / world_size)  # the result goes into the quotient, a new tensor thrown away
    return values / world_size


def _mean_loss_into_a_temporary(rank, world_size, loss):
    dist.all_reduce(loss / world_size)
    return loss.item()


def _mean_loss_rounded_after_the_sum(rank, world_size, loss):
    mean = loss / world_size
    dist.all_reduce(mean)
    return round(mean.item(), 2)  # the right number, rounded for a log: not a tensor dropped


def _mean_loss_by_min(rank, world_size, loss):
    dist.all_reduce(loss, op=dist.ReduceOp.MIN)
    return loss.item()


def _mean_loss_in_bfloat16(rank, world_size, loss):
    low = loss.to(torch.bfloat16)
    dist.all_reduce(low)
    return low.float().item() / world_size


def _sum_right_by_gathering_objects(rank, world_size, x):  # right: the numbers travel pickled, on NCCL too
    everyone = [None] * world_size
    dist.all_gather_object(everyone, x.tolist())
    return torch.tensor(everyone).sum(0)


def _mean_loss_by_gathering_objects(rank, world_size, loss):
    everyone = [None] * world_size
    dist.all_gather_object(everyone, loss.item())
    return sum(everyone) / world_size


SUM_RIGHT = [_sum_right, _sum_right_as_a_list, _sum_right_by_gathering, _sum_right_by_reduce_and_broadcast,
             _sum_right_in_halves, _sum_right_by_an_unwaited_functional_call, _sum_right_by_a_stacked_gather,
             _sum_right_polled_until_completed, _sum_right_by_gathering_objects]

#: (wrong answer, what the message must say): one of each kind
SUM_WRONG = [
    (_sum_throwaway_collective_then_closed_form, ["called dist.all_reduce, but on [0], not on its own x"]),
    (lambda rank, world_size, x: x, ["it returned its own x: was dist.all_reduce called"]),
    (_sum_functional_result_unused, ["called the functional all_reduce", "Use what it returns"]),
    (_sum_reading_the_checkers_frames, ["it returned its own x"]),  # the other ranks' inputs are out of reach
    (_sum_by_reduce, ["does not hold the result: dist.reduce leaves it on its dst alone, here rank 0"]),
    (_sum_async_without_wait, ["call .wait()"]),
    (_sum_by_the_groups_own_method_unwaited, ["holds NaN", "call .wait()"]),
    (_sum_hard_coded_world_size, ["With 4 ranks", "it holds 3/4 of the sum: a fixed 3"]),
    (_sum_by_max, ["the largest value of each slot: ReduceOp.MAX"]),
    (_sum_by_min, ["called dist.all_reduce with ReduceOp.MIN, which leaves the smallest", "ReduceOp.SUM"]),
    (_sum_of_all_but_the_last, ["called dist.all_reduce on part of its x", "the others never left the rank"]),
    (_sum_in_fixed_point, ["carried int64, which holds whole numbers only"]),
    (_sum_double_counted, ["world_size times too big"]),
    (_sum_of_the_elements, ["it returned one number, the total of x's", "not x.sum()"]),
    (_sum_in_half_precision, ["it computed in float16"]),
    (_sum_rounded_first, ["called dist.all_reduce on its x rounded to whole numbers"]),
    (_sum_gathered_single_rounded_first, ["called dist.all_gather_single on its x rounded to whole numbers"]),
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
    assert_verdict(checks.sum_of_ranks(fn, world_size=2), True, ["with 2 ranks and with 3"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("fn", "fragments"), SUM_WRONG)
def test_sum_of_ranks_names_each_kind_of_wrong_answer(fn, fragments):
    assert_verdict(checks.sum_of_ranks(fn, world_size=SUM_WORLD.get(fn, 2)), False, fragments)


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
    # The ranks must reach the barrier before the timeout for the message to name it. 3 s once missed at load 10,
    # when the timeout still counted the ranks' start; it counts from the moment every rank is ready now, and they
    # reached it within 0.3 s in 15 runs of 15 beside eight busy loops on two cores (load 12).
    assert_verdict(checks.sum_of_ranks(_hangs, world_size=2, timeout=3), False, ["hung", "barrier"])


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
    def starting_values(r):  # notebook 02's values, 10 r + i, with a half that keeps the mean off whole numbers
        return torch.arange(world_size, dtype=torch.float32) + 10 * r + 0.5

    dist.all_reduce(torch.ones(1, device=values.device))  # a collective, on a tensor that is not values
    return torch.stack([starting_values(r) for r in range(world_size)]).mean(0)


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
    (_average_into_a_temporary, ["computed the right numbers", "into a tensor your function did not return"]),
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
    assert_verdict(checks.average_of_ranks(fn, world_size=2), True, ["holds the mean", "with 2 ranks and with 3"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("fn", "fragments"), AVERAGE_WRONG)
def test_average_of_ranks_names_each_kind_of_wrong_answer(fn, fragments):
    assert_verdict(checks.average_of_ranks(fn, world_size=AVERAGE_WORLD.get(fn, 2)), False, fragments)


def test_the_rank_exercise_banks_hold_many_kinds():
    for right, wrong in ((SUM_RIGHT, SUM_WRONG), (AVERAGE_RIGHT, AVERAGE_WRONG)):
        assert len(right) >= 3 and len(wrong) >= 8
        assert len({tuple(says) for _, says in wrong}) == len(wrong)


@pytest.mark.timeout(60)
def test_average_with_reduce_op_avg_is_right_where_gloo_has_it_and_explained_where_not():
    feedback = checks.average_of_ranks(_average_with_avg, world_size=2)
    assert feedback.ok or "no ReduceOp.AVG" in feedback.message, feedback.message




# -- notebook 08: the mean loss, every rank in the collective ----------------------------------------


def _mean_loss_fixed(rank, world_size, loss):
    dist.all_reduce(loss)
    return (loss / world_size).item()


def _mean_loss_buggy(rank, world_size, loss):
    loss = loss.clone()
    if rank == 0:
        dist.all_reduce(loss)
        loss /= world_size
    return loss.item()


def _mean_loss_dividing_first(rank, world_size, loss):
    share = loss / world_size
    dist.all_reduce(share, op=dist.ReduceOp.SUM)
    if rank == 0:
        print("mean loss:", share.item())
    return share  # a one-element tensor is a number too


def _mean_loss_by_gathering(rank, world_size, loss):
    losses = [torch.empty_like(loss) for _ in range(world_size)]
    dist.all_gather(losses, loss)
    return torch.stack(losses).mean().item()


def _max_then_the_formula(rank, world_size, loss):
    dist.all_reduce(loss, op=dist.ReduceOp.MAX)  # the largest loss, world_size when losses are rank + 1
    return (loss.item() + 1) / 2  # (1 + world_size) / 2: a formula for losses 1, 2, ..., world_size


def _throwaway_collective_then_the_formula(rank, world_size, loss):
    dist.all_reduce(torch.tensor(float(rank + 1), device=loss.device))
    return (world_size + 1) / 2


def _loss_sum_not_mean(rank, world_size, loss):
    dist.all_reduce(loss)
    return loss


def _mean_by_two(rank, world_size, loss):
    dist.all_reduce(loss)
    return (loss / 2).item()  # right on 2 ranks only


def _mean_by_reduce(rank, world_size, loss):
    dist.reduce(loss, dst=0)
    return loss.item() / world_size


def _loss_sum_by_reduce(rank, world_size, loss):
    dist.reduce(loss, dst=0)  # rank 0, the dst, holds the sum; the others nothing defined
    return loss.item()


def _mean_by_reduce_to_the_last(rank, world_size, loss):
    dist.reduce(loss, dst=world_size - 1)
    return loss.item() / world_size


def _mean_without_wait(rank, world_size, loss):
    dist.all_reduce(loss, async_op=True)  # never waited for
    return loss.item() / world_size


def _mean_of_rounded_losses(rank, world_size, loss):
    rounded = torch.tensor(round(loss.item(), 1), device=loss.device)  # to one decimal, "for the log"
    dist.all_reduce(rounded)
    return rounded.item() / world_size


def _mean_of_losses_rounded_to_4_decimals(rank, world_size, loss):
    dist.all_reduce(loss)
    return round(loss.item() / world_size, 4)  # "for the log"


def _loss_raises(rank, world_size, loss):
    raise KeyError("loss")


def _every_rank_waits_to_receive(rank, world_size, loss):
    dist.recv(loss, src=(rank + 1) % world_size)  # nobody sends: every rank waits
    return loss.item()


def _mean_loss_with_a_count(rank, world_size, loss):  # right: the loss and a count summed together
    both = torch.stack([loss, torch.ones_like(loss)])
    dist.all_reduce(both)
    return (both[0] / both[1]).item()


def _mean_loss_functional(rank, world_size, loss):  # right: a functional all-reduce
    from torch.distributed import _functional_collectives as funcol

    return (funcol.wait_tensor(funcol.all_reduce(loss, "sum", dist.group.WORLD)) / world_size).item()


def _mean_loss_as_numpy(rank, world_size, loss):  # right: a numpy float32
    dist.all_reduce(loss)
    return (loss / world_size).cpu().numpy()


def _mean_loss_in_fixed_point(rank, world_size, loss):  # right: the loss carried as a whole number of micro-units
    fixed = (loss.double() * 10**6).round().long()
    dist.all_reduce(fixed)
    return fixed.item() / 10**6 / world_size


def _mean_loss_in_a_big_buffer(rank, world_size, loss):
    buffer = torch.zeros(4 * 2**20, device=loss.device)  # 16 MB to carry one number
    buffer[0] = loss
    dist.all_reduce(buffer)
    return buffer[0].item() / world_size


def _mean_loss_then_destroy(rank, world_size, loss):
    dist.all_reduce(loss)
    dist.destroy_process_group()  # "clean up"
    return loss.item() / world_size


def _mean_loss_on_a_new_group(rank, world_size, loss):
    group = dist.new_group()  # a new group on every call
    dist.all_reduce(loss, group=group)
    return loss.item() / world_size


def _mean_loss_with_a_send_left_pending(rank, world_size, loss):
    dist.isend(loss.clone(), dst=(rank + 1) % world_size)  # nobody receives it, nobody waits for it
    dist.all_reduce(loss)
    return loss.item() / world_size


def _mean_loss_of_a_strided_view(rank, world_size, loss):
    both = torch.stack([loss, torch.ones_like(loss)]).repeat(2)[::2]  # [loss, loss], every other element
    dist.all_reduce(both)
    return both[0].item() / world_size


BARRIER_RIGHT = [_mean_loss_as_numpy, _mean_loss_fixed, _mean_loss_dividing_first, _mean_loss_by_gathering,
         _mean_loss_with_a_count, _mean_loss_functional, _mean_loss_in_fixed_point, _mean_loss_by_gathering_objects]

#: (wrong answer, what the message must say): one of each kind
BARRIER_WRONG = [
    (_max_then_the_formula, ["all_reduce left the largest loss", "ReduceOp.MAX keeps the largest"]),
    (_mean_loss_into_a_temporary, ["computed the right numbers", "into a tensor your function did not return"]),
    (_mean_loss_by_min, ["with ReduceOp.MIN, which leaves the smallest of the ranks' values"]),
    (_mean_loss_rounded_after_the_sum, ["Digits were lost on the way", "close, but not"]),
    (_mean_loss_in_bfloat16, ["carried bfloat16, which keeps about 2", "not to float32's precision"]),
    (_throwaway_collective_then_the_formula, ["Rank 0 called dist.all_reduce, but on [1], not on its own loss"]),
    (_mean_by_two, ["With 3 ranks, rank 0 returned", "the sum divided by 2", "not a constant"]),
    (_mean_by_reduce, ["Rank 1 does not hold the result: dist.reduce leaves it on its dst alone, here rank 0"]),
    (_loss_sum_by_reduce, ["Rank 1 does not hold the result", "here rank 0"]),
    (_mean_by_reduce_to_the_last, ["Rank 0 does not hold the result", "here rank 1"]),
    (_mean_without_wait, ["call .wait() on the work"]),
    (_loss_sum_not_mean, ["returned the sum", "divide by world_size"]),
    (lambda rank, world_size, loss: loss.item(), ["Rank 0 returned its own loss"]),
    (_mean_of_rounded_losses, ["called dist.all_reduce, but on [", "not on its own loss"]),
    (lambda rank, world_size, loss: None, ["returned None"]),
    (lambda rank, world_size, loss: "1.5", ["returned '1.5': return the mean loss as one number"]),
    (_loss_raises, ["rank 0 raised KeyError"]),
    (_mean_of_losses_rounded_to_4_decimals, ["the mean of the ranks' losses is", "not to float32's precision"]),
    ("mean_loss", ["Pass your function itself"]),
    (_mean_loss_in_a_big_buffer, ["rank 0's collectives sent 16,777,216 bytes to carry its input of 4 bytes"]),
    (_mean_loss_then_destroy, ["destroyed the process group"]),
    (_mean_loss_on_a_new_group, ["created 1 process group and left it"]),
    (_mean_loss_with_a_send_left_pending, ["Rank 0's dist.isend to rank 1 is never matched"]),
    (_mean_loss_of_a_strided_view, ["contiguous"]),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fn", BARRIER_RIGHT)
def test_fixed_barrier_accepts_every_rank_calling_the_collective_written_differently(fn):
    feedback = checks.fixed_barrier(fn)
    assert feedback.ok and "with 2 ranks and with 3" in feedback.message, feedback.message


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("fn", "fragments"), BARRIER_WRONG)
def test_fixed_barrier_says_what_is_wrong(fn, fragments):
    feedback = checks.fixed_barrier(fn)
    assert not feedback.ok and all(fragment in feedback.message for fragment in fragments), feedback.message
    assert "Traceback" not in feedback.message and "dtlib/" not in feedback.message


def test_the_barrier_bank_holds_many_kinds():
    assert len(BARRIER_RIGHT) >= 3 and len(BARRIER_WRONG) >= 8
    assert len({tuple(says) for _, says in BARRIER_WRONG}) == len(BARRIER_WRONG)


@pytest.mark.timeout(60)
def test_fixed_barrier_reports_which_rank_hung_where():
    feedback = checks.fixed_barrier(_mean_loss_buggy, timeout=3)
    assert not feedback.ok
    line = _mean_loss_buggy.__code__.co_firstlineno + 3  # the dist.all_reduce line
    assert f"rank 0 waited in all_reduce (line {line}, in _mean_loss_buggy)" in feedback.message, feedback.message
    assert "while rank 1 returned without calling it" in feedback.message, feedback.message


def _sleeps_on_rank_1(rank, world_size, loss):
    if rank == 1:
        time.sleep(60)  # a slow rank, in no collective
    dist.all_reduce(loss)
    return loss.item() / world_size


@pytest.mark.timeout(60)
def test_a_rank_that_sleeps_is_not_said_to_wait_in_a_collective():
    feedback = checks.fixed_barrier(_sleeps_on_rank_1, timeout=3)
    line = _sleeps_on_rank_1.__code__.co_firstlineno
    assert f"rank 0 waited in all_reduce (line {line + 3}, in _sleeps_on_rank_1)" in feedback.message, feedback.message
    assert f"rank 1 was still running line {line + 2} of _sleeps_on_rank_1, in no collective" in feedback.message


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("fn", "world_size", "fragment"),
    [
        (_mean_loss_buggy, 3, "while ranks 1 and 2 returned without calling it"),
        (_every_rank_waits_to_receive, 2, "rank 1 waited in recv"),
        (_every_rank_waits_to_receive, 2, "and no rank returned: each waited for a call that no other rank made"),
    ],
)
def test_fixed_barrier_names_the_ranks_that_returned_whatever_their_number(fn, world_size, fragment):
    feedback = checks.fixed_barrier(fn, world_size=world_size, timeout=3)
    assert not feedback.ok and fragment in feedback.message, feedback.message
    assert "rank(s)" not in feedback.message and "none" not in feedback.message


def test_a_stand_in_that_equals_one_ranks_rounded_loss_is_not_called_rounding():
    """CI once drew rank 0's loss as 1.42: its stand-in 1.0 equalled the loss rounded, and the message said the
    learner rounded the loss. Rounding is named only when every rank sent its own input rounded."""
    from dtlib.checks.rank_functions import _rounded_everywhere
    from dtlib.checks.skeleton import Answer, Carried

    def answer(sent: list[float], losses: list[float]) -> Answer:
        carried = [[Carried("all_reduce", torch.tensor([s], dtype=torch.float64), torch.tensor([sum(sent)]))]
                   for s in sent]
        return Answer(rank=0, size=2, world_size=2, returned=1.5, value=1.5, expected=2.0, values=[1.5, 1.5],
                      calls=[{"all_reduce": 1}] * 2, inputs=[torch.tensor(x) for x in losses], carried=carried)

    assert not _rounded_everywhere(answer([1.0, 2.0], [1.42, 3.71]))  # rank + 1: rank 0's only by chance
    assert not _rounded_everywhere(answer([1.0, 2.0], [1.42, 1.71]))  # every rank's by chance: a scalar can't tell
    assert not _rounded_everywhere(answer([2.0, 4.0], [2.0, 4.0]))  # whole already: nothing was rounded


# -- the numbers a message shows -------------------------------------------------------------



def test_two_values_are_shown_where_they_first_differ_with_the_digits_that_differ():
    assert _contrast([1.0, 2.0, 3.00001], [1.0, 2.0, 3.0]) == ("[1, 2, 3.00001]", "[1, 2, 3]")
    got, want = _contrast([21.981, 24.33, 26.1, 28.5, 30.12, 31.0], [21.981, 24.33, 26.1, 28.5, 30.121, 31.0])
    assert got == "[..., 30.12, 31] (from index 4)" and want == "[..., 30.121, 31] (from index 4)"
    assert _contrast([float("nan")] * 2, [1.0, 2.0]) == ("[nan, nan]", "[1, 2]")
    assert _contrast("not numbers", [1.0]) == ("'not numbers'", "[1]")


def _sum_rounded(rank, world_size, x):
    dist.all_reduce(x)
    return torch.round(x, decimals=2)


@pytest.mark.timeout(120)
def test_a_sum_rounded_to_two_decimals_is_refused_with_the_digits_that_differ():
    """The message once read "returned [21.98, 24.33, ...], expected [21.98, 24.33, ...]": the same numbers."""
    feedback = rank_functions.sum_of_ranks(_sum_rounded)
    assert not feedback.ok
    assert "close, but not to float32's precision" in feedback.message, feedback.message
    returned = feedback.message.split(" returned ", 1)[1].split(", and the sum is", 1)[0]
    expected = feedback.message.split("and the sum is ", 1)[1].split(": close", 1)[0]
    assert returned != expected, feedback.message


def test_a_hang_message_says_where_each_rank_was_and_never_blames_a_rank_outside_the_answer():
    """From the ranks' stacks (most recent call first): a rank in a collective waited there; a rank in its own code
    (time.sleep) was running it, in no collective; ranks all past the answer were slow, not stuck."""
    from dtlib.checks.skeleton import same_collectives_hang
    from dtlib.errors import WorkerTimeout

    in_all_reduce = ('File "/x/torch/distributed/distributed_c10d.py", line 2800 in all_reduce\n'
                     'File "<cell>", line 4 in fn')
    sleeping = 'File "<cell>", line 3 in fn'
    recording = 'File "/x/dtlib/checks/skeleton.py", line 200 in _recorded'
    said = same_collectives_hang(WorkerTimeout(5, {0: in_all_reduce, 1: sleeping}, []), "fn")
    assert "rank 0 waited in all_reduce (line 4, in fn); rank 1 was still running line 3 of fn, in no collective" \
        in said, said
    said = same_collectives_hang(WorkerTimeout(5, {0: recording}, [1]), "fn")
    assert said.startswith("It did not finish within the checker's 5 s, but no rank was waiting: rank 0 was "
                           "outside"), said
    assert "same collectives" not in said


# -- answers a checker cannot run as they are ---------------------------------------------------


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
    assert_verdict(feedback, False, ["cannot be sent to the ranks: it uses the global lock (lock)",
                                      "pass it as an argument, or create it inside the function"])
    assert "args[0]" not in feedback.message


def test_a_rank_that_exits_is_named_not_the_gloo_error_of_the_rank_it_left():
    answer = _cell("def leaves(rank, world_size, values):\n    import os\n    if rank == 1:\n        os._exit(3)\n"
                   "    dist.all_reduce(values)\n    return values / world_size\n")
    assert_verdict(checks.average_of_ranks(answer, world_size=2), False,
                    ["A rank left your function before the end (rank 1 exited with code 3"])


def test_a_divisor_is_recognised_through_float32s_rounding_in_every_draw():
    """Busy gate 2 of stop 59 drew inputs where dividing the float32 sum by 3 twice gave a factor 1/9 whose divisor
    was 9 to 1.2e-6 only, and the 'divided twice' hint missed (19 of 3,000 draws did). The oracle: the answer's own
    arithmetic in float32, over 3,000 draws of the checker's inputs."""
    from dtlib.checks._numbers import constant_factor
    from dtlib.checks.rank_functions import FACTOR_RTOL, _vectors

    for seed in range(3000):
        values = _vectors(3, torch.Generator().manual_seed(seed))
        total = values[0] + values[1] + values[2]  # gloo sums in float32
        divisor = 1 / constant_factor(total / 3 / 3, torch.stack([v.double() for v in values]).sum(0))
        assert abs(divisor - 9) <= FACTOR_RTOL * 9, (seed, divisor)


@pytest.mark.timeout(120)
def test_a_mean_rounded_for_the_log_is_never_called_a_constant_divisor():
    """The mean divided by world_size itself is the mean: a loss rounded to 4 decimals must not be told to divide
    by world_size 'not a constant'. With a divisor recognised to 1e-5, 5 of 10 draws were (stop 59, busy gate 3);
    the hint now asks for a divisor other than world_size. Eight fixed draws, each at 2 and 3 ranks."""
    for seed in range(8):
        feedback = checks.fixed_barrier(_mean_of_losses_rounded_to_4_decimals, seed=seed)
        assert_verdict(feedback, False, ["the mean of the ranks' losses is", "not to float32's precision"])
