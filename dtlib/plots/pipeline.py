"""Pipeline schedules drawn from measured times: one row per rank, a bar per forward and backward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from dtlib.measure.stages import pipeline_bubble
from dtlib.plots._style import COLORS

KIND_COLORS = {"F": COLORS["cpu"], "B": COLORS["gpu"]}


def pipeline(spans_per_rank: Sequence[Sequence[Any]], title: str = "") -> Figure:
    """Each rank's forwards (blue) and backwards (green) against time, labelled by micro-batch, from the
    ``(kind, stage, micro_batch, start_s, end_s)`` spans of :class:`dtlib.measure.stages.StageClock`, one list
    per rank. Where a rank holds two stages (an interleaved schedule), its second stage's bars are hatched.
    White between bars is the bubble."""
    spans = [span for rank in spans_per_rank for span in rank]
    if not spans:
        raise ValueError("no spans to draw: record a step with dtlib.measure.stages.StageClock")
    begin = min(span[3] for span in spans)
    end = max(span[4] for span in spans)
    fig, ax = plt.subplots(figsize=(min(14.0, 7.0 + 0.01 * (end - begin) * 1e3), 1.2 + 0.55 * len(spans_per_rank)))
    for rank, rank_spans in enumerate(spans_per_rank):
        first_stage = min((span[1] for span in rank_spans), default=rank)
        for kind, stage, micro_batch, start, stop in rank_spans:
            ax.broken_barh([((start - begin) * 1e3, (stop - start) * 1e3)], (rank - 0.4, 0.8),
                           facecolor=KIND_COLORS[kind], edgecolor="white", hatch="//" if stage != first_stage else "")
            ax.text((start + stop - 2 * begin) / 2 * 1e3, rank, str(micro_batch), ha="center", va="center",
                    fontsize=8, color="white")
    ax.set_yticks(range(len(spans_per_rank)), [f"rank {r}" for r in range(len(spans_per_rank))])
    ax.set_ylim(len(spans_per_rank) - 0.5, -0.5)
    ax.set_xlim(0, (end - begin) * 1e3)
    ax.set_xlabel("ms since the first forward (numbers: micro-batch)")
    ax.set_title(title or "A pipeline step, measured")
    handles = [Patch(color=KIND_COLORS["F"], label="forward"), Patch(color=KIND_COLORS["B"], label="backward")]
    if any(span[1] != min(s[1] for s in rank) for rank in spans_per_rank for span in rank):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="the rank's second stage"))
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


def bubble_curve(micro_batches: Sequence[int], measured: Sequence[float], stages: int, title: str = "") -> Figure:
    """The bubble measured at each micro-batch count (points) against (p - 1) / (m + p - 1) (line)."""
    if len(micro_batches) != len(measured) or not micro_batches:
        raise ValueError("give one measured bubble per micro-batch count")
    fig, ax = plt.subplots(figsize=(6.0, 3.6))
    dense = range(1, max(micro_batches) + 1)
    ax.plot(list(dense), [pipeline_bubble(stages, m) for m in dense], color=COLORS["off"],
            label=f"formula (p - 1) / (m + p - 1), p = {stages}")
    ax.plot(list(micro_batches), list(measured), "o", color=COLORS["cpu"], label="measured")
    for m, value in zip(micro_batches, measured, strict=True):
        ax.annotate(f"{value:.0%}", (m, value), textcoords="offset points", xytext=(6, 4), fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(micro_batches), [str(m) for m in micro_batches])
    ax.set_xlabel("micro-batches per step, m (log scale)")
    ax.set_ylabel("bubble (% of the ranks' time idle)")
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:.0%}"))
    ax.set_title(title or "The bubble shrinks as micro-batches grow")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
