"""Exercise checkers: each says what is right or, precisely, what is wrong.

A checker returns :class:`dtlib.checks.feedback.Feedback`; the notebook shows it as the cell's value.
Checkers never raise on a wrong answer: a wrong answer is the normal case.

Example::

    dtlib.checks.backend_choice("gloo", world_size=2)   # ✓ or ✗ with a hint

One principle orders the modules: **a module is one kind of answer, judged one way**, and every checker is
registered here (import and ``__all__``). Its tests are ``tests/checks/test_<module>.py``, with the right answers
written several ways and a bank of one of each kind of wrong answer.

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

from dtlib.checks.answers import backend_choice, fsdp_memory, strategy_choice
from dtlib.checks.attention import softmax_merge
from dtlib.checks.cluster import largest_micro_batch, smallest_pipeline
from dtlib.checks.collective_order import fsdp_collectives
from dtlib.checks.commands import torchrun_command
from dtlib.checks.experts import expert_parallel_moe
from dtlib.checks.faults import checkpoint_interval
from dtlib.checks.feedback import Feedback
from dtlib.checks.layouts import mesh_for_nodes, pipeline_micro_batches
from dtlib.checks.predictions import predict
from dtlib.checks.rank_functions import average_of_ranks, fixed_barrier, sum_of_ranks
from dtlib.checks.ring_phases import ring_phase
from dtlib.checks.tensor_parallel import tensor_parallel_mlp
from dtlib.checks.training import fsdp_wrap, gradient_hook

__all__ = ["Feedback", "average_of_ranks", "backend_choice", "checkpoint_interval", "expert_parallel_moe",
           "fixed_barrier", "fsdp_collectives", "fsdp_memory", "fsdp_wrap", "gradient_hook", "largest_micro_batch",
           "mesh_for_nodes", "pipeline_micro_batches", "predict", "ring_phase", "smallest_pipeline", "softmax_merge",
           "strategy_choice", "sum_of_ranks", "tensor_parallel_mlp", "torchrun_command"]
