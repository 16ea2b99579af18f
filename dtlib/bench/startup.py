"""Start-up cost: the time from the call to the returned results of a tiny job, per start method.

The job initialises the process group, does one all-reduce of one number and
returns. Plain ``torch.multiprocessing.spawn`` of a module-level function is the
floor dtlib's launcher adds to. Run it::

    python -m dtlib.bench launch --world-size 2 --repeats 5
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import platform
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing

import dtlib
from dtlib import arguments, compat
from dtlib.bench._table import Column
from dtlib.bench._table import as_records as _as_records
from dtlib.bench._table import format_table as _format_table
from dtlib.examples.hello import sum_of_ranks
from dtlib.launch.processes import free_port

# Measured in this order: the forkserver's first call must come before any other use of it.
# "accelerate" (its fork-based notebook_launcher) is measured when accelerate is installed.
METHODS = ("forkserver-first", "forkserver", "fork", "spawn", "mp.spawn", "accelerate")
LABELS = {
    "forkserver-first": "dtlib forkserver, first call (starts the server)",
    "forkserver": "dtlib forkserver, warm",
    "fork": "dtlib fork",
    "spawn": "dtlib spawn",
    "mp.spawn": "torch.multiprocessing.spawn (floor)",
    "accelerate": "accelerate.notebook_launcher (fork)",
}


# The methods whose first launch warms the next: the forkserver (started, torch imported), and fork and accelerate,
# which fork this process (its imports done, its pages shared). spawn and mp.spawn start fresh interpreters each
# time, from a page cache that this process's own torch import has already filled: a warm-up would cost one more
# launch (4 s here) and warm nothing.
_WARMED = frozenset({"forkserver", "fork", "accelerate"})


def default_methods() -> list[str]:
    """Every method, less ``accelerate`` when it is not installed."""
    have_accelerate = importlib.util.find_spec("accelerate") is not None
    return [m for m in METHODS if m != "accelerate" or have_accelerate]


@dataclass
class LaunchTiming:
    """Seconds from the call to the results, one entry per launch."""

    method: str
    seconds: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def label(self) -> str:
        return LABELS[self.method]


def _mp_spawn_job(rank: int, world_size: int, port: int) -> None:
    """The same job for plain mp.spawn, which can neither set the environment nor return."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    compat.destroy_process_group()


def _accelerate_job() -> None:
    """The same job for accelerate's notebook_launcher, which sets the environment itself."""
    dist.init_process_group("gloo")
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value)
    compat.destroy_process_group()


def time_once(method: str, world_size: int) -> float:
    """Seconds for one launch of the one-all-reduce job with ``method``."""
    start = time.perf_counter()
    if method == "mp.spawn":
        torch.multiprocessing.spawn(_mp_spawn_job, args=(world_size, free_port()), nprocs=world_size)
    elif method == "accelerate":
        from accelerate import notebook_launcher

        with contextlib.redirect_stdout(io.StringIO()):  # it announces every launch
            notebook_launcher(_accelerate_job, num_processes=world_size, use_port=str(free_port()))
    else:
        start_method = "forkserver" if method == "forkserver-first" else method
        results = dtlib.spawn(sum_of_ranks, world_size, start_method=start_method, backend="gloo", output="none")
        assert results[0]["sum"] == world_size * (world_size - 1) // 2
    return time.perf_counter() - start


def measure(world_size: int = 2, repeats: int = 5, methods: list[str] | None = None) -> list[LaunchTiming]:
    """Time every method ``repeats`` times, after one untimed warm-up of those a launch warms (``_WARMED``;
    ``forkserver-first`` is the forkserver's first call, timed once).

    Interleaving (round after round, each method once per round) spreads the
    machine's noise over all methods alike, so their ratios are fair.

    Example: ``measure(2, repeats=3, methods=["forkserver", "fork"])``.
    """
    methods = default_methods() if methods is None else list(methods)
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise ValueError(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
    if not methods:
        raise ValueError(f"no method to measure; choose from {', '.join(METHODS)}")
    if "accelerate" in methods and "accelerate" not in default_methods():
        raise ValueError("method 'accelerate' needs the accelerate package, which is not installed")
    repeats, world_size = arguments.count("repeats", repeats, 1), arguments.count("world_size", world_size, 1)
    timings = {method: LaunchTiming(method, []) for method in methods}
    if "forkserver-first" in timings:
        timings["forkserver-first"].seconds.append(time_once("forkserver-first", world_size))
    for method in methods:  # one untimed warm-up each where a launch leaves something warm for the next
        if method in _WARMED:
            time_once(method, world_size)
    for _ in range(repeats):
        for method in methods:
            if method != "forkserver-first":
                timings[method].seconds.append(time_once(method, world_size))
    return list(timings.values())


def as_records(timings: list[LaunchTiming], world_size: int) -> list[dict[str, object]]:
    """Plain dicts for ``--json``: each method, its label, the world size, median, min, max and every time."""
    return _as_records(timings, label=lambda t: t.label, world_size=lambda t: world_size,
                       median_s=lambda t: t.median, min_s=lambda t: min(t.seconds), max_s=lambda t: max(t.seconds),
                       seconds=lambda t: t.seconds)


def format_table(timings: list[LaunchTiming], world_size: int) -> str:
    """An nccl-tests-like table with the ratio to plain mp.spawn where it was measured."""
    floor = next((t.median for t in timings if t.method == "mp.spawn"), None)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return _format_table(
        f"dtlib.bench launch: world_size={world_size}, one gloo all-reduce per job, "
        f"torch {torch.__version__}, Python {platform.python_version()}, {cpus} CPUs",
        [Column("method", 50, lambda t: t.label, align="<"), Column("n", 3, lambda t: len(t.seconds)),
         Column("median_s", 9, lambda t: t.median, ".3f"), Column("min_s", 8, lambda t: min(t.seconds), ".3f"),
         Column("max_s", 8, lambda t: max(t.seconds), ".3f"),
         Column("vs mp.spawn", 12, lambda t: t.median / floor if floor else None, ".2f", "x")],
        timings)
