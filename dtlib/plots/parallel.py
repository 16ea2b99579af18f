"""Figures beyond data parallelism: where each rank's part of a tensor lies (DTensor placements)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from dtlib.plots._style import COLORS, RANK_COLORS


def _dims(shape: Sequence[int]) -> tuple[int, int]:
    if not 1 <= len(shape) <= 2:
        raise ValueError(f"placements draws 1-D and 2-D tensors, got shape {tuple(shape)}")
    return (int(shape[0]), int(shape[1])) if len(shape) == 2 else (int(shape[0]), 1)


def _placement(placement: Any) -> tuple[str, int]:
    """("shard", dim), ("partial", 0) or ("replicate", 0) from a DTensor placement or its str, long or short
    (``Shard(dim=1)``, ``Shard(1)``, ``S(1)``; ``Partial(sum)``, ``P(sum)``; ``Replicate()``, ``R``)."""
    if hasattr(placement, "is_shard"):
        if placement.is_shard():
            return "shard", int(placement.dim)
        return ("partial", 0) if placement.is_partial() else ("replicate", 0)
    text = str(placement).strip()
    found = re.fullmatch(r"(?:Shard|S)\((?:dim=)?(-?\d+)\)", text)
    if found:
        return "shard", int(found[1])
    if re.fullmatch(r"(?:Partial|P)(?:\(.*\))?", text):
        return "partial", 0
    if re.fullmatch(r"Replicate\(\)|R", text):
        return "replicate", 0
    raise ValueError(f"not a DTensor placement: {placement!r} (Shard(d), Replicate() or Partial())")


def placements(layout: Mapping[str, tuple[Sequence[int], Any]], world_size: int, title: str = "") -> Figure:
    """Each tensor of ``layout`` as its (rows, columns) rectangle, coloured by the rank that holds each part.

    ``layout`` maps a name to ``(global shape, placement)``, the placement a DTensor's (``Shard(0)``,
    ``Shard(1)``, ``Replicate()``, ``Partial()``) or its ``str``. ``Shard(d)`` cuts dimension d into
    ``world_size`` stripes as ``torch.chunk`` does; ``Replicate()`` is whole on every rank; ``Partial()`` is
    whole-sized on every rank, each holding a summand. Example (in the kernel, from a rank's report)::

        plots.placements({"up.weight": ((64, 16), "Shard(0)"), "down.weight": ((16, 64), "Shard(1)")}, 2)
    """
    if not layout:
        raise ValueError("placements needs at least one tensor")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    fig, axes = plt.subplots(1, len(layout), figsize=(min(14.0, 1.0 + 3.0 * len(layout)), 3.6), squeeze=False)
    for ax, (name, (shape, placement)) in zip(axes[0], layout.items(), strict=True):
        rows, cols = _dims(shape)
        kind, dim = _placement(placement)
        turn = 90 if len(shape) == 1 else 0  # a vector is drawn as a narrow strip: its words run along it
        said = {"shard": f"Shard({dim})", "partial": "Partial(sum)", "replicate": "Replicate()"}[kind]
        if kind == "shard":
            by_rows = len(shape) == 1 or dim in (0, -2)
            along = rows if by_rows else cols
            size = -(-along // world_size)  # torch.chunk's split
            for rank in range(world_size):
                start, stop = rank * size, min(along, (rank + 1) * size)
                if start >= stop:
                    continue
                x, y, w, h = (0, start, cols, stop - start) if by_rows else (start, 0, stop - start, rows)
                ax.add_patch(Rectangle((x, y), w, h, color=RANK_COLORS[rank % len(RANK_COLORS)], alpha=0.85))
                ax.text(x + w / 2, y + h / 2, f"rank {rank}", ha="center", va="center", color="white", fontsize=9,
                        rotation=turn if by_rows else 90)
        elif kind == "partial":
            ax.add_patch(Rectangle((0, 0), cols, rows, facecolor=COLORS["store"], hatch="//", edgecolor="black",
                                   alpha=0.6))
            ax.text(cols / 2, rows / 2, "a summand\non every rank", ha="center", va="center", fontsize=9, rotation=turn)
        else:
            ax.add_patch(Rectangle((0, 0), cols, rows, color=COLORS["off"]))
            ax.text(cols / 2, rows / 2, "whole on\nevery rank", ha="center", va="center", fontsize=9, rotation=turn)
        ax.set_xlim(0, cols)
        ax.set_ylim(rows, 0)
        ax.set_aspect("equal" if max(rows, cols) <= 8 * min(rows, cols) else "auto")
        if len(shape) == 1:  # a vector (a bias): a tall strip, whose one column has no width to count
            ax.set_xticks([])
            ax.set_box_aspect(4)
            ax.set_xlabel("columns (none: 1-D)")
            ax.set_ylabel(f"elements ({rows})")
        else:
            ax.set_xlabel(f"columns ({cols})")
            ax.set_ylabel(f"rows ({rows})")
        ax.set_title(f"{name}\n{said}", fontsize=10)
    handles = [Patch(color=RANK_COLORS[r % len(RANK_COLORS)], label=f"rank {r}") for r in range(world_size)]
    fig.legend(handles=handles, loc="lower center", ncol=min(world_size, 8), fontsize=8)
    fig.suptitle(title or f"Where each of {world_size} ranks holds its part", fontsize=11)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def mesh(shape: Sequence[int], names: Sequence[str], gpus_per_node: int = 0, title: str = "") -> Figure:
    """A 2-D device mesh as ``init_device_mesh`` numbers it (row-major): one cell per rank, rows along the first
    dimension, columns along the second; each group of the second dimension (a row) outlined. With
    ``gpus_per_node``, each node's ranks are shaded alike, so a group that crosses nodes shows."""
    if len(shape) != 2 or len(names) != 2 or min(shape) < 1:
        raise ValueError(f"mesh draws 2-D meshes: give two sizes and two names, got {tuple(shape)} and {tuple(names)}")
    rows, cols = int(shape[0]), int(shape[1])
    fig, ax = plt.subplots(figsize=(min(14.0, 2.5 + 1.3 * cols), 1.4 + 0.9 * rows))
    node_colors = [COLORS["cpu"], COLORS["gpu"], COLORS["store"], COLORS["rank"]]
    for row in range(rows):
        for col in range(cols):
            rank = row * cols + col
            color = node_colors[(rank // gpus_per_node) % len(node_colors)] if gpus_per_node else COLORS["cpu"]
            ax.add_patch(Rectangle((col + 0.08, row + 0.1), 0.84, 0.8, color=color, alpha=0.85))
            ax.text(col + 0.5, row + 0.5, f"rank {rank}" + (f"\nnode {rank // gpus_per_node}" if gpus_per_node else ""),
                    ha="center", va="center", color="white", fontsize=9)
        ax.add_patch(Rectangle((0.02, row + 0.04), cols - 0.04, 0.92, fill=False, edgecolor="black", lw=1.5,
                               linestyle="--"))
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)
    ax.set_xticks([c + 0.5 for c in range(cols)], [str(c) for c in range(cols)])
    ax.set_yticks([r + 0.5 for r in range(rows)], [str(r) for r in range(rows)])
    ax.set_xlabel(f"position along {names[1]} (each dashed row is one {names[1]} group)")
    ax.set_ylabel(f"position along {names[0]}")
    ax.set_title(title or f"init_device_mesh(..., {tuple(shape)}, mesh_dim_names={tuple(names)})", fontsize=10)
    fig.tight_layout()
    return fig
