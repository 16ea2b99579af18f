"""Drawings of training runs: loss curves, the communication timeline, samplers, bar charts.

Each function takes what a dtlib runner returned (``dtlib.train.ddp.RankResult`` and friends)
and returns a Figure. Example::

    results = dtlib.train.ddp.run(dtlib.train.ddp.TrainConfig(), world_size=2)
    dtlib.plots.loss_curves(results, reference=dtlib.train.ddp.train_single(dtlib.train.ddp.TrainConfig()))
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from dtlib.plots._style import COLORS, tick_names


def loss_curves(results: Sequence[Any], reference: Any = None, title: str = "Loss per step, every rank") -> Figure:
    """Each rank's loss per step overlaid, their mean, and a one-process reference if given.

    ``results``: a runner's results (``.rank``, ``.first_step``, ``.losses``) or, from a function of
    your own, one list of losses per rank. ``reference``: a result with ``.losses``, or a list.
    Example: ``loss_curves(dtlib.spawn(train, 2), reference=single_process_losses)``.
    """
    fig, ax = plt.subplots(figsize=(7.5, 4))
    per_rank = [getattr(result, "losses", result) for result in results]
    first = getattr(results[0], "first_step", 0)
    for rank, (result, losses) in enumerate(zip(results, per_rank, strict=True)):
        steps = range(first, first + len(losses))
        ax.plot(steps, losses, marker=".", alpha=0.6, label=f"rank {getattr(result, 'rank', rank)} (its own batch)")
    mean = np.mean(per_rank, axis=0)
    ax.plot(range(first, first + len(mean)), mean, color="black", lw=2, label="mean over ranks")
    if reference is not None:
        reference_losses = getattr(reference, "losses", reference)
        ax.plot(range(len(reference_losses)), reference_losses, "o", mfc="none", color="#C44E52", ms=9,
                label="one process, whole global batch")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _last_launches(results: Sequence[Any]) -> list[float] | None:
    """For each all-reduce of the step, when the last rank launched it; None where the ranks' lists differ in
    length (then no bar is split). Each rank counts from its own zero, ``timeline["origin_s"]`` on
    ``time.perf_counter``, the machine's monotonic clock, which its processes share (GPU times are mapped onto
    it by ``CommLog.resolve``): adding it puts every rank on one clock."""
    lists = [[launched + result.timeline.get("origin_s", 0.0) for launched, _, _ in result.timeline["comm"]]
             for result in results]
    if len(lists) < 2 or len({len(comm) for comm in lists}) != 1:
        return None
    return [max(comm[i] for comm in lists) for i in range(len(lists[0]))]


def ddp_timeline(results: Sequence[Any], title: str = "") -> Figure:
    """One step per rank, on one time axis from the earliest rank's start: forward and backward compute as a
    bar, each all-reduce (bucket) as a bar below it, from launch to finish. An all-reduce cannot finish before
    every rank has launched it, so each bar is split there: the light part waits for the other ranks, the dark
    part comes after (the transfer, and any wait behind earlier buckets). Communication left of the compute's
    end is hidden behind it."""
    fig, ax = plt.subplots(figsize=(9, 0.9 + 1.1 * len(results)))
    origin = min(result.timeline["start_s"] + result.timeline.get("origin_s", 0.0) for result in results)
    last = _last_launches(results)
    waited = False
    for row, result in enumerate(results):
        line = result.timeline
        origin_here = origin - line.get("origin_s", 0.0)  # the common origin on this rank's own clock
        y = row * 2
        ms = [(t - origin_here) * 1e3 for t in (line["start_s"], line["compute_end_s"])]
        ax.broken_barh([(ms[0], ms[1] - ms[0])], (y + 1, 0.8), color=COLORS["cpu"])
        for index, (launched, done, nbytes) in enumerate(line["comm"]):
            at = (launched - origin_here) * 1e3
            if math.isnan(done):  # a CUDA collective not read back (CommLog.resolve): its launch only
                ax.plot([at], [y + 0.5], marker="|", markersize=14, color=COLORS["store"])
                continue
            end = (done - origin_here) * 1e3
            split = min(max(at, (last[index] - origin) * 1e3), end) if last else at
            if split > at:
                waited = True
                ax.broken_barh([(at, split - at)], (y + 0.1, 0.8), color=COLORS["store"], alpha=0.3,
                               edgecolor="black", lw=0.5)
            ax.broken_barh([(split, max(end - split, 0.02))], (y + 0.1, 0.8), color=COLORS["store"], alpha=0.9,
                           edgecolor="black", lw=0.5)
            if len(line["comm"]) <= 12:  # labels alternate high and low: buckets launched together stay readable
                ax.text(at, y + (0.3 if index % 2 else 0.7), f" {nbytes / 2**20:.2f}", fontsize=7, va="center")
        ax.vlines(ms[1], y, y + 1.9, color="gray", lw=0.5, ls=":")  # this rank's compute end
    ax.set_yticks([row * 2 + 0.5 for row in range(len(results))] + [row * 2 + 1.4 for row in range(len(results))],
                  [f"rank {r.rank} all-reduce" for r in results] + [f"rank {r.rank} compute" for r in results])
    ax.set_xlabel("ms since the first rank began the step (labels: bucket size in MiB)")
    share = np.mean([r.hidden_share[-1] for r in results])
    said = (f"{share:.0%} of communication hidden behind compute" if not math.isnan(share) else
            "launches only: these GPU collectives' finishes were not read back from their CUDA events")
    ax.set_title(title or f"Step {results[0].timeline['step']}: {said}")
    ax.plot([], [], color=COLORS["cpu"], lw=8, label="forward + backward (until the last gradient is ready)")
    if waited:
        ax.plot([], [], color=COLORS["store"], lw=8, alpha=0.3, label="all-reduce launched, other ranks not yet")
    ax.plot([], [], color=COLORS["store"], lw=8, label="all-reduce, every rank in: transfer to finish")
    ax.legend(fontsize=8, loc="upper right", bbox_to_anchor=(1, -0.25), ncol=2)
    fig.tight_layout()
    return fig


def sampler_grid(order: Sequence[Sequence[Sequence[int]]], title: str = "") -> Figure:
    """``[epoch][rank]`` indices (``dtlib.train.data.sampler_indices``) as a grid: rows are (epoch, rank),
    each cell a sample index, coloured by the index so that repeats across epochs show."""
    rows = [(epoch, rank, indices) for epoch, ranks in enumerate(order) for rank, indices in enumerate(ranks)]
    width = max(len(indices) for _, _, indices in rows)
    grid = np.full((len(rows), width), np.nan)
    for i, (_, _, indices) in enumerate(rows):
        grid[i, : len(indices)] = indices
    figure_width = min(12, max(6.0, 1.5 + 0.5 * width))  # inches; 6 or more leaves room for the title
    fig, ax = plt.subplots(figsize=(figure_width, 0.6 + 0.35 * len(rows)))
    ax.imshow(grid, cmap="viridis", aspect="auto")
    for (i, j), value in np.ndenumerate(grid):
        if not np.isnan(value):
            ax.text(j, i, f"{int(value)}", ha="center", va="center", fontsize=8, color="white")
    ax.set_yticks(range(len(rows)), [f"epoch {e}, rank {r}" for e, r, _ in rows])
    ax.set_xticks(range(width))
    ax.set_xlabel("position in the rank's epoch")
    ax.set_title(title or "Sample indices each rank sees, epoch by epoch")
    fig.tight_layout()
    return fig


def bars(values: Mapping[str, float], title: str, ylabel: str, fmt: str = "{:.3g}", log: bool = False) -> Figure:
    """A labelled bar chart: one bar per key, its value written on it; ``log`` for values far apart."""
    fig, ax = plt.subplots(figsize=(max(5.0, 1.4 * len(values)), 3.6))
    if log:
        ax.set_yscale("log")
    bars_ = ax.bar(tick_names(list(values)), list(values.values()), color=COLORS["cpu"])
    for bar, value in zip(bars_, values.values(), strict=True):
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), fmt.format(value), ha="center", va="bottom",
                fontsize=9)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    return fig


def nodes(records: Sequence[Mapping[str, Any]], title: str = "") -> Figure:
    """The ranks of a torchrun job grouped by node (``GROUP_RANK``), each box with its RANK and
    LOCAL_RANK: records as ``dtlib.launch.torchrun.env_records`` parses them."""
    by_node: dict[int, list[Mapping[str, Any]]] = {}
    for record in records:
        by_node.setdefault(int(record["GROUP_RANK"]), []).append(record)
    per_node = max(len(ranks) for ranks in by_node.values())
    fig, ax = plt.subplots(figsize=(2.0 + 2.2 * per_node, 0.8 + 1.5 * len(by_node)))
    for row, (node, ranks) in enumerate(sorted(by_node.items())):
        y = (len(by_node) - 1 - row) * 1.5
        ax.add_patch(plt.Rectangle((0, y), 0.4 + 2.2 * per_node, 1.2, fc="#EEEEEE", ec="black"))
        ax.text(0.1, y + 1.05, f"node {node} (GROUP_RANK={node})", fontsize=9, va="top")
        for i, record in enumerate(sorted(ranks, key=lambda r: int(r["LOCAL_RANK"]))):
            ax.add_patch(plt.Rectangle((0.2 + 2.2 * i, y + 0.1), 2.0, 0.6, fc=COLORS["rank"], ec="black"))
            ax.text(1.2 + 2.2 * i, y + 0.4, f"RANK {record['RANK']}, LOCAL_RANK {record['LOCAL_RANK']}",
                    ha="center", va="center", color="white", fontsize=8)
    first = records[0]
    ax.set_xlim(-0.1, 0.5 + 2.2 * per_node)
    ax.set_ylim(-0.2, 1.5 * len(by_node))
    ax.axis("off")
    ax.set_title(title or f"WORLD_SIZE={first['WORLD_SIZE']}: {len(by_node)} node(s) x {per_node} rank(s); "
                          f"store at {first['MASTER_ADDR']}:{first['MASTER_PORT']}")
    fig.tight_layout()
    return fig
