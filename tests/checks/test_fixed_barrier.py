"""Notebook 08's machinery: the exercise's checker (dtlib.checks.fixed_barrier), against right and wrong answers,
and the reader of TORCH_DISTRIBUTED_DEBUG=DETAIL's mismatch errors (dtlib.errors.fingerprint_summary).

The pitfalls themselves are written and run in the notebook's cells, whose checked outputs the gate compares.
Rank functions defined here travel to the ranks by value (``register_pickle_by_value``), as a
notebook cell's functions do, so the ranks never import this module.
"""

from __future__ import annotations

import os
import sys
import time

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


def _sum_not_mean(rank, world_size, loss):
    dist.all_reduce(loss)
    return loss


def _mean_by_two(rank, world_size, loss):
    dist.all_reduce(loss)
    return (loss / 2).item()  # right on 2 ranks only


def _mean_by_reduce(rank, world_size, loss):
    dist.reduce(loss, dst=0)
    return loss.item() / world_size


def _sum_by_reduce(rank, world_size, loss):
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


def _raises(rank, world_size, loss):
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


RIGHT = [_mean_loss_as_numpy, _mean_loss_fixed, _mean_loss_dividing_first, _mean_loss_by_gathering,
         _mean_loss_with_a_count, _mean_loss_functional, _mean_loss_in_fixed_point]

#: (wrong answer, what the message must say): one of each kind
WRONG = [
    (_max_then_the_formula, ["all_reduce left the largest loss", "ReduceOp.MAX keeps the largest"]),
    (_throwaway_collective_then_the_formula, ["Rank 0 called dist.all_reduce, but on [1], not on its own loss"]),
    (_mean_by_two, ["With 3 ranks, rank 0 returned", "the sum divided by 2", "not a constant"]),
    (_mean_by_reduce, ["Rank 1 does not hold the result: dist.reduce leaves it on its dst alone, here rank 0"]),
    (_sum_by_reduce, ["Rank 1 does not hold the result", "here rank 0"]),
    (_mean_by_reduce_to_the_last, ["Rank 0 does not hold the result", "here rank 1"]),
    (_mean_without_wait, ["call .wait() on the work"]),
    (_sum_not_mean, ["returned the sum", "divide by world_size"]),
    (lambda rank, world_size, loss: loss.item(), ["Rank 0 returned its own loss"]),
    (_mean_of_rounded_losses, ["called dist.all_reduce, but on [", "not on its own loss"]),
    (lambda rank, world_size, loss: None, ["returned None"]),
    (lambda rank, world_size, loss: "1.5", ["returned '1.5': return the mean loss as one number"]),
    (_raises, ["rank 0 raised KeyError"]),
    (_mean_of_losses_rounded_to_4_decimals, ["expected the mean of the ranks' losses"]),
    ("mean_loss", ["Pass your function itself"]),
    (_mean_loss_in_a_big_buffer, ["rank 0's collectives sent 16,777,216 bytes to carry its input of 4 bytes"]),
    (_mean_loss_then_destroy, ["destroyed the process group"]),
    (_mean_loss_on_a_new_group, ["created 1 process group and left it"]),
    (_mean_loss_with_a_send_left_pending, ["Rank 0's dist.isend to rank 1 is never matched"]),
    (_mean_loss_of_a_strided_view, ["contiguous"]),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fn", RIGHT)
def test_checker_accepts_every_rank_calling_the_collective_written_differently(fn):
    feedback = fixed_barrier(fn)
    assert feedback.ok and "with 2 ranks and with 3" in feedback.message, feedback.message


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("fn", "fragments"), WRONG)
def test_checker_says_what_is_wrong(fn, fragments):
    feedback = fixed_barrier(fn)
    assert not feedback.ok and all(fragment in feedback.message for fragment in fragments), feedback.message
    assert "Traceback" not in feedback.message and "dtlib/" not in feedback.message


def test_the_bank_holds_many_kinds():
    assert len(RIGHT) >= 3 and len(WRONG) >= 8 and len({tuple(says) for _, says in WRONG}) == len(WRONG)


@pytest.mark.timeout(60)
def test_checker_reports_which_rank_hung_where():
    feedback = fixed_barrier(_mean_loss_buggy, timeout=3)
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
    feedback = fixed_barrier(_sleeps_on_rank_1, timeout=3)
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
def test_checker_names_the_ranks_that_returned_whatever_their_number(fn, world_size, fragment):
    feedback = fixed_barrier(fn, world_size=world_size, timeout=3)
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
