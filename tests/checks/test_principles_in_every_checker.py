"""The skeleton's job principles hold in every rank-function checker, not only in ``sum_of_ranks``.

``test_skeleton.py`` tests each principle through the simplest checker. Here each notebook's own model
answer (caught from its solution cell, as ``test_model_answers_at_more_sizes`` does) is broken in one of two ways
that leave its values right: it destroys the default process group when it is done, or it creates a process
group and leaves it. Every checker must refuse both, since the job goes on after the answer returns. A group left
is named by every checker. A destroyed group is named where the answer is the rank's whole function; where the
checker goes on using the group (a hook, a wrap, a layer trained after it returns), the failure that follows is
the verdict. Oracle: the
model answers pass (``test_model_answers_at_more_sizes``), and torch says which groups exist after the answer.

A fourth break all-reduces a tensor made without ``device=`` before the answer runs: right on gloo, refused by NCCL
on a GPU machine, where the tensor sits in host memory. Every checker must refuse it, naming the call.

A third break leaves the job clean but computes, on the last rank, from something other than that rank's own
input (the input plus one): every checker whose ranks each get an input of their own must refuse it, so no
checker's oracle can be blind to one rank's input, and neither can an answer that passes it.
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch.distributed as dist
from test_model_answers_at_more_sizes import LARGER, _caught_answer

from dtlib import checks

cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: The checkers whose own code runs no collective after the answer returns (the answer is the rank's whole function,
#: or 03's phase, the ring's last): the skeleton's own message is the verdict.
WHOLE_FUNCTION = {"sum_of_ranks", "average_of_ranks", "fixed_barrier", "tensor_parallel_mlp", "ring_phase"}


def _then_destroyed(answer):
    def answered(*args, **kwargs):
        result = answer(*args, **kwargs)
        dist.destroy_process_group()
        return result
    return answered


def _with_a_group_left(answer):
    def answered(*args, **kwargs):
        dist.new_group(list(range(dist.get_world_size())))
        return answer(*args, **kwargs)
    return answered


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("breaks", "says"), [(_then_destroyed, "destroyed the process group"),
                                              (_with_a_group_left, "dist.new_group")])
@pytest.mark.parametrize(("notebook", "checker"), [(name, checker) for name, (checker, _) in sorted(LARGER.items())])
def test_every_checker_refuses_a_right_answer_that_leaves_the_job_broken(notebook, checker, breaks, says):
    answer, keywords = _caught_answer(notebook, checker)
    feedback = getattr(checks, checker)(breaks(answer), **keywords)
    assert not feedback.ok, f"{notebook}'s answer, {breaks.__name__}: {feedback.message}"
    if checker in WHOLE_FUNCTION or breaks is _with_a_group_left:  # a group left is seen whoever called the answer
        assert says in feedback.message, feedback.message
    else:  # the checker's own use of the destroyed group fails, and the verdict says who destroyed it
        assert "Your code destroyed the process group" in feedback.message, feedback.message


def _blind_to_the_last_ranks_input(checker, answer):
    """The model answer, computing on the last rank from something other than that rank's own input (its input
    plus one), as an answer blind to one rank's input, or one that swapped it for a stand-in, would: the checker's
    oracle must depend on every rank's input."""
    import torch

    def last():
        return dist.get_rank() == dist.get_world_size() - 1

    if checker == "gradient_hook":
        return lambda grad: answer(grad + 1 if last() else grad)
    if checker == "expert_parallel_moe":
        return lambda x, router, experts, top_k, group: answer(x + 1 if last() else x, router, experts, top_k, group)
    if checker == "fsdp_wrap":
        def wrap(model, mesh):
            vocab = model.embed.num_embeddings
            if last():  # the tokens shifted by one, on this rank's model only (DDP's beside it sees them as sent)
                model.register_forward_pre_hook(lambda module, args: ((args[0] + 1) % vocab, *args[1:]))
            return answer(model, mesh)
        return wrap
    return lambda rank, world_size, given: answer(rank, world_size, given + torch.ones_like(given) if last() else given)


#: Every rank is handed the same inputs in 09 (the MLP's x and weights): no rank has an input of its own to ignore.
OWN_INPUTS = sorted((name, checker) for name, (checker, _) in LARGER.items() if checker != "tensor_parallel_mlp")


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("notebook", "checker"), OWN_INPUTS)
def test_every_checker_refuses_an_answer_blind_to_one_ranks_input(notebook, checker):
    answer, keywords = _caught_answer(notebook, checker)
    feedback = getattr(checks, checker)(_blind_to_the_last_ranks_input(checker, answer), **keywords)
    assert not feedback.ok, f"{notebook}'s answer, blind to the last rank's input: {feedback.message}"


def _with_a_host_tensor_sent(answer):
    """The model answer, after one extra all-reduce on every rank of a tensor made without ``device=``: right on
    gloo, refused by NCCL on a GPU machine, where that tensor sits in host memory."""
    def answered(*args, **kwargs):
        import torch

        dist.all_reduce(torch.zeros(1))
        return answer(*args, **kwargs)
    return answered


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("notebook", "checker"), [(name, checker) for name, (checker, _) in sorted(LARGER.items())])
def test_every_checker_refuses_a_collective_on_a_tensor_a_gpu_machine_holds_on_the_host(notebook, checker):
    """NCCL's device rule (dtlib.launch.host_tensors), on a machine without a GPU: every checker runs its answer
    watched, so a tensor made without device= is refused when sent, naming the call that made it."""
    answer, keywords = _caught_answer(notebook, checker)
    feedback = getattr(checks, checker)(_with_a_host_tensor_sent(answer), **keywords)
    assert not feedback.ok, f"{notebook}'s answer with a host tensor all-reduced: {feedback.message}"
    assert "made by torch.zeros without device=" in feedback.message, feedback.message
