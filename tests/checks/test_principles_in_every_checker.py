"""The skeleton's job principles hold in every rank-function checker, not only in ``sum_of_ranks``.

``test_skeleton.py`` tests each principle through the simplest checker. Here each notebook's own model
answer (caught from its solution cell, as ``test_model_answers_at_more_sizes`` does) is broken in one of two ways
that leave its values right: it destroys the default process group when it is done, or it creates a process
group and leaves it. Every checker must refuse both, since the job goes on after the answer returns. A group left
is named by every checker. A destroyed group is named where the answer is the rank's whole function; where the
checker goes on using the group (a hook, a wrap, a layer trained after it returns), the failure that follows is
the verdict. Oracle: the
model answers pass (``test_model_answers_at_more_sizes``), and torch says which groups exist after the answer.
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch.distributed as dist
from test_model_answers_at_more_sizes import LARGER, _caught_answer

from dtlib import checks

cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: The checkers whose answer is the rank's whole function: the skeleton's own message is the verdict.
WHOLE_FUNCTION = {"sum_of_ranks", "fixed_barrier", "tensor_parallel_mlp"}


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
