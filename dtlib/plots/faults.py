"""Drawings of jobs that fail and go on: a restart's steps over time, one simulated job's time, and the waste of
each checkpoint interval (notebook 16).

Example::

    dtlib.plots.restart_timeline(records)   # records: the JSON lines a training script printed, as dicts
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from dtlib.plots._style import COLORS

#: A job's time by kind, as dtlib.sim.failures.Run names it.
KIND_COLORS = {"work": COLORS["gpu"], "checkpoint": COLORS["cpu"], "lost": "#C44E52", "restart": COLORS["off"]}
_ATTEMPT_MARKERS = "o^sD"


def restart_timeline(records: Sequence[Mapping[str, Any]], every: int | None = None,
                     title: str = "Each rank's steps over time, across torchrun's restart") -> Figure:
    """Each rank's steps against the seconds since the job's first step, one marker per attempt
    (``TORCHELASTIC_RESTART_COUNT``); a dashed line where each later attempt began, and dotted ones at the
    checkpointed steps when ``every`` is given. ``records``: dicts with ``t`` (seconds, any origin), ``attempt``,
    ``rank`` and ``step``."""
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    start = min(float(record["t"]) for record in records)
    attempts = sorted({int(record["attempt"]) for record in records})
    ranks = sorted({int(record["rank"]) for record in records})
    for rank in ranks:
        for attempt in attempts:
            mine = [r for r in records if int(r["rank"]) == rank and int(r["attempt"]) == attempt]
            if mine:  # the first rank hollow and larger, so that ranks on the same steps all show
                ax.plot([float(r["t"]) - start for r in mine], [int(r["step"]) for r in mine],
                        marker=_ATTEMPT_MARKERS[attempt % len(_ATTEMPT_MARKERS)], ms=9 if rank == ranks[0] else 4,
                        mfc="none" if rank == ranks[0] else f"C{rank}", lw=1, alpha=0.9, color=f"C{rank}",
                        label=f"rank {rank}, attempt {attempt}")
    for before, attempt in zip(attempts, attempts[1:], strict=False):
        ended = max(float(r["t"]) for r in records if int(r["attempt"]) == before) - start
        began = min(float(r["t"]) for r in records if int(r["attempt"]) == attempt) - start
        ax.axvspan(ended, began, color=COLORS["off"], alpha=0.35, lw=0)
        ax.annotate(f"failure, then the restart: {began - ended:.1f} s", ((ended + began) / 2, 1), ha="center",
                    va="bottom", fontsize=8)
    if every:
        for index, step in enumerate(range(every, max(int(r["step"]) for r in records) + 1, every)):
            ax.axhline(step, color=COLORS["cpu"], ls=":", lw=1, label="a checkpoint is complete" if not index else None)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("seconds since the first step")
    ax.set_ylabel("step finished")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    return fig


def job_time(events: Sequence[tuple[float, float, str]], title: str = "One simulated job, hour by hour") -> Figure:
    """One job's wall time as a bar: work, checkpoints, work lost to failures and restarts, in hours.
    ``events``: ``(start_s, end_s, kind)``, as :class:`dtlib.sim.failures.Run` holds them."""
    fig, ax = plt.subplots(figsize=(7.5, 1.9))
    for kind, color in KIND_COLORS.items():
        spans = [(start / 3600, (end - start) / 3600) for start, end, what in events if what == kind]
        ax.broken_barh(spans, (0, 1), color=color)
    ax.set_yticks([])
    ax.set_xlabel("time since the start (hours)")
    ax.set_xlim(0, max(end for _, end, _ in events) / 3600)
    ax.set_title(title)
    ax.legend(handles=[Patch(color=color, label=kind) for kind, color in KIND_COLORS.items()], fontsize=8,
              loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)  # beside the bar: clear of the x label
    fig.tight_layout()
    return fig


def waste_curve(intervals_s: Sequence[float], waste: Sequence[float], simulated: Sequence[float] | None = None,
                marks: Mapping[str, float] | None = None,
                title: str = "Time wasted against the checkpoint interval") -> Figure:
    """The fraction of wall time wasted at each interval (exact, a line), simulated jobs' fractions (points,
    where given) and named intervals as vertical lines (``{"Young": 1315.0}``)."""
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    minutes = [interval / 60 for interval in intervals_s]
    ax.plot(minutes, [100 * w for w in waste], color="black", lw=2, label="expected (exact)")
    if simulated is not None:
        ax.plot(minutes, [100 * w for w in simulated], "o", color=COLORS["rank"], ms=5, label="simulated jobs")
    for index, (name, interval) in enumerate((marks or {}).items()):
        ax.axvline(interval / 60, color=f"C{index + 1}", ls="--", lw=1.2, label=f"{name}: {interval / 60:.1f} min")
    ax.set_xscale("log")
    ax.set_xlabel("checkpoint interval (minutes of work, log scale)")
    ax.set_ylabel("wall time wasted (%)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
