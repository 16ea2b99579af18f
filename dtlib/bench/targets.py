"""The speed targets, measured with repeats and compared with their limits: ``python -m dtlib.bench check``.

The test gate (``make test``) never asserts a wall-clock time, so that a busy machine cannot fail correct
code. The targets live here instead. Each one is measured ``--repeats`` times in one run; its best attempt
(the least noisy estimate of a fixed cost on a shared machine) is printed beside its limit, and the command
exits 1 when any target misses. Run it on a quiet machine::

    python -m dtlib.bench check                      # every target (about 10 minutes; notebooks last)
    python -m dtlib.bench check --only spawn,ring    # a subset, by name

Targets (each a ratio or seconds, lower is better):

- ``spawn``: ``dtlib.spawn(start_method="spawn")`` within 1.15x of plain ``torch.multiprocessing.spawn``;
- ``forkserver``: a warm forkserver launch of 2 ranks in 0.15 s or less;
- ``overhead``: the all-reduce sweep within 5% of a bare ``dist.all_reduce`` loop at 16 MiB (bare / sweep);
- ``ring``: the send/recv ring all-reduce at half the library's bandwidth or better (library / ring <= 2);
- ``simulator``: the pure-Python ring simulator, 64 ranks x 2^20 float32, in 2 s or less;
- ``notebooks``: each notebook's Run All (a fresh kernel, every cell) within its ``time_budget_s``.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dtlib import arguments, ring
from dtlib.bench import bandwidth, startup
from dtlib.bench._table import Column
from dtlib.bench._table import format_table as _format_table


@dataclass(frozen=True)
class Result:
    """One target's outcome: the best of its attempts against its limit (both in ``unit``; lower is better)."""

    name: str
    what: str
    measured: float
    limit: float
    unit: str  # "x" for a ratio, "s" for seconds
    attempts: tuple[float, ...]

    @property
    def met(self) -> bool:
        return self.measured <= self.limit


def best_of(name: str, what: str, limit: float, unit: str, attempts: Iterable[float]) -> Result:
    """The target's result from its attempts: the smallest one counts.

    Example: ``best_of("x", "a ratio", 1.15, "x", [1.3, 1.1]).met`` -> True.
    """
    values = tuple(float(a) for a in attempts)
    if not values:
        raise ValueError(f"target {name!r}: no attempt was measured")
    return Result(name, what, min(values), limit, unit, values)


def _spawn(repeats: int) -> list[Result]:
    ratios = []
    for _ in range(repeats):
        timings = {t.method: t for t in startup.measure(world_size=2, repeats=3, methods=["spawn", "mp.spawn"])}
        ratios.append(min(timings["spawn"].seconds) / min(timings["mp.spawn"].seconds))
    return [best_of("spawn", 'spawn(start_method="spawn") / torch.multiprocessing.spawn', 1.15, "x", ratios)]


def _forkserver(repeats: int) -> list[Result]:
    medians = [startup.measure(world_size=2, repeats=5, methods=["forkserver"])[0].median for _ in range(repeats)]
    return [best_of("forkserver", "a warm forkserver launch of 2 ranks (median of 5)", 0.15, "s", medians)]


def _overhead_and_ring(repeats: int) -> list[Result]:
    overheads, ring_ratios = [], []
    for _ in range(repeats):
        busbw = bandwidth.reference(2, "16M", output="none")  # GB/s, each the median of interleaved rounds
        overheads.append(busbw["bare loop"] / busbw["sweep"])
        ring_ratios.append(busbw["sweep"] / busbw["sweep, ring"])
    return [best_of("overhead", "bare dist.all_reduce loop / the sweep, busbw at 16 MiB", 1.05, "x", overheads),
            best_of("ring", "the library's all_reduce / the send/recv ring, busbw at 16 MiB", 2.0, "x",
                    ring_ratios)]


def _simulator(repeats: int) -> list[Result]:
    inputs = list(np.ones((64, 2**20), dtype=np.float32))
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        trace = ring.simulate_all_reduce(inputs, keep_buffers=False)
        seconds.append(time.perf_counter() - start)
        if not (trace.outputs[17] == 64).all():
            raise AssertionError("the simulator's all-reduce gave a wrong sum")
    return [best_of("simulator", "ring.simulate_all_reduce, 64 ranks x 2^20 float32", 2.0, "s", seconds)]


def notebook_seconds(path: Path, timeout_s: float = 600.0, *, store: bool = False) -> float:
    """Seconds to run every cell of the notebook at ``path`` in a fresh kernel started in its folder; with
    ``store``, its outputs are written back into the file (``make notebooks``: the one program besides the
    tests that runs the notebooks). Example: ``notebook_seconds(Path("notebooks/00_setup_check.ipynb"))``."""
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=timeout_s, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    # The kernel's own stderr (not the cells' outputs) would fill the table's terminal: 01 shows on purpose
    # how mp.spawn fails from a notebook, and those children print to the kernel's stderr.
    client.execute(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    if store:
        nbformat.write(notebook, path)
    return seconds


def _notebooks(repeats: int, folder: Path) -> list[Result]:
    paths = sorted(folder.glob("[0-9][0-9]_*.ipynb"))
    if not paths:
        raise FileNotFoundError(f"no notebooks in {folder}: run the check from the repository root, "
                                "or pass --notebooks DIR")
    results = []
    for path in paths:
        budget_s = json.loads(path.read_text())["metadata"]["dtlib"]["time_budget_s"]
        seconds = [notebook_seconds(path) for _ in range(repeats)]
        results.append(best_of(f"notebooks/{path.name}", "Run All in a fresh kernel", budget_s, "s", seconds))
    return results


TARGETS: dict[str, Callable[..., list[Result]]] = {
    "spawn": _spawn, "forkserver": _forkserver, "overhead": _overhead_and_ring, "ring": _overhead_and_ring,
    "simulator": _simulator, "notebooks": _notebooks,
}


def run(only: Iterable[str] | None = None, repeats: int = 3, notebooks: Path = Path("notebooks")) -> list[Result]:
    """Measure the chosen targets (every one by default), each function once even where it gives two targets.

    Example: ``run(["simulator"], repeats=2)`` -> ``[Result(name="simulator", measured=0.9, limit=2.0, ...)]``.
    """
    names = list(TARGETS) if only is None else list(only)
    unknown = sorted(set(names) - set(TARGETS))
    if unknown:
        raise ValueError(f"unknown target(s) {', '.join(unknown)}; choose from {', '.join(TARGETS)}")
    repeats = arguments.count("repeats", repeats, 1)
    results: list[Result] = []
    for measure in dict.fromkeys(TARGETS[name] for name in names):  # in order, without repeats
        if measure is _notebooks:
            found = _notebooks(1, notebooks)  # one Run All each: a notebook takes a minute, not milliseconds
        else:
            found = measure(repeats)
        results += [r for r in found if r.name.split("/")[0] in names]
    return results


def format_table(results: list[Result]) -> str:
    """One line per target: name, best measured value, limit, met or MISSED, every attempt, what was measured;
    then how many targets were met."""
    missed = [r.name for r in results if not r.met]
    return _format_table(
        "dtlib.bench check: each target's best attempt against its limit (lower is better)",
        [Column("target", 0, lambda r: r.name, align="<"), Column("best", 8, lambda r: f"{r.measured:.3g}{r.unit}"),
         Column("limit", 8, lambda r: f"{r.limit:.3g}{r.unit}"),
         Column("status", 6, lambda r: "met" if r.met else "MISSED", align="<"),
         Column("attempts ; what", 0, lambda r: f"{', '.join(f'{a:.3g}' for a in r.attempts)} ; {r.what}",
                align="<")],
        results,
        footer=f"{len(results) - len(missed)} of {len(results)} targets met"
               + (f"; missed: {', '.join(missed)}" if missed else ""))
