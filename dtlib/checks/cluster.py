"""The checkers of notebook 14's exercises, read from the simulator: the largest micro-batch that fits a GPU,
and the fewest pipeline stages that do.

Example: ``largest_micro_batch(3)`` is ✓ for Llama-2-7B at sequence 4096 on 64 ranks of an 80 GB GPU;
``smallest_pipeline(4)`` for Llama-2-70B at sequence 8192 on tp=8 ranks per stage.
"""

from __future__ import annotations

from typing import Any

from dtlib.checks.feedback import Feedback
from dtlib.checks.shapes import Extreme, judge_extreme
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
    peaks: dict[int, Simulated] = {}  # each micro-batch simulated once per call

    def step(size: int) -> Simulated:
        if size not in peaks:
            peaks[size] = _step(shape, dp, seq_len, size)
        return peaks[size]

    def peak_gib(size: int) -> float:
        return step(size).peak / 2**30

    def why() -> str:
        first, added = step(1), peak_gib(2) - peak_gib(1)
        return (f"Each sample adds {added:.1f} GiB on every rank ({first.memory['activations'] / 2**30:.1f} of "
                "activations, the rest its logits and their gradient), and no number of FSDP ranks shards that: "
                f"sharding divides the model state only (here {first.model_state() / 2**30:.1f} GiB of weights, "
                "gradients and optimizer state at the peak).")

    # One sample more never lowers the peak, so the answer is right when the next size is over the GPU.
    return judge_extreme(answer, Extreme(
        "samples per rank",
        allowed=lambda size: None if size >= 1 else f"{size} samples is no step at all: a rank trains on at least 1.",
        holds=lambda size: peak_gib(size) <= gpu_gib,
        next=lambda size: size + 1,
        fails=lambda size: (f"With {size} samples per rank, rank 0 peaks at {peak_gib(size):.1f} GiB, over the "
                            f"{gpu_gib:g} GiB of the GPU. {why()}"),
        beaten=lambda size, more: (f"{size} fits ({peak_gib(size):.1f} GiB), but {more} fits too ({peak_gib(more):.1f} "
                                   f"GiB of {gpu_gib:g} GiB): look for the largest. {why()}"),
        right=lambda size, more: (f"Right: {size} samples peak at {peak_gib(size):.1f} GiB of {gpu_gib:g} GiB; {more} "
                                  f"would peak at {peak_gib(more):.1f} GiB. {why()}")))


def _stage_0(shape: str, pp: int, tp: int, seq_len: int, micro_batches: int) -> Simulated:
    """The checker's own result for rank 0, the first stage (a copy of its own, as :func:`_step`'s)."""
    return simulate(LLAMA[shape], pp=pp, tp=tp, seq_len=seq_len, micro_batches=micro_batches, checkpointing=True)


def smallest_pipeline(answer: Any, shape: str = "70B", tp: int = 8, seq_len: int = 8192, micro_batches: int = 4,
                      gpu_gib: float = 79.0) -> Feedback:
    """Notebook 14: the fewest pipeline stages (pp) at which rank 0, the first stage, fits ``gpu_gib`` for
    Llama-2 ``shape`` with ``tp`` tensor-parallel ranks per stage and no data parallelism, at ``seq_len`` tokens,
    with activation checkpointing and ``micro_batches`` micro-batches under 1F1B. A stage holds whole blocks, so
    pp divides the layers."""
    layers = LLAMA[shape].layers
    stages = [pp for pp in range(1, layers + 1) if layers % pp == 0]
    asked: dict[int, Simulated] = {}  # each layout simulated (or copied from simulate's answers) once per call

    def stage_0(pp: int) -> Simulated:
        if pp not in asked:
            asked[pp] = _stage_0(shape, pp, tp, seq_len, micro_batches)
        return asked[pp]

    def peak(pp: int) -> float:
        return stage_0(pp).peak / 2**30

    def why(pp: int) -> str:
        result = stage_0(pp)
        state, acts = result.model_state() / 2**30, result.memory["activations"] / 2**30
        in_step = acts < 0.01 * result.peak / 2**30  # the optimizer's step: no activation is held any more
        when = (f"in the optimizer's step, with {state:.1f} GiB of model state (AdamW's temporary among it) and no "
                "activations left" if in_step else f"with {state:.1f} GiB of model state and {acts:.1f} of activations")
        return (f"At pp={pp} rank 0 peaks {when}. More stages divide the model state but hardly the activations: "
                f"under 1F1B the first stage holds up to pp micro-batches in flight, each through {layers}/pp layers, "
                f"so at most one micro-batch's block inputs through all {layers} layers, whatever pp (one "
                "micro-batch fewer where the peak comes after the first backward).")

    def allowed(pp: int) -> str | None:
        if pp in stages:
            return None
        return (f"pp={pp} cannot split the {layers} layers into equal stages: a stage holds whole blocks, so pp "
                f"divides {layers} ({', '.join(map(str, stages[:8]))}, ...).")

    def right(pp: int, fewer: int | None) -> str:
        below = f"; pp={fewer} would peak at {peak(fewer):.1f} GiB" if fewer is not None else ""
        return (f"Right: with pp={pp} ({pp * tp} GPUs), rank 0 peaks at {peak(pp):.1f} GiB of {gpu_gib:g}{below}. "
                f"{why(pp)}")

    # More stages never raise the first stage's peak, so the answer is right when the next fewer is over the GPU.
    return judge_extreme(answer, Extreme(
        "pipeline stages", allowed, holds=lambda pp: peak(pp) <= gpu_gib,
        next=lambda pp: stages[stages.index(pp) - 1] if pp > 1 else None,
        fails=lambda pp: (f"With pp={pp}, rank 0 peaks at {peak(pp):.1f} GiB, over the {gpu_gib:g} GiB of the GPU: "
                          f"more stages, fewer layers per GPU. {why(pp)}"),
        beaten=lambda pp, fewer: (f"pp={pp} fits ({peak(pp):.1f} GiB), but pp={fewer} fits too ({peak(fewer):.1f} "
                                  f"GiB of {gpu_gib:g}): look for the fewest stages, since each one more adds a step "
                                  "to fill and drain the pipeline (its bubble)."),
        right=right))
