"""Exercise checkers: each says what is right or, precisely, what is wrong.

A checker returns :class:`dtlib.checks.feedback.Feedback`; the notebook shows it as the cell's value.
Checkers never raise on a wrong answer: a wrong answer is the normal case.

Example::

    dtlib.checks.backend_choice("gloo", world_size=2)   # ✓ or ✗ with a hint

One principle orders the modules: **a module is one kind of answer, judged one way**, and every checker is
registered here (its name and module in ``_HOMES``, which makes ``__all__``; it loads on first use). Its tests are
``tests/checks/test_<module>.py``, with the right answers written several ways and a bank of one of each kind of
wrong answer.

- ``answers``: a value typed into a cell (notebooks 00, 05, 06); no processes;
- ``commands``: a torchrun command line typed into a cell, read as the shell and torchrun read it (07);
- ``rank_functions``: a function every rank runs, its result and its collectives (01, 02, 08);
- ``ring_phases``: one phase of the ring all-reduce, on live ranks (03);
- ``training``: a gradient hook and an FSDP wrap, beside torch's DDP (04, 05);
- ``tensor_parallel``: a tensor-parallel MLP by hand (09);
- ``layouts``: a pipeline's micro-batches (10) and a 2-D mesh laid on nodes (11), from typed answers;
- ``attention``: the softmax merge of ring attention (12);
- ``experts``: an expert-parallel mixture of experts, tokens moved by all-to-all (13);
- ``cluster``: the largest micro-batch and the smallest pipeline of a simulated cluster (14);
- ``collective_order``: the order of FSDP2's collectives in a step, predicted, then traced on live ranks (15);
- ``faults``: the checkpoint interval that wastes the least time, as a function of the job (16);
- ``predictions``: a key figure predicted in a widget, then measured on this machine and the guess judged (every
  notebook); ``measured`` holds the measurements.

What the checkers share has one home each: ``feedback`` (the verdict), ``typed`` (a name from a list, a number
however written), ``shapes`` (a typed answer's shape as data: a choice, a known number, the fewest or the most of
something whole that meets a condition, each with its judge), and ``skeleton`` (the principles every
rank-function checker holds an answer to, ``docs/testing.md``).
"""

from typing import Any

from dtlib._lazy import submodule

#: Every checker's name, and the module it lives in. Each loads on first use (:func:`__getattr__`): a rank that
#: unpickles the skeleton's own rank function imports this package, and importing every checker there (the
#: predictions' measurements, FSDP's runner and DCP with them) cost each rank of every check about 0.15 s of CPU.
_HOMES = {
    "Feedback": "feedback",
    "average_of_ranks": "rank_functions",
    "backend_choice": "answers",
    "checkpoint_interval": "faults",
    "expert_parallel_moe": "experts",
    "fixed_barrier": "rank_functions",
    "fsdp_collectives": "collective_order",
    "fsdp_memory": "answers",
    "fsdp_wrap": "training",
    "gradient_hook": "training",
    "largest_micro_batch": "cluster",
    "mesh_for_nodes": "layouts",
    "pipeline_micro_batches": "layouts",
    "predict": "predictions",
    "ring_phase": "ring_phases",
    "smallest_pipeline": "cluster",
    "softmax_merge": "attention",
    "strategy_choice": "answers",
    "sum_of_ranks": "rank_functions",
    "tensor_parallel_mlp": "tensor_parallel",
    "torchrun_command": "commands",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    """``dtlib.checks.sum_of_ranks``: the checker, its module imported on first use; or a submodule
    (``dtlib.checks.typed``)."""
    if name in _HOMES:
        value = getattr(submodule(__name__, _HOMES[name]), name)
        globals()[name] = value  # found once: later uses do not come back here
        return value
    return submodule(__name__, name)


def __dir__() -> list[str]:
    """The checkers too, though not loaded yet: what a notebook's tab completion offers."""
    return sorted({*globals(), *__all__})

