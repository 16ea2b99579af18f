"""Expert parallelism: who sends how many tokens to whom, and how the tokens load the experts."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from dtlib.plots._style import COLORS


def dispatch(sent: Sequence[Sequence[int]], title: str = "") -> Figure:
    """The all-to-all of one step as a grid: row i, column j holds the tokens rank i sends to rank j (the
    diagonal stays on its rank and crosses no link). Row sums are what each rank sends out, column sums what
    each rank's experts receive."""
    counts = np.asarray(sent, dtype=float)
    if counts.ndim != 2 or counts.shape[0] != counts.shape[1] or counts.size == 0:
        raise ValueError(f"sent must be a square matrix of counts, one row per rank; got shape {counts.shape}")
    ranks = counts.shape[0]
    fig, ax = plt.subplots(figsize=(2.2 + 0.9 * ranks, 1.6 + 0.8 * ranks))
    image = ax.imshow(counts, cmap="Blues", vmin=0)
    for i in range(ranks):
        for j in range(ranks):
            dark = counts[i, j] > 0.6 * counts.max()
            ax.text(j, i, f"{counts[i, j]:.0f}" + ("\n(stays)" if i == j else ""), ha="center", va="center",
                    fontsize=9, color="white" if dark else "black")
    ax.set_xticks(range(ranks), [f"to {j}\n({counts[:, j].sum():.0f} in)" for j in range(ranks)], fontsize=8)
    ax.set_yticks(range(ranks), [f"rank {i} ({counts[i].sum() - counts[i, i]:.0f} out)" for i in range(ranks)],
                  fontsize=8)
    ax.set_xlabel("rank receiving (its experts get the tokens)")
    fig.colorbar(image, ax=ax, label="tokens sent", shrink=0.8)
    ax.set_title(title or "The dispatch all-to-all: tokens from each rank to each rank")
    fig.tight_layout()
    return fig


def expert_load(per_source: Sequence[Sequence[int]], capacity: float | None = None, title: str = "") -> Figure:
    """Tokens each expert receives, stacked by the rank they came from (``per_source[rank][expert]``), with the
    mean load and, if given, the capacity above which a capacity-limited layer drops tokens."""
    load = np.asarray(per_source, dtype=float)
    if load.ndim != 2 or load.size == 0:
        raise ValueError(f"per_source must be one row of counts per rank; got shape {load.shape}")
    ranks, experts = load.shape
    fig, ax = plt.subplots(figsize=(max(6.0, 0.8 * experts + 3.0), 3.8))
    cmap = plt.get_cmap("tab10")
    bottom = np.zeros(experts)
    for rank in range(ranks):
        ax.bar(range(experts), load[rank], bottom=bottom, color=cmap(rank % 10), label=f"from rank {rank}")
        bottom += load[rank]
    for expert, total in enumerate(bottom):
        ax.text(expert, total, f"{total:.0f}", ha="center", va="bottom", fontsize=9)
    mean = bottom.mean()
    ax.axhline(mean, color="black", ls="--", lw=1, label=f"mean {mean:.1f} (max/mean {bottom.max() / mean:.2f})")
    if capacity is not None:
        ax.axhline(capacity, color=COLORS["store"], lw=1.5, label=f"capacity {capacity:.0f}: tokens above it dropped")
    ax.set_xticks(range(experts), [f"expert {e}" for e in range(experts)], fontsize=8)
    ax.set_ylabel("tokens routed to the expert")
    ax.set_ylim(0, 1.2 * max(bottom.max(), capacity or 0))
    ax.set_title(title or "Load per expert, by the rank each token came from")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    return fig
