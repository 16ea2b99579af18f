"""Drawings for the simulated cluster (notebook 14): memory per rank by category against the GPU's memory.

Example::

    dtlib.plots.cluster_memory({"64 ranks": dtlib.sim.step.simulate(LLAMA["7B"], dp=64)}, gpu_gib=80)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from dtlib.measure.peak import CATEGORIES

CATEGORY_COLORS = {"weights": "#4C72B0", "gradients": "#55A868", "optimizer": "#DD8452", "activations": "#C44E52",
                   "gathered and temporary": "#BBBBBB"}


def cluster_memory(results: Mapping[str, Any], gpu_gib: float | None = None, title: str = "") -> Figure:
    """One stacked bar per simulated (or live) step, ``dtlib.sim.step.Simulated`` s by label: rank 0's bytes at
    the peak by category, in GiB, the total on top, and a dashed line at ``gpu_gib``."""
    names = list(results)
    fig, ax = plt.subplots(figsize=(min(12.0, 3.5 + 1.6 * len(names)), 4.4))
    x = np.arange(len(names))
    bottom = np.zeros(len(names))
    for category in CATEGORIES:
        values = np.array([results[name].memory[category] for name in names]) / 2**30
        ax.bar(x, values, 0.55, bottom=bottom, color=CATEGORY_COLORS[category], label=category)
        bottom += values
    for i, total in enumerate(bottom):
        ax.text(i, total, f"{total:.1f}", ha="center", va="bottom", fontsize=9)
    if gpu_gib is not None:
        ax.axhline(gpu_gib, color="black", linestyle="--", linewidth=1.2, label=f"the GPU: {gpu_gib:g} GiB")
    ax.set_xticks(x, names)
    ax.set_ylabel("GiB per rank at the peak")
    ax.set_title(title or "Rank 0's memory at the step's peak, by what holds it")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)
    fig.tight_layout()
    return fig
