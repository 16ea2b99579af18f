"""Drawings of the collectives a cell called, in order, as the stepper saw them (notebook 15).

Example::

    trace = ranks.trace("model(x).sum().backward()")
    dtlib.plots.collective_order({"reshard after forward": trace.calls[0]})
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from dtlib.plots._style import COLORS

#: A collective's family (the start of its name) -> colour and the short name a box shows.
FAMILIES = {"all_gather": ("#4C72B0", "AG"), "reduce_scatter": ("#DD8452", "RS"), "all_reduce": ("#55A868", "AR"),
            "broadcast": ("#8172B3", "BC"), "scatter": ("#937860", "SC")}


def _family(op: str) -> str:
    return next((family for family in FAMILIES if op.startswith(family)), "other")


def collective_order(orders: Mapping[str, Sequence[Any]], labels: Sequence[str] | None = None,
                     title: str = "The collectives in the order one rank called them") -> Figure:
    """One row per entry of ``orders`` (a name -> one rank's :class:`dtlib.live.stepper.Call` list), one box per
    collective, left to right in calling order: its family's colour, short name and, under it, ``labels[i]`` of
    the row's i-th call where given, else the number of elements it gathers or reduces (its largest tensor's)."""
    rows = list(orders.items())
    longest = max((len(calls) for _, calls in rows), default=1)
    fig, ax = plt.subplots(figsize=(min(13.5, max(7.0, 0.75 * longest + 2.5)), 1.2 + 0.8 * len(rows)))
    for row, (_, calls) in enumerate(rows):
        y = len(rows) - 1 - row
        for index, call in enumerate(calls):
            family = _family(call.op)
            color, short = FAMILIES.get(family, (COLORS["off"], call.op[:3]))
            ax.add_patch(plt.Rectangle((index + 0.05, y + 0.12), 0.9, 0.76, fc=color, ec="black", lw=0.6))
            under = labels[index] if labels is not None and index < len(labels) else _elements(call)
            ax.text(index + 0.5, y + 0.6, short, ha="center", va="center", color="white", fontsize=9,
                    fontweight="bold")
            ax.text(index + 0.5, y + 0.3, under, ha="center", va="center", color="white", fontsize=7)
    ax.set_xlim(0, longest)
    ax.set_ylim(0, len(rows))
    ax.set_yticks([len(rows) - 1 - row + 0.5 for row in range(len(rows))], [name for name, _ in rows])
    ax.set_xticks([index + 0.5 for index in range(longest)], [f"#{index + 1}" for index in range(longest)])
    ax.set_xlabel("calls, numbered in the order the rank made them")
    ax.tick_params(length=0)
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    ax.set_title(textwrap.fill(title, 52))  # centred over the axes, which long row names push right
    used = sorted({_family(call.op) for _, calls in rows for call in calls} & set(FAMILIES))
    ax.legend(handles=[Patch(color=FAMILIES[family][0], label=f"{FAMILIES[family][1]}: {family}")
                       for family in used], fontsize=8, ncol=len(used) or 1, loc="upper center",
              bbox_to_anchor=(0.5, -0.35 if len(rows) > 1 else -0.55), frameon=False)
    fig.tight_layout()
    return fig


def _elements(call: Any) -> str:
    """The number of elements of the call's largest tensor (an all-gather's output, a reduce-scatter's input:
    the whole of what is gathered or reduced): ``float32[108], float32[54]`` -> ``108``."""
    return f"{max(call.elements()):,}" if call.tensors else ""
