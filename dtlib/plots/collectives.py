"""Drawings of collectives and the ring (notebooks 02 and 03): one ring step, every step, traffic per
rank as N grows, the benchmark's bus bandwidth, and a collective's values before and after.

Example::

    trace = dtlib.ring.simulate_all_reduce([np.arange(8.0) + r for r in range(4)])
    dtlib.plots.ring_step(trace, 1)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import FuncFormatter, NullLocator

from dtlib.plots._style import COLORS, _arrow, _box
from dtlib.ring import BUS_FACTOR, COLLECTIVE_MODEL


def _ring_positions(n: int, radius: float = 2.6, center: tuple[float, float] = (3.4, 3.4)) -> list[tuple[float, float]]:
    # Rank 0 at the top, the ring running clockwise.
    return [(center[0] + radius * np.sin(2 * np.pi * r / n), center[1] + radius * np.cos(2 * np.pi * r / n))
            for r in range(n)]


def ring_step(trace: Any, step: int) -> Figure:
    """One step of a simulated collective: who sends which chunk to whom (left), and after
    the step how many ranks' inputs each rank's chunks hold (right). ``step`` 0 is the start.

    Example: ``dtlib.plots.ring_step(dtlib.ring.simulate_all_reduce([[1, 2], [3, 4]]), 1)``.
    """
    n, last = trace.world_size, len(trace.steps)
    if not 0 <= step <= last:
        raise ValueError(f"step must be between 0 (the start) and {last}, got {step}")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.6), gridspec_kw={"width_ratios": [1.1, 1]})
    left.set_xlim(0, 6.8)
    left.set_ylim(0, 6.8)
    left.set_aspect("equal")
    left.axis("off")
    where = _ring_positions(n)
    transfers = trace.steps[step - 1].transfers if step else []
    for t in transfers:
        label = "all" if t.chunk is None else f"c{t.chunk}"
        start, end = np.array(where[t.src]), np.array(where[t.dst])
        gap = (end - start) / max(np.linalg.norm(end - start), 1e-9) * 0.45
        _arrow(left, tuple(start + gap), tuple(end - gap), connectionstyle="arc3,rad=0.15")
        if len(transfers) <= 12:
            mid = (start + end) / 2
            left.text(mid[0], mid[1], f"{label}\n{t.bytes} B", fontsize=7, ha="center", va="center",
                      bbox={"fc": "white", "ec": "none", "alpha": 0.8})
    for rank, (x, y) in enumerate(where):
        _box(left, x - 0.5, y - 0.25, 1.0, 0.5, f"rank {rank}", COLORS["rank"])
    phase = trace.steps[step - 1].phase if step else "start"
    left.set_title(f"{trace.algorithm}, N = {n}: step {step} of {last} ({phase})")
    counts = trace.contributions(step)
    image = right.imshow(counts, cmap="viridis", vmin=0, vmax=n, aspect="auto")
    right.set_xticks(range(counts.shape[1]), [f"c{c}" for c in range(counts.shape[1])])
    right.set_yticks(range(n), [f"rank {r}" for r in range(n)])
    if n <= 12:
        for (r, c), value in np.ndenumerate(counts):
            right.text(c, r, str(value), ha="center", va="center", color="white" if value < n * 0.6 else "black")
    right.set_xlabel("chunk of the buffer")
    right.set_title("ranks' inputs summed into each chunk")
    fig.colorbar(image, ax=right, label=f"inputs held (N = {n} means done)")
    fig.tight_layout()
    return fig


def ring_grid(trace: Any) -> Figure:
    """Every step at once: the (ranks x chunks) contribution grid from the start to the end, with a
    colour bar that reads a colour back as a count of ranks' inputs.

    Example: ``dtlib.plots.ring_grid(dtlib.ring.simulate_all_reduce([[0] * 8] * 4))``.
    """
    n, panels = trace.world_size, len(trace.steps) + 1
    columns = min(panels, 7)
    rows = -(-panels // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(1.7 * columns + 1.2, 1.9 * rows + 0.6), squeeze=False,
                             layout="constrained")
    for index, ax in enumerate(axes.flat):
        if index >= panels:
            ax.axis("off")
            continue
        image = ax.imshow(trace.contributions(index), cmap="viridis", vmin=0, vmax=n)
        ax.set_xticks([])
        ax.set_yticks([])
        phase = trace.steps[index - 1].phase if index else "start"
        ax.set_title(f"{index}: {phase}", fontsize=8)
        if index % columns == 0:
            ax.set_ylabel("ranks")
        if index >= panels - columns:
            ax.set_xlabel("chunks")
    colorbar = fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.9, ticks=range(n + 1))
    colorbar.set_label(f"inputs summed (N = {n}: done)")
    fig.suptitle(f"{trace.algorithm}, N = {n}: inputs summed into each chunk (bright = all {n})")
    return fig


def traffic(world_sizes: Sequence[int], table: dict[str, list[float]]) -> Figure:
    """Bytes the busiest rank sends, in units of the buffer size S, against N (from ``ring.traffic_table``).

    A series equal to an earlier one at every N would hide under it: it is drawn with hollow, larger
    markers and a dashed line over the first, and its legend entry says which one it equals.

    Example: ``dtlib.plots.traffic([2, 4, 8], dtlib.ring.traffic_table([2, 4, 8]))``.
    """
    fig, ax = plt.subplots(figsize=(7.5, 4.8), layout="constrained")
    markers = ["o", "s", "^", "D", "v", "P"]
    drawn: list[tuple[str, list[float], float]] = []  # name, values, marker size
    for index, (name, values) in enumerate(table.items()):
        twin = next(((other, size) for other, seen, size in drawn if np.allclose(seen, values)), None)
        marker = markers[index % len(markers)]
        if twin is None:
            ax.plot(world_sizes, values, marker=marker, ms=6, label=name)
            drawn.append((name, values, 6))
        else:
            ax.plot(world_sizes, values, marker=marker, ms=twin[1] + 6, mfc="none", mew=1.5, ls=(0, (4, 3)),
                    label=f"{name} (the same as {twin[0]})")
            drawn.append((name, values, twin[1] + 6))
    ax.set_yscale("log", base=2)  # ring and recursive doubling stay readable next to the N-1 growth
    plain = FuncFormatter(lambda value, _: f"{value:g}")  # 1, 2, 4 rather than 2^0, 2^1, 2^2 or 4.0
    ax.yaxis.set_major_formatter(plain)
    ax.set_xscale("log", base=2)  # world sizes double: equal steps, not a crowd at the left
    ax.set_xticks(list(world_sizes))
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_locator(NullLocator())
    ax.axhline(2, color="gray", ls=":", lw=1, zorder=0)
    between = math.sqrt(world_sizes[-2] * world_sizes[-1]) if len(world_sizes) > 1 else world_sizes[-1]
    ax.text(between, 2.1, "2 x S: the ring's limit", fontsize=8, color="gray", ha="center", va="bottom",
            bbox={"facecolor": "white", "edgecolor": "none", "pad": 1}, zorder=5)  # between two markers
    ax.set_xlabel("world size N (ranks)")
    ax.set_ylabel("bytes sent by the busiest rank (x S)")
    ax.set_title("All-reduce traffic per rank as the job grows")
    fig.legend(fontsize=8, loc="outside lower center", ncols=2)  # below the axes: it covers no data
    return fig


def _sweep_label(rows: Sequence[Any]) -> str:
    first = rows[0]
    calls = {"allreduce": "dist.all_reduce", "allgather": "dist.all_gather_single",
             "reducescatter": "dist.reduce_scatter_single", "broadcast": "dist.broadcast"}
    what = "dtlib's send/recv ring" if first.algo == "ring" else calls.get(first.op, first.op)
    return f"{what}, measured ({first.world_size} ranks)"


def busbw(rows: Sequence[Any], model: Any = None, compare: Sequence[Any] | None = None) -> Figure:
    """Bus bandwidth against message size (a ``dtlib.bench.bandwidth.sweep``), with the fitted
    alpha-beta model's prediction laid over it and, optionally, a second sweep of the same sizes.

    Example: ``rows = sweep("allreduce"); dtlib.plots.busbw(rows, fit(rows), compare=sweep("allreduce", algo="ring"))``.
    """
    first = rows[0]
    fig, ax = plt.subplots(figsize=(7.5, 4))
    sizes = [r.size_bytes for r in rows]
    ax.plot(sizes, [r.busbw_gbs for r in rows], marker="o", label=_sweep_label(rows))
    if compare:
        ax.plot([r.size_bytes for r in compare], [r.busbw_gbs for r in compare], marker="s", ms=5,
                color=COLORS["store"], label=_sweep_label(compare))
    if model is not None:
        factor = BUS_FACTOR[first.op](first.world_size)
        grid = np.geomspace(sizes[0], sizes[-1], 100)
        predicted = [s / model.time(COLLECTIVE_MODEL[first.op], first.world_size, s) / 1e9 * factor for s in grid]
        ax.plot(grid, predicted, "--", color="black",
                label=f"alpha-beta model: alpha = {model.alpha_s * 1e6:.0f} us, "
                      f"b = {model.bandwidth_bytes_per_s / 1e9:.2f} GB/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size S (bytes, log scale)")
    ax.set_ylabel("bus bandwidth (GB/s, 1 GB = 1e9 B)")
    ring_only = first.algo == "ring" and not compare
    ax.set_title(f"{first.op}{' (send/recv ring)' if ring_only else ''}: busbw against size")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _value_table(ax: Any, rows: list[list[float]], title: str, vmax: float) -> None:
    width = max((len(r) for r in rows), default=0) or 1
    grid = np.full((len(rows), width), np.nan)
    for rank, values in enumerate(rows):
        grid[rank, : len(values)] = values
    ax.imshow(grid, cmap="Blues", vmin=0, vmax=vmax * 1.6, aspect="auto")
    undefined_rows = {rank for rank, values in enumerate(rows) if values and np.isnan(values).all()}
    for (rank, slot), value in np.ndenumerate(grid):
        if slot < len(rows[rank]) and np.isnan(value):  # a number NCCL leaves undefined (strict mode writes NaN)
            ax.add_patch(Rectangle((slot - 0.5, rank - 0.5), 1, 1, facecolor="0.88", hatch="//", edgecolor="0.7"))
            if rank not in undefined_rows:
                ax.text(slot, rank, "undef.", ha="center", va="center", color="0.3", fontsize=7)
        elif not np.isnan(value):
            ax.text(slot, rank, f"{value:g}", ha="center", va="center", fontsize=9 if width <= 8 else 7)
    for rank in undefined_rows:
        ax.text((len(rows[rank]) - 1) / 2, rank, "undefined: never read", ha="center", va="center", fontsize=8,
                color="0.2", bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
    for rank, values in enumerate(rows):
        if not values:
            ax.text((width - 1) / 2, rank, "nothing received", ha="center", va="center", fontsize=8, color="gray")
    ax.set_xticks(range(width))
    ax.set_yticks(range(len(rows)), [f"rank {r}" for r in range(len(rows))])
    ax.set_xlabel("position in the tensor")
    ax.set_title(title)


def _per_rank_values(values: Sequence[Any]) -> list[list[float]]:
    """Each rank's value as a flat list of numbers: a tensor, a list of tensors (all_gather's), a number, or
    None where a rank received nothing (gather's other ranks)."""
    rows = []
    for value in values:
        if value is None:
            rows.append([])
        elif isinstance(value, (list, tuple)):
            rows.append([float(v) for item in value for v in np.ravel(_as_array(item))])
        else:
            rows.append([float(v) for v in np.ravel(_as_array(value))])
    return rows


def _as_array(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a tensor (live ranks send them back on the CPU)
        value = value.detach().cpu().numpy()
    return np.asarray(value, dtype=np.float64)


def before_after(before: Sequence[Any], after: Sequence[Any], title: str) -> Figure:
    """Every rank's tensor before and after a collective, one row per rank, from values pulled off the ranks.

    ``before[rank]`` and ``after[rank]`` are a tensor, a list of tensors or None (nothing received). A NaN is
    drawn as a grey "undefined" cell: what a collective leaves undefined (dtlib.launch.strict writes NaN there).
    Example: after ``%ranks pull --quiet before x``, ``plots.before_after(before, x, "all_reduce(x)")``.
    """
    if len(before) != len(after) or not before:
        raise ValueError(f"need one value per rank before and after; got {len(before)} and {len(after)}")
    rows_before, rows_after = _per_rank_values(before), _per_rank_values(after)
    width_before = max(len(r) for r in rows_before) or 1
    width = max(len(r) for r in rows_after) or 1
    size = (min(12.0, 2.5 + 0.5 * (width_before + max(width, 3))), 1.3 + 0.45 * len(rows_before))
    fig, (left, right) = plt.subplots(1, 2, figsize=size,
                                      gridspec_kw={"width_ratios": [width_before, max(width, 3)]})
    vmax = max([abs(v) for r in rows_before + rows_after for v in r if not np.isnan(v)] or [1.0])
    _value_table(left, rows_before, "before", vmax)
    _value_table(right, rows_after, "after", vmax)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


# -- training runs (dtlib.train.ddp, dtlib.train.fsdp) ---------------------------------------------------------
