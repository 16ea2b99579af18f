"""``python -m dtlib.bench live``: what live ranks cost: a start, a trivial cell's round trip, and the check.

Measured in one process, warm (the forkserver running, torch imported): the median start of
:class:`dtlib.LiveRanks` against the median warm :func:`dtlib.spawn` of a trivial function, and
the median round trip of a trivial cell through ``ranks.run`` and through ``%%ranks`` (an
IPython shell in this process), against a target of 20 ms. ``nbdistributed``, the peer that
keeps workers alive behind IPython magics, is timed the same way where it is installed. Last, one
small all-reduce with the live ranks' collective check on (the default) and off (``--no-check``), and one
step of a stepped cell (``ranks.step()``: every rank moves past one all-reduce and pauses at the next), against
a target of 50 ms.
"""

from __future__ import annotations

import contextlib
import io
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

import torch

from dtlib.bench import _table
from dtlib.bench._table import Column
from dtlib.launch.spawn import spawn
from dtlib.live.ranks import LiveRanks

ROUND_TRIP_TARGET_MS = 20.0
STEP_TARGET_MS = 50.0


@dataclass(frozen=True)
class LiveTiming:
    """One measured quantity: its median in ms over ``samples``, and its target (None: for comparison)."""

    what: str
    median_ms: float | None
    samples: int
    target_ms: float | None = None
    note: str = ""


CHECK_CELL = "for _ in range(100):\n    dist.all_reduce(x)"  # 100 all-reduces of 4 floats


def _collective_check(world_size: int, samples: int) -> list[LiveTiming]:
    """One all-reduce of 4 floats on live ranks with the collective check and without, in ms (median of cells)."""
    cells = max(3, samples // 10)
    each = {}
    for checked in (True, False):
        with LiveRanks(world_size, check_collectives=checked) as ranks:
            ranks.run("x = torch.ones(4, device=device)")  # NCCL ranks: on their GPU
            ranks.run(CHECK_CELL)  # warm
            each[checked] = _median_ms(lambda ranks=ranks: ranks.run(CHECK_CELL), cells) / 100
    return [LiveTiming("all_reduce, collectives checked", each[True], cells * 100,
                       note=f"{each[True] / each[False]:.1f}x unchecked"),
            LiveTiming("all_reduce, --no-check", each[False], cells * 100)]


def _step_round_trip(world_size: int, samples: int) -> LiveTiming:
    """``ranks.step()`` in a cell of all-reduces of 4 floats: one round trip, both ranks paused again after it."""
    with LiveRanks(world_size) as ranks:
        ranks.run(f"for _ in range({samples + 2}):\n    dist.all_reduce(torch.ones(4, device=device))", step=True)
        ranks.step()  # warm
        median = _median_ms(ranks.step, samples)
        ranks.resume()
    return LiveTiming("ranks.step round trip", median, samples, STEP_TARGET_MS, "collectives checked")


def _median_ms(action: Callable[[], object], samples: int) -> float:
    times = []
    for _ in range(samples):
        began = time.perf_counter()
        action()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


def _trivial(rank: int, world_size: int) -> None:
    return None


def _magic_round_trip(world_size: int, samples: int) -> LiveTiming:
    try:
        from IPython.core.interactiveshell import InteractiveShell
    except ImportError:
        return LiveTiming("%%ranks cell round trip", None, 0, ROUND_TRIP_TARGET_MS, "IPython is not installed")
    shell = InteractiveShell.instance()
    quiet = contextlib.redirect_stdout(io.StringIO())
    with quiet:
        shell.run_cell("%load_ext dtlib")
        shell.run_cell(f"%ranks start {world_size}")
        try:
            shell.run_cell("%%ranks\nNone")  # warm
            median = _median_ms(lambda: shell.run_cell("%%ranks\nNone"), samples)
        finally:
            shell.run_cell("%ranks stop")
    return LiveTiming("%%ranks cell round trip", median, samples, ROUND_TRIP_TARGET_MS)


def _nbdistributed(world_size: int, samples: int) -> LiveTiming:
    try:
        import nbdistributed  # noqa: F401 - only its presence is checked here
    except ImportError:
        return LiveTiming("nbdistributed cell round trip", None, 0, None, "nbdistributed is not installed here")
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    with contextlib.redirect_stdout(io.StringIO()) as said:
        shell.run_cell("%load_ext nbdistributed")
        shell.run_cell(f"%dist_init --num-processes {world_size}")  # its workers run the `python` found on PATH
        try:
            ready_by = time.monotonic() + 120
            while time.monotonic() < ready_by:  # its first cells time out while the workers import torch
                said.seek(0)
                said.truncate()
                shell.run_cell("%%distributed\nNone")
                if "Error" not in said.getvalue():
                    break
            else:
                return LiveTiming("nbdistributed cell round trip", None, 0, None, "its workers did not answer")
            median = _median_ms(lambda: shell.run_cell("%%distributed\nNone"), samples)
        finally:
            shell.run_cell("%dist_shutdown")
    return LiveTiming("nbdistributed cell round trip", median, samples, note=f"nbdistributed {_version()}")


def _version() -> str:
    try:
        return version("nbdistributed")
    except PackageNotFoundError:
        return "(version unknown)"


def measure(world_size: int = 2, samples: int = 50, starts: int = 5) -> list[LiveTiming]:
    """Time live ranks against warm spawns, and a trivial cell's round trip (see the module docstring)."""
    spawn(_trivial, world_size)  # warm: the forkserver runs, torch is imported in it
    spawn_ms = _median_ms(lambda: spawn(_trivial, world_size), starts)
    start_ms = _median_ms(lambda: LiveRanks(world_size).close(), starts)
    with LiveRanks(world_size) as ranks:
        ranks.run("None")
        api_ms = _median_ms(lambda: ranks.run("None"), samples)
    return [
        LiveTiming(f"warm dtlib.spawn, {world_size} ranks", spawn_ms, starts),
        LiveTiming("warm LiveRanks start and close", start_ms, starts, note=f"{start_ms / spawn_ms:.2f}x spawn"),
        LiveTiming("ranks.run round trip", api_ms, samples, ROUND_TRIP_TARGET_MS),
        _magic_round_trip(world_size, samples),
        _nbdistributed(world_size, samples),
        *_collective_check(world_size, samples),
        _step_round_trip(world_size, samples),
    ]


def _met(row: LiveTiming) -> str | None:
    if row.target_ms is None or row.median_ms is None:
        return None
    return "yes" if row.median_ms <= row.target_ms else "NO"


COLUMNS = [
    Column("what", 32, lambda row: row.what, align="<"),
    Column("median ms", 9, lambda row: row.median_ms, ".2f"),
    Column("samples", 7, lambda row: row.samples),
    Column("target ms", 9, lambda row: row.target_ms, ".0f"),
    Column("met", 3, _met),
    Column("note", 4, lambda row: row.note, align="<"),
]


def format_table(rows: list[LiveTiming]) -> str:
    """The table ``python -m dtlib.bench live`` prints."""
    return _table.format_table(f"dtlib.bench live: torch {torch.__version__}, forkserver warm", COLUMNS, rows)


def as_records(rows: list[LiveTiming]) -> list[dict[str, object]]:
    """The rows for ``--json``, each with whether it met its target."""
    return _table.as_records(rows, met=_met)
