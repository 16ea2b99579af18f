"""Figures for notebooks 00 and 01: this machine, ranks around a store, DataParallel against DDP, launch times."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from dtlib.measure.machine import MachineInfo
from dtlib.plots._style import COLORS, _arrow, _box, _canvas


def machine(info: MachineInfo) -> Figure:
    """This machine as the course sees it: CPU cores, GPUs, and the backends torch has.

    Example: ``dtlib.plots.machine(dtlib.measure.machine.machine_info())``.
    """
    fig, ax = _canvas(9, 3.6, "What this machine offers for distributed training")
    cores = max(1, info.usable_cpus)
    shown = min(cores, 16)
    width = 4.2 / shown
    ax.text(0.2, 3.25, f"CPU: {info.usable_cpus} usable core(s)", fontsize=10)
    for i in range(shown):
        _box(ax, 0.2 + i * width, 2.4, width * 0.85, 0.6, str(i) if shown <= 16 else "", COLORS["cpu"])
    if cores > shown:
        ax.text(4.5, 2.7, f"+{cores - shown}", fontsize=9)
    ax.text(5.2, 3.25, f"GPUs: {info.gpu_count}", fontsize=10)
    if info.gpu_count:
        for i in range(min(info.gpu_count, 8)):
            _box(ax, 5.2 + i * 0.55, 2.4, 0.45, 0.6, f"{i}", COLORS["gpu"])
    else:
        _box(ax, 5.2, 2.4, 2.2, 0.6, "none: gloo on CPU", COLORS["off"])
    ax.text(0.2, 1.6, "torch.distributed backends", fontsize=10)
    for i, (name, available) in enumerate(info.backends.items()):
        _box(ax, 0.2 + i * 1.6, 0.6, 1.4, 0.7, f"{name}\n{'yes' if available else 'no'}",
             COLORS["gpu"] if available else COLORS["off"])
    ax.text(5.2, 1.0, f"torch {info.torch}\n{'CUDA ' + info.cuda_build if info.cuda_build else 'CPU-only build'}",
            fontsize=10, va="center")
    return fig


def ranks(results: Sequence[dict[str, Any]], port: int | None = None) -> Figure:
    """The ranks of one job: each process with its rank and pid, all meeting at the store.

    ``results`` are dicts with ``rank``, ``local_rank`` and ``pid`` (what
    :func:`dtlib.examples.hello.sum_of_ranks` returns).
    """
    n = len(results)
    fig, ax = _canvas(9, 4, f"One job, {n} processes: world_size = {n}")
    where = f"127.0.0.1:{port}" if port else "MASTER_ADDR:MASTER_PORT = 127.0.0.1:<free port>"
    _box(ax, 2.0, 3.3, 6.0, 0.7, f"TCPStore at {where}\nheld by the launching process", COLORS["store"])
    width = min(2.2, 9.0 / n)
    for i, result in enumerate(results):
        x = 0.5 + i * (9.0 / n)
        _box(ax, x, 0.6, width * 0.9, 1.2,
             f"rank {result['rank']}\nlocal_rank {result['local_rank']}\npid {result['pid']}", COLORS["rank"])
        _arrow(ax, (x + width * 0.45, 1.8), (5.0, 3.3), style="<|-|>", alpha=0.6)
    ax.text(5.0, 2.45, "1) rendezvous: every rank finds the others through the store",
            ha="center", fontsize=9, style="italic")
    ax.text(5.0, 0.15, "2) then data moves directly between ranks (gloo on CPU, NCCL on GPUs)",
            ha="center", fontsize=9, style="italic")
    return fig


def dp_vs_ddp(n_devices: int = 3) -> Figure:
    """DataParallel (one process, threads, device 0 gathers) beside DDP (one process per device)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    titles = ("nn.DataParallel: one process", "DistributedDataParallel: one process per device")
    for ax, title in zip((left, right), titles, strict=True):
        ax.set_xlim(0, 10)
        ax.set_ylim(0, 8)
        ax.axis("off")
        ax.set_title(title)
    _box(left, 0.3, 5.6, 9.4, 1.6, "1 Python process, 1 GIL:\nscatters inputs, replicates the model every step,\n"
         "gathers outputs and gradients on device 0", COLORS["store"])
    for i in range(n_devices):
        x = 0.5 + i * 3.2
        _box(left, x, 1.0, 2.6, 1.4, f"device {i}\nthread {i}" + ("\n(gathers: bottleneck)" if i == 0 else ""),
             COLORS["gpu"] if i else "#C44E52")
        _arrow(left, (5.0, 5.6), (x + 1.3, 2.4))
    left.text(5, 0.3, "every step: copy weights out, copy outputs and gradients back", ha="center", fontsize=9)
    for i in range(n_devices):
        x = 0.5 + i * 3.2
        _box(right, x, 4.6, 2.6, 2.2, f"rank {i}\nmodel replica\nown data shard\ndevice {i}", COLORS["rank"])
    for i in range(n_devices):  # the ring: each rank sends to the next, the last back to the first
        a, b = 0.5 + i * 3.2 + 1.6, 0.5 + ((i + 1) % n_devices) * 3.2 + 1.0
        _arrow(right, (a, 4.6), (b, 4.6), connectionstyle=f"arc3,rad={0.5 if b > a else -0.6}")
    right.text(5, 0.6, "only gradients travel: a ring all-reduce in buckets,\noverlapped with the backward pass",
               ha="center", fontsize=9)
    fig.tight_layout()
    return fig


def launch_times(timings: Sequence[Any]) -> Figure:
    """Median launch time per start method (from :func:`dtlib.bench.startup.measure`).

    The axis is linear and starts at 0, so a bar's length is its time: a launch that takes 2% of
    another's shows as a bar 2% as long, with its median and its ratio to plain ``mp.spawn`` beside it.
    """
    fig, ax = plt.subplots(figsize=(9, 0.9 + 0.55 * len(timings)))
    reference = next((t.median for t in timings if t.method == "mp.spawn"), None)
    labels = [t.label.replace(" (floor)", "") for t in timings]
    medians = [t.median for t in timings]
    colors = [COLORS["off"] if t.method == "mp.spawn" else COLORS["cpu"] for t in timings]
    bars = ax.barh(labels, medians, color=colors)
    for bar, value in zip(bars, medians, strict=True):
        ratio = f"  ({value / reference:.2f}x mp.spawn)" if reference else ""
        ax.text(bar.get_width() + max(medians) * 0.01, bar.get_y() + bar.get_height() / 2, f"{value:.3f} s{ratio}",
                va="center", fontsize=9)
    ax.set_xlim(0, max(medians) * 1.7)  # room for the longest bar's label
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the call to the results (median)")
    ax.set_title("Launching a one-all-reduce job on this machine")
    fig.tight_layout()
    return fig


# -- the ring simulator (dtlib.ring) ----------------------------------------------------------
