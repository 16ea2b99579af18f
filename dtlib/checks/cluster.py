"""The checker of notebook 14's exercise: the largest micro-batch that fits a GPU, read from the simulator.

Example: ``largest_micro_batch(2)`` is ✓ for Llama-2-7B at sequence 4096 on 64 ranks of an 80 GB GPU.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any

from dtlib.checks._numbers import as_number
from dtlib.feedback import Feedback
from dtlib.sim.llama import LLAMA
from dtlib.sim.step import Simulated, simulate


@functools.lru_cache(maxsize=64)
def _step(shape: str, dp: int, seq_len: int, micro_batch: int) -> Simulated:
    return simulate(LLAMA[shape], dp=dp, seq_len=seq_len, micro_batch=micro_batch)


def largest_micro_batch(answer: Any, shape: str = "7B", dp: int = 64, seq_len: int = 4096,
                        gpu_gib: float = 79.0) -> Feedback:
    """Notebook 14: the most samples per rank (``micro_batch``) whose simulated peak on rank 0 stays within
    ``gpu_gib``, for Llama-2 ``shape`` fully sharded over ``dp`` ranks, without activation checkpointing."""
    answer = as_number(answer)
    if answer is None:
        return Feedback(False, "No answer yet: set `answer` to a number of samples per rank.")
    if isinstance(answer, bool) or not isinstance(answer, numbers.Real) or not math.isfinite(answer) \
            or answer != int(answer):
        return Feedback(False, f"Answer with a whole number of samples per rank, not {answer!r}.")
    answer = int(answer)
    if answer < 1:
        return Feedback(False, f"{answer} samples is no step at all: a rank trains on at least 1.")
    peaks: dict[int, Simulated] = {}
    size = 1
    while True:
        peaks[size] = _step(shape, dp, seq_len, size)
        if peaks[size].peak / 2**30 > gpu_gib or size > answer:
            break
        size += 1
    fits = [m for m, result in peaks.items() if result.peak / 2**30 <= gpu_gib]
    best = max(fits) if fits else 0
    if answer not in peaks:
        peaks[answer] = _step(shape, dp, seq_len, answer)
    first = peaks[1]
    per_sample = first.memory["activations"] / 2**30

    def peak(m: int) -> str:
        return f"{peaks[m].peak / 2**30:.1f} GiB"

    why = (f"Activations take {per_sample:.1f} GiB per sample on every rank, and no number of FSDP ranks shards "
           f"them: sharding divides the model state only (here {first.model_state() / 2**30:.1f} GiB of weights and "
           "optimizer state at the peak).")
    if answer == best:
        return Feedback(True, f"Right: {best} samples peak at {peak(best)} of {gpu_gib:g} GiB; {best + 1} would peak "
                              f"at {peak(best + 1)}. {why}")
    if answer < best:
        return Feedback(False, f"{answer} fits ({peak(answer)}), but {answer + 1} fits too ({peak(answer + 1)} of "
                               f"{gpu_gib:g} GiB): look for the largest. {why}")
    return Feedback(False, f"With {answer} samples per rank, rank 0 peaks at {peak(answer)}, over the {gpu_gib:g} "
                           f"GiB of the GPU. {why}")
