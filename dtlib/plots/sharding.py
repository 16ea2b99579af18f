"""Drawings for FSDP: who holds which rows of a parameter, model-state bytes per strategy, traffic.

Example::

    rows = dtlib.train.fsdp_compare.strategies(world_size=2)
    dtlib.plots.memory_bars(rows)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from dtlib.measure import memory
from dtlib.plots._style import RANK_COLORS, tick_names
from dtlib.sim.llama import LLAMA, llama_like
from dtlib.train.guide import CHECKPOINTING, CHOICES, recommend

PART_COLORS = {"parameters": "#4C72B0", "gradients": "#55A868", "optimizer_state": "#DD8452", "gathered": "#BBBBBB"}


def shard(full_shape: Sequence[int], world_size: int, name: str = "a parameter") -> Figure:
    """A (rows, columns) parameter cut into ``world_size`` blocks of rows: FSDP2's ``Shard(0)``.

    Rank r holds rows ceil(R/N)*r up to ceil(R/N)*(r+1); the last shard is padded where R does not divide.
    """
    rows = full_shape[0]
    cols = full_shape[1] if len(full_shape) > 1 else 1
    per_rank = -(-rows // world_size)  # ceil: torch.chunk's split
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    for rank in range(world_size):
        start, stop = rank * per_rank, min(rows, (rank + 1) * per_rank)
        if start >= stop:
            continue
        ax.add_patch(plt.Rectangle((0, start), cols, stop - start, color=RANK_COLORS[rank % len(RANK_COLORS)],
                                   alpha=0.85))
        ax.text(cols / 2, (start + stop) / 2, f"rank {rank}: rows {start}..{stop - 1}", ha="center", va="center",
                color="white", fontsize=10)
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)
    ax.set_xlabel(f"columns ({cols})")
    ax.set_ylabel(f"rows ({rows})")
    ax.set_title(f"{name} {tuple(full_shape)} sharded over {world_size} ranks:\neach keeps only its rows")
    fig.tight_layout()
    return fig


def memory_bars(rows: Sequence[Any], title: str = "") -> Figure:
    """Model-state bytes per rank for each strategy (``dtlib.train.fsdp_compare.StrategyRow`` s), two bars each.

    Left, measured: at rest (stacked: parameters, gradients, optimizer state), and on top (grey, hatched) the
    weights gathered between forward and backward; FSDP1 hides those in its own buffers, so its bar says so.
    Right, an outlined bar: the formula for the same setting at its peak (``row.estimate``).
    On GPU ranks a black diamond marks CUDA's ``max_memory_allocated`` on rank 0 (``row.cuda_memory``): model
    state plus activations and communication buffers, which the formulas leave out.
    """
    fig, ax = plt.subplots(figsize=(min(14.0, 3.0 + 1.5 * len(rows)), 4.2))
    x = np.arange(len(rows))
    width = 0.38
    bottom = np.zeros(len(rows))
    for part in ("parameters", "gradients", "optimizer_state"):
        values = np.array([r.at_rest_parts[part] for r in rows]) / 1e3
        ax.bar(x - width / 2, values, width, bottom=bottom, color=PART_COLORS[part],
               label=f"measured: {part.replace('_', ' ')}")
        bottom += values
    gathered = np.array([(r.peak - r.at_rest) if r.peak is not None else 0 for r in rows]) / 1e3
    ax.bar(x - width / 2, gathered, width, bottom=bottom, color=PART_COLORS["gathered"], hatch="//",
           label="measured: weights gathered\nbetween forward and backward")
    formula = np.array([r.estimate for r in rows]) / 1e3
    ax.bar(x + width / 2, formula, width, fill=False, edgecolor="black", linestyle="--", linewidth=1.2,
           label="formula at the peak")
    cuda = [r.cuda_memory["peak"] / 1e3 if getattr(r, "cuda_memory", None) else np.nan for r in rows]
    if not np.all(np.isnan(cuda)):
        ax.plot(x - width / 2, cuda, "kD", label="CUDA max_memory_allocated\n(the allocator's peak)")
    for i, row in enumerate(rows):
        if row.peak is None:
            ax.text(x[i] - width / 2, bottom[i], "peak not\nvisible\n(FSDP1)", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, tick_names([r.label for r in rows]), fontsize=8)
    ax.set_ylabel("kB per rank (1 kB = 1000 bytes)")
    ax.set_ylim(0, 1.2 * np.nanmax([*(bottom + gathered), *formula, *cuda]))
    ax.set_title(title or f"Model state per rank, {rows[0].world_size} ranks, fp32 + Adam: measured | formula")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    return fig


def comm_bars(rows: Sequence[Any], sent_per_rank: Mapping[str, float] | None = None, title: str = "") -> Figure:
    """Bytes per step by collective (buffer size S, as nccl-tests counts it) for each strategy, and, if
    given, the bytes one rank sends on a ring as a fourth, hatched bar in each group."""
    kinds = ("all_reduce", "all_gather", "reduce_scatter")
    series = len(kinds) + (sent_per_rank is not None)
    fig, ax = plt.subplots(figsize=(min(14.0, 3.0 + 1.5 * len(rows)), 4.0))
    x = np.arange(len(rows))
    width = 0.8 / series
    for i, kind in enumerate(kinds):
        values = [r.comm.get(kind, {"bytes": 0})["bytes"] / 1e3 for r in rows]
        ax.bar(x + (i - (series - 1) / 2) * width, values, width, label=f"{kind.replace('_', '-')} buffer S")
    if sent_per_rank is not None:
        ax.bar(x + (series - 1) / 2 * width, [sent_per_rank[r.label] / 1e3 for r in rows], width, color="white",
               edgecolor="black", hatch="xx", label="sent by one rank\n(ring, all collectives)")
    ax.set_xticks(x, tick_names([r.label for r in rows]), fontsize=8)
    ax.set_ylabel("kB per training step (1 kB = 1000 bytes)")
    ax.set_title(title or "Collectives per step, measured by counting the calls")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    return fig


def zero_stages(num_params: float, world_size: int, **bytes_per_param: float) -> Figure:
    """The ZeRO formula's bytes per rank for each stage, in GB (1e9 bytes), as bars."""

    stages = memory.STRATEGIES
    gb = [memory.estimate(num_params, world_size, s, **bytes_per_param) / 1e9 for s in stages]
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    bars = ax.bar(["DDP", "ZeRO-1\n(optimizer)", "ZeRO-2\n(+ gradients)", "ZeRO-3 / FULL_SHARD\n(+ parameters)"], gb,
                  color=["#8C8C8C", "#DD8452", "#55A868", "#4C72B0"])
    for bar, value in zip(bars, gb, strict=True):
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{value:.1f} GB", ha="center", va="bottom")
    ax.set_ylabel("model state per rank (GB)")
    ax.set_title(f"{num_params / 1e9:g}B parameters on {world_size} ranks, mixed-precision Adam")
    fig.tight_layout()
    return fig


def guide_bars(advice: Any, title: str = "") -> Figure:
    """Model state per GPU under each GPU candidate (a ``dtlib.train.guide.Recommendation``), the budget left
    after the activations as a line, the chosen strategy highlighted; below, the host RAM per node that
    CPU offload needs against the usable RAM."""
    names = list(advice.gb_per_gpu)
    values = [advice.gb_per_gpu[name] for name in names]
    chosen = advice.choice.removesuffix(CHECKPOINTING)  # the bar of the model state it holds
    fig, ax = plt.subplots(figsize=(8, 4.2))
    colors = ["#55A868" if name == chosen else ("#4C72B0" if v <= advice.budget_gb else "#BBBBBB")
              for name, v in zip(names, values, strict=True)]
    ax.barh(names, values, color=colors)
    if advice.budget_gb > 0:  # activations that fill the GPU leave no budget to draw on a log axis
        ax.axvline(advice.budget_gb, color="#C44E52", ls="--",
                   label=f"budget {advice.budget_gb:.0f} GB (after activations)")
    if advice.checkpointing_budget_gb > max(advice.budget_gb, 0):
        ax.axvline(advice.checkpointing_budget_gb, color="#C44E52", ls=":",
                   label=f"{advice.checkpointing_budget_gb:.0f} GB with activation checkpointing")
    for i, value in enumerate(values):
        ax.text(value, i, f" {value:.1f} GB", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    shown = [v for v in values + [advice.budget_gb, advice.checkpointing_budget_gb] if v > 0]
    ax.set_xlim(min(shown) / 2, max(shown) * 4)
    ax.set_xlabel("model state per GPU (GB, log scale)")
    ax.set_title(title or f"Recommended: {advice.choice}")
    if ax.get_legend_handles_labels()[0]:  # no line where the activations leave no budget
        ax.legend(fontsize=8, loc="lower right")
    fits = "fits" if advice.host_gb_per_node <= advice.host_budget_gb else "does not fit"
    fig.text(0.01, 0.01, f"Chosen: {advice.choice}. CPU offload needs {advice.host_gb_per_node:.0f} GB of host RAM "
             f"per node: it {fits} the {advice.host_budget_gb:.0f} GB usable.", fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def guide_grid(rows: Sequence[Mapping[str, Any]], title: str = "") -> Figure:
    """``dtlib.train.guide.table()`` as a grid: model size down, GPU memory across, the choice in each cell."""

    sizes = sorted({r["params_b"] for r in rows})
    mems = sorted({r["gpu_gb"] for r in rows})
    fig, ax = plt.subplots(figsize=(2.2 + 2.6 * len(mems), 0.6 + 0.45 * len(sizes)))
    grid = np.zeros((len(sizes), len(mems)))
    for r in rows:
        grid[sizes.index(r["params_b"]), mems.index(r["gpu_gb"])] = CHOICES.index(r["choice"])
    ax.imshow(grid, cmap="YlGnBu", vmin=0, vmax=len(CHOICES), aspect="auto", alpha=0.7)
    for r in rows:
        ax.text(mems.index(r["gpu_gb"]), sizes.index(r["params_b"]), r["choice"], ha="center", va="center",
                fontsize=8, color="black")
    ax.set_xticks(range(len(mems)), [f"{m:g} GB GPUs" for m in mems])
    ax.set_yticks(range(len(sizes)), [f"{s:g}B params" for s in sizes])
    ax.set_title(title or "Strategy by model size, one node of 8 GPUs, mixed-precision AdamW")
    fig.tight_layout()
    return fig


LIKE = "a Llama-like shape of this size"  # the calculator's activations by default: see dtlib.sim.llama.llama_like


def guide_calculator() -> object:
    """An ipywidgets calculator: sliders for model size, GPU memory, GPU count, nodes, host RAM and the link
    between nodes; the optimizer, the precision, and the activations for the tokens per GPU (of a Llama-like shape of
    the chosen size, of a Llama 2 shape, which then sets the size, or the 30% rule of thumb); the callback draws
    :func:`dtlib.plots.guide_bars`.
    Show it as a notebook cell's value."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    def draw(params_b: float, gpu_memory_gb: int, num_gpus: int, nodes: int, host_memory_gb: int,
             inter_node_gb_per_s: float, optimizer: str, precision: str, activations: str, tokens_per_gpu: int
             ) -> None:
        if num_gpus % nodes:
            num_gpus = max(nodes, num_gpus // nodes * nodes)  # keep GPUs evenly split over nodes
        shape = LLAMA.get(activations.removeprefix("Llama 2 "))
        if shape is not None:
            params_b = shape.params / 1e9
        elif activations == LIKE:
            shape = llama_like(params_b * 1e9)
        advice = recommend(params_b * 1e9, gpu_memory_gb, num_gpus, nodes=nodes, host_memory_gb=host_memory_gb,
                           inter_node_gb_per_s=inter_node_gb_per_s, optimizer=optimizer,
                           mixed_precision=precision == "bf16 compute", shape=shape,
                           tokens_per_gpu=tokens_per_gpu if shape is not None else None)
        counted = (f", activations {advice.activation_gb['without checkpointing']:.0f} GB per GPU "
                   f"({advice.activation_gb['with checkpointing']:.0f} checkpointed)" if advice.activation_gb else "")
        title = (f"{params_b:.3g}B parameters, {num_gpus} x {gpu_memory_gb} GB GPUs on {nodes} node(s), {optimizer}, "
                 f"{precision}\n{host_memory_gb} GB host RAM per node, {inter_node_gb_per_s:g} GB/s between nodes"
                 f"{counted}")
        guide_bars(advice, title=title)
        plt.show()

    return widgets.interactive(
        draw,
        params_b=widgets.FloatLogSlider(value=7, base=10, min=-1, max=3, step=0.05, description="params (B)"),
        gpu_memory_gb=widgets.SelectionSlider(options=[16, 24, 40, 48, 80, 96, 141, 192], value=80,
                                              description="GPU GB"),
        num_gpus=widgets.SelectionSlider(options=[1, 2, 4, 8, 16, 32, 64, 128, 256], value=8, description="GPUs"),
        nodes=widgets.SelectionSlider(options=[1, 2, 4, 8, 16, 32], value=1, description="nodes"),
        host_memory_gb=widgets.SelectionSlider(options=[256, 512, 1000, 2000, 4000], value=1000,
                                               description="host GB"),
        inter_node_gb_per_s=widgets.SelectionSlider(options=[1.5, 6.25, 12.5, 25, 50], value=50,
                                                    description="link GB/s"),
        optimizer=widgets.Dropdown(options=["adamw", "sgd"], value="adamw", description="optimizer"),
        precision=widgets.Dropdown(options=["bf16 compute", "fp32"], value="bf16 compute", description="precision"),
        activations=widgets.Dropdown(options=[LIKE, "30% rule of thumb", "Llama 2 7B", "Llama 2 13B", "Llama 2 70B"],
                                     value=LIKE, description="activations"),
        tokens_per_gpu=widgets.SelectionSlider(options=[1024, 2048, 4096, 8192, 16384, 32768, 65536], value=4096,
                                               description="tokens/GPU"),
    )
