"""Checkers of answers typed into a cell (a backend name, a number of bytes, a strategy, a command).

Nothing here starts processes. The strategy and torchrun checkers live beside the code they check
(:mod:`dtlib.train.guide`, :mod:`dtlib.launch.torchrun`); these functions give them their ``dtlib.checks`` names.

Example::

    dtlib.checks.backend_choice("gloo", world_size=2)   # ✓ or ✗ with a hint
"""

from __future__ import annotations

from typing import Any

from dtlib.feedback import Feedback
from dtlib.launch.spawn import resolve_backend
from dtlib.launch.torchrun import check_command
from dtlib.measure import memory
from dtlib.train.guide import check_choice


def backend_choice(answer: Any, world_size: int = 2) -> Feedback:
    """Notebook 00: which backend does ``dtlib.spawn(backend="auto")`` pick for ``world_size`` ranks here?"""
    if answer is None:
        return Feedback(False, "No answer yet: set `answer` to 'gloo' or 'nccl'.")
    if not isinstance(answer, str) or answer.lower() not in ("gloo", "nccl", "mpi"):
        return Feedback(False, f"{answer!r} is not a backend name; the choices are 'gloo', 'nccl' and 'mpi'.")
    expected = resolve_backend("auto", world_size)
    if answer.lower() == expected:
        why = "one GPU per rank is available" if expected == "nccl" else "there are not enough GPUs for NCCL"
        return Feedback(True, f"Right: {expected}, because {why} for {world_size} ranks.")
    if answer.lower() == "nccl":
        return Feedback(False, f"NCCL needs one CUDA GPU per rank; this machine cannot give {world_size} ranks "
                               "a GPU each (look at the GPU count above).")
    if answer.lower() == "mpi":
        return Feedback(False, "dtlib never picks MPI by itself; 'auto' chooses between NCCL and gloo.")
    return Feedback(False, f"This machine has enough GPUs for {world_size} ranks, so 'auto' picks NCCL.")


#: Units an answer in bytes may have been given in by mistake: name, bytes per unit, and how to say it.
BYTE_UNITS = (("KB", 1e3, "10^3"), ("KiB", 2**10, "2^10"), ("MB", 1e6, "10^6"), ("MiB", 2**20, "2^20"),
              ("GB", 1e9, "10^9"), ("GiB", 2**30, "2^30"))


def _show(number: float) -> str:
    """A number as a learner reads it: 112,256 or 0.1123, never a small number rounded to 0."""
    return f"{number:,.0f}" if abs(number) >= 1000 else f"{number:.6g}"


def fsdp_memory(answer: Any, num_params: int = 28_064, world_size: int = 4, strategy: str = "full_shard") -> Feedback:
    """Notebook 05: bytes of model state per rank for ``num_params`` fp32 parameters trained with Adam
    (4 bytes of weights, 4 of gradients, 8 of Adam's two moments per parameter) under ``strategy``.

    Example: ``fsdp_memory(16 * 28_064)`` says that is DDP's figure, not FULL_SHARD's.
    """

    fp32_adam = {"param_bytes": 4, "grad_bytes": 4, "optim_bytes_per_param": 8}
    expected = memory.estimate(num_params, world_size, strategy, **fp32_adam)
    if answer is None:
        return Feedback(False, "No answer yet: set `answer` to a number of bytes.")
    if not isinstance(answer, (int, float)) or isinstance(answer, bool):
        return Feedback(False, f"Answer with a number of bytes, not {type(answer).__name__}.")
    if abs(answer - expected) <= 0.01 * expected:
        return Feedback(True, f"Right: {expected:,.0f} bytes per rank; the measured figure above is within 0.1% "
                              "(Adam's step counters are the difference).")
    p, n = num_params, world_size
    known = {
        16 * p: "that is every rank holding everything, as DDP does: FULL_SHARD divides all three by world_size.",
        4 * p / n: "that counts the parameters only: each rank also holds its shard of the gradients and of "
                   "Adam's two moments.",
        8 * p / n: "that misses Adam's state: exp_avg and exp_avg_sq, 8 bytes per parameter in fp32.",
        12 * p / n: "that misses the gradients: 4 bytes per parameter, sharded like the rest.",
        memory.estimate(p, n, "zero2", **fp32_adam): "that is ZeRO-2: parameters whole on every rank, gradients "
                                                     "and Adam's state sharded. FULL_SHARD shards the parameters "
                                                     "too.",
    }
    for value, hint in known.items():
        if abs(answer - value) <= 0.01 * value:
            return Feedback(False, f"{_show(answer)} bytes: {hint}")
    for unit, size, power in BYTE_UNITS:
        in_bytes = answer * size
        if abs(in_bytes - expected) <= 0.01 * expected:
            return Feedback(False, f"{_show(answer)} looks like the answer in {unit} ({power} bytes): that is "
                                   f"{_show(in_bytes)} bytes, the right amount. Give the answer in bytes.")
        for value, hint in known.items():
            if abs(in_bytes - value) <= 0.01 * value:
                return Feedback(False, f"{_show(answer)} looks like {unit} ({power} bytes), that is "
                                       f"{_show(in_bytes)} bytes; give the answer in bytes. And {hint}")
    return Feedback(False, f"{_show(answer)} bytes is off by a factor of {answer / expected:.3g}: count 16 bytes "
                           f"per parameter (4 weights + 4 gradients + 8 Adam), then apply {strategy}'s sharding "
                           f"over {world_size} ranks.")


def strategy_choice(answer: Any, num_params: float, gpu_memory_gb: float, num_gpus: int, nodes: int = 1) -> Feedback:
    """Notebook 06: the strategy :func:`dtlib.train.guide.recommend` picks
    (see :func:`dtlib.train.guide.check_choice`)."""

    return check_choice(answer, num_params, gpu_memory_gb, num_gpus, nodes)


def torchrun_command(command: Any, **job: Any) -> Feedback:
    """Notebook 07: a node's torchrun line (see :func:`dtlib.launch.torchrun.check_command`)."""

    return check_command(command, **job)
