"""What every figure module shares: the palette, wrapped tick names, and boxes and arrows for diagrams."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

COLORS = {"cpu": "#4C72B0", "gpu": "#55A868", "off": "#BBBBBB", "store": "#DD8452", "rank": "#8172B3"}
#: One colour per rank, rank r taking RANK_COLORS[r % 8], in every figure that colours ranks.
RANK_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]


def tick_names(names: Sequence[str], width: int = 14) -> list[str]:
    """Category names wrapped onto lines of at most ``width`` characters, so that neighbouring tick labels
    do not run into each other ("FSDP2 no reshard after forward" becomes three lines)."""
    return [name if "\n" in name else textwrap.fill(name, width) for name in names]


def _box(ax: Any, x: float, y: float, w: float, h: float, text: str, color: str, **text_kw: Any) -> None:
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", fc=color, ec="black", alpha=0.85))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", color="white", fontsize=9, **text_kw)


def _arrow(ax: Any, start: tuple[float, float], end: tuple[float, float], style: str = "-|>", **kw: Any) -> None:
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=12, color="black", lw=1.2, **kw))


def _canvas(width: float, height: float, title: str) -> tuple[Figure, Any]:
    fig, ax = plt.subplots(figsize=(width, height))
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 10 * height / width)
    ax.axis("off")
    ax.set_title(title)
    return fig, ax
