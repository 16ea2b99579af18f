"""The checkers of notebook 14's exercises, read from the simulator: the largest micro-batch that fits a GPU,
and the fewest pipeline stages that do.

Example: ``largest_micro_batch(2)`` is ✓ for Llama-2-7B at sequence 4096 on 64 ranks of an 80 GB GPU;
``smallest_pipeline(4)`` for Llama-2-70B at sequence 8192 on tp=8 ranks per stage.
"""

from __future__ import annotations

from typing import Any

from dtlib.checks._numbers import whole_answer
from dtlib.checks.feedback import Feedback
from dtlib.sim.llama import LLAMA
from dtlib.sim.step import Simulated, simulate


def _step(shape: str, dp: int, seq_len: int, micro_batch: int) -> Simulated:
    """The checker's own result: :func:`simulate` hands each caller a copy, so a learner's results, however
    edited (converted to GiB in place, say), never reach a verdict."""
    return simulate(LLAMA[shape], dp=dp, seq_len=seq_len, micro_batch=micro_batch)


def largest_micro_batch(answer: Any, shape: str = "7B", dp: int = 64, seq_len: int = 4096,
                        gpu_gib: float = 79.0) -> Feedback:
    """Notebook 14: the most samples per rank (``micro_batch``) whose simulated peak on rank 0 stays within
    ``gpu_gib``, for Llama-2 ``shape`` fully sharded over ``dp`` ranks, without activation checkpointing."""
    answer = whole_answer(answer, "samples per rank")
    if isinstance(answer, str):
        return Feedback(False, answer)
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
           f"them: sharding divides the model state only (here {first.model_state() / 2**30:.1f} GiB of weights, "
           "gradients and optimizer state at the peak).")
    if answer == best:
        return Feedback(True, f"Right: {best} samples peak at {peak(best)} of {gpu_gib:g} GiB; {best + 1} would peak "
                              f"at {peak(best + 1)}. {why}")
    if answer < best:
        return Feedback(False, f"{answer} fits ({peak(answer)}), but {answer + 1} fits too ({peak(answer + 1)} of "
                               f"{gpu_gib:g} GiB): look for the largest. {why}")
    return Feedback(False, f"With {answer} samples per rank, rank 0 peaks at {peak(answer)}, over the {gpu_gib:g} "
                           f"GiB of the GPU. {why}")


def _stage_0(shape: str, pp: int, tp: int, seq_len: int, micro_batches: int) -> Simulated:
    """The checker's own result for rank 0, the first stage (a copy of its own, as :func:`_step`'s)."""
    return simulate(LLAMA[shape], pp=pp, tp=tp, seq_len=seq_len, micro_batches=micro_batches, checkpointing=True)


def smallest_pipeline(answer: Any, shape: str = "70B", tp: int = 8, seq_len: int = 8192, micro_batches: int = 4,
                      gpu_gib: float = 79.0) -> Feedback:
    """Notebook 14: the fewest pipeline stages (pp) at which rank 0, the first stage, fits ``gpu_gib`` for
    Llama-2 ``shape`` with ``tp`` tensor-parallel ranks per stage and no data parallelism, at ``seq_len`` tokens,
    with activation checkpointing and ``micro_batches`` micro-batches under 1F1B. A stage holds whole blocks, so
    pp divides the layers."""
    answer = whole_answer(answer, "pipeline stages")
    if isinstance(answer, str):
        return Feedback(False, answer)
    layers = LLAMA[shape].layers
    stages = [pp for pp in range(1, layers + 1) if layers % pp == 0]
    if answer not in stages:
        return Feedback(False, f"pp={answer} cannot split the {layers} layers into equal stages: a stage holds whole "
                               f"blocks, so pp divides {layers} ({', '.join(map(str, stages[:8]))}, ...).")

    asked: dict[int, Simulated] = {}  # each layout simulated (or copied from simulate's answers) once per call

    def stage_0(pp: int) -> Simulated:
        if pp not in asked:
            asked[pp] = _stage_0(shape, pp, tp, seq_len, micro_batches)
        return asked[pp]

    def peak(pp: int) -> float:
        return stage_0(pp).peak / 2**30

    mine = stage_0(answer)
    state, acts = mine.model_state() / 2**30, mine.memory["activations"] / 2**30
    why = (f"More stages divide rank 0's model state ({state:.1f} GiB at pp={answer}) but hardly its activations "
           f"({acts:.1f} GiB): under 1F1B the first stage holds up to pp micro-batches in flight, each through "
           f"{layers}/pp layers, about one micro-batch through all {layers} layers whatever pp.")
    if peak(answer) > gpu_gib:
        return Feedback(False, f"With pp={answer}, rank 0 peaks at {peak(answer):.1f} GiB, over the {gpu_gib:g} GiB "
                               f"of the GPU: more stages, fewer layers per GPU. {why}")
    fewer = stages[stages.index(answer) - 1] if answer > 1 else None
    if fewer is not None and peak(fewer) <= gpu_gib:
        return Feedback(False, f"pp={answer} fits ({peak(answer):.1f} GiB), but pp={fewer} fits too "
                               f"({peak(fewer):.1f} GiB of {gpu_gib:g}): look for the fewest stages, since each one "
                               "more adds a step to fill and drain the pipeline (its bubble).")
    below = (f"; pp={fewer} would peak at {peak(fewer):.1f} GiB" if fewer is not None else "")
    return Feedback(True, f"Right: with pp={answer} ({answer * tp} GPUs), rank 0 peaks at {peak(answer):.1f} GiB of "
                          f"{gpu_gib:g}{below}. {why}")
