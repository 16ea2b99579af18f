"""Ring attention's mechanism (notebook 12): at each step of the ring, which query block meets which key and value
block on which rank, with the causal mask, in the in-order and zigzag layouts."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Polygon, Rectangle

from dtlib.plots._style import COLORS, RANK_COLORS

LAYOUTS = ("in order", "zigzag")


def chunks_of(rank: int, world_size: int, layout: str) -> tuple[int, int]:
    """The two of 2p sequence chunks rank ``rank`` holds: in order ``2r, 2r + 1``; zigzag (head and tail)
    ``r, 2p - 1 - r``. Example: ``chunks_of(0, 4, "zigzag") == (0, 7)``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank}")
    return (rank, 2 * world_size - 1 - rank) if layout == "zigzag" else (2 * rank, 2 * rank + 1)


def step_scores(world_size: int, layout: str, step: int, chunk: int = 1) -> list[int]:
    """The attention scores each rank computes at ``step`` of the causal ring, counted as notebook 12 counts
    them: the query rows that see some key of the block held, times the key columns some query sees (a diagonal
    block is computed whole, with a mask; a block no query sees is skipped). ``chunk`` is tokens per chunk.
    Example: ``step_scores(4, "zigzag", 1, chunk=8) == [128, 128, 128, 128]``."""
    counts = []
    for rank in range(world_size):
        held = chunks_of((rank - step) % world_size, world_size, layout)
        pairs = _computed(chunks_of(rank, world_size, layout), held)
        counts.append(len(pairs) * chunk * chunk)
    return counts


def _computed(queries: Sequence[int], keys: Sequence[int]) -> set[tuple[int, int]]:
    """The (query chunk, key chunk) pairs a rank computes: the rows that see some key by the columns that some
    query sees (as :func:`step_scores` counts them); the others it skips."""
    rows = [q for q in queries if any(k <= q for k in keys)]
    cols = [k for k in keys if any(k <= q for q in queries)]
    return {(q, k) for q in rows for k in cols}


def _block(ax: plt.Axes, q: int, k: int, color: str, computed: bool) -> None:
    """Query chunk ``q`` (row, downwards) against key chunk ``k`` (column): whole when every key is earlier, a
    triangle on the diagonal (keys up to the query), pale where computed but masked out, hatched where skipped."""
    if not computed:
        ax.add_patch(Rectangle((k, q), 1, 1, facecolor=COLORS["off"], alpha=0.35, edgecolor=color, hatch="///",
                               lw=0.5))
    elif k < q:
        ax.add_patch(Rectangle((k, q), 1, 1, color=color))
    elif k == q:
        ax.add_patch(Rectangle((k, q), 1, 1, color=color, alpha=0.25))
        ax.add_patch(Polygon([(k, q), (k, q + 1), (k + 1, q + 1)], closed=True, color=color))
    else:
        ax.add_patch(Rectangle((k, q), 1, 1, color=color, alpha=0.25))


def ring_attention_blocks(world_size: int = 4, layouts: Sequence[str] = LAYOUTS, title: str = "") -> Figure:
    """One row per layout, one panel per ring step: the 2p x 2p grid of (query chunk, key chunk) blocks of the
    causal attention matrix, each block coloured by the rank that computes it at that step. Over the p steps
    every block on or below the diagonal is computed exactly once (a diagonal block as a triangle: each query
    sees the keys up to its own position); pale blocks are computed but masked out, hatched ones held but
    skipped. Each panel's title gives the busiest rank's blocks (:func:`step_scores` with one token per chunk):
    a step of the ring lasts that long."""
    if not isinstance(world_size, int) or not 2 <= world_size <= 8:
        raise ValueError(f"world_size must be a whole number from 2 to 8, got {world_size!r}")
    layouts = list(layouts)
    width = min(14.0, max(6.5, 2.3 * world_size))  # inches: room for the title and the legend, at most 14
    fig, axes = plt.subplots(len(layouts), world_size, figsize=(width, 2.6 * len(layouts) + 0.8), squeeze=False)
    size = 2 * world_size
    for row, layout in enumerate(layouts):
        for step in range(world_size):
            ax = axes[row][step]
            for rank in range(world_size):
                color = RANK_COLORS[rank % len(RANK_COLORS)]
                held = chunks_of((rank - step) % world_size, world_size, layout)
                mine = chunks_of(rank, world_size, layout)
                computed = _computed(mine, held)
                for q in mine:
                    for k in held:
                        _block(ax, q, k, color, (q, k) in computed)
            ax.set_xlim(0, size)
            ax.set_ylim(size, 0)
            ax.set_aspect("equal")
            ax.set_xticks(range(size + 1), [""] * (size + 1))
            ax.set_yticks(range(size + 1), [""] * (size + 1))
            ax.grid(True, color="#DDDDDD", lw=0.5)
            ax.tick_params(length=0)
            busiest = max(step_scores(world_size, layout, step))
            ax.set_title(f"{layout}, step {step}\nbusiest rank: {busiest} blocks", fontsize=8)
            if step == 0:
                ax.set_ylabel("chunk of the queries ↓", fontsize=8)
            if row == len(layouts) - 1:
                ax.set_xlabel("chunk of the keys and values →", fontsize=8)
    handles = [Patch(color=RANK_COLORS[r % len(RANK_COLORS)], label=f"rank {r}") for r in range(world_size)]
    handles.append(Patch(facecolor=RANK_COLORS[0], alpha=0.25, label="computed, masked"))
    handles.append(Patch(facecolor=COLORS["off"], alpha=0.35, hatch="///", label="held, skipped"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8)
    fig.suptitle(title or f"Causal ring attention on {world_size} ranks: who computes which block, step by step",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig
