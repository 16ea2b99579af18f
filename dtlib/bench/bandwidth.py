"""An nccl-tests-style sweep of one collective over message sizes.

For each size: warm-up iterations, then timed ones, each started together by a
barrier (not timed) and timed alone (CUDA events on GPUs, ``perf_counter`` on the
CPU); the row keeps the slowest rank's median. Bandwidths follow nccl-tests'
PERFORMANCE.md: algbw = S / t and busbw = algbw x factor, with S the buffer for
all-reduce and broadcast and the whole gathered (or scattered) buffer for
all-gather and reduce-scatter. Run it::

    python -m dtlib.bench allreduce --world-size 2 --min-bytes 1K --max-bytes 64M
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dtlib import compat, ring
from dtlib.bench._table import Column
from dtlib.bench._table import as_records as as_records
from dtlib.bench._table import format_table as _format_table
from dtlib.launch.device import rank_device
from dtlib.launch.spawn import spawn
from dtlib.measure.timing import slowest_median
from dtlib.ring import send_recv

OPS = ("allreduce", "allgather", "reducescatter", "broadcast")

BUS_FACTOR = ring.BUS_FACTOR  # re-exported: the sweep's rows use them
MODEL = ring.COLLECTIVE_MODEL


@dataclass
class Row:
    """One message size: S in bytes, its elements, and the slowest rank's median time."""

    op: str
    algo: str
    world_size: int
    size_bytes: int
    count: int
    dtype: str
    time_us: float
    algbw_gbs: float  # GB/s, 1 GB = 1e9 bytes
    busbw_gbs: float


def parse_size(text: str | int) -> int:
    """Bytes from "1K", "64M", "1G" (powers of 1024, as nccl-tests reads them) or a plain number.

    Example: ``parse_size("64M") == 64 * 2**20``.
    """
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)i?B?\s*", str(text), flags=re.IGNORECASE)
    if not match:
        raise ValueError(f"cannot read the size {text!r}: write a number with an optional K, M or G, e.g. 64M")
    return int(match.group(1)) * 1024 ** "_KMG".index(match.group(2).upper() or "_")


def sizes_between(min_bytes: int, max_bytes: int, world_size: int, itemsize: int = 4) -> list[int]:
    """Sizes doubling from ``min_bytes`` to ``max_bytes``, each a whole number of elements per rank."""
    if min_bytes < 1 or max_bytes < min_bytes:
        raise ValueError(f"need 1 <= min_bytes <= max_bytes, got {min_bytes} and {max_bytes}")
    unit = world_size * itemsize  # every rank gets the same whole number of elements
    sizes, size = [], min_bytes
    while size <= max_bytes:
        rounded = max(unit, size // unit * unit)
        if not sizes or rounded != sizes[-1]:
            sizes.append(rounded)
        size *= 2
    return sizes


def _clock(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    """A function that runs ``op`` once and returns its seconds, timed the right way for the device."""
    if device.type == "cuda":
        def timed(op: Callable[[], Any]) -> float:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            op()
            stop.record()
            stop.synchronize()
            return start.elapsed_time(stop) / 1e3  # ms -> s
        return timed

    def timed_cpu(op: Callable[[], Any]) -> float:
        start = time.perf_counter()
        op()
        return time.perf_counter() - start
    return timed_cpu


def _operation(op: str, algo: str, size_bytes: int, world_size: int, device: torch.device) -> Callable[[], Any]:
    count = size_bytes // 4  # float32 elements of S
    if op == "allreduce":
        buffer = torch.ones(count, device=device)
        if algo == "ring":
            return lambda: send_recv.ring_all_reduce(buffer)
        return lambda: dist.all_reduce(buffer)
    if op == "allgather":
        shard, gathered = torch.ones(count // world_size, device=device), torch.empty(count, device=device)
        return lambda: compat.all_gather_single(gathered, shard)
    if op == "reducescatter":
        full, shard = torch.ones(count, device=device), torch.empty(count // world_size, device=device)
        return lambda: compat.reduce_scatter_single(shard, full)
    if op == "broadcast":
        buffer = torch.ones(count, device=device)
        return lambda: dist.broadcast(buffer, src=0)
    raise ValueError(f"unknown operation {op!r}; choose one of {', '.join(OPS)}")


def _sweep_rank(rank: int, world_size: int, op: str, algo: str, sizes: list[int], iters: int,
                warmup: int) -> list[list[float]]:
    """This rank's seconds per timed call, one list per size."""
    device = rank_device()
    timed = _clock(device)
    per_size = []
    for size in sizes:
        run = _operation(op, algo, size, world_size, device)
        for _ in range(warmup):
            run()
        seconds = []
        for _ in range(iters):
            if device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()  # everyone starts together; not timed
            seconds.append(timed(run))
        per_size.append(seconds)
    return per_size


def sweep(op: str, world_size: int = 2, min_bytes: int | str = "1K", max_bytes: int | str = "64M", *,
          iters: int = 20, warmup: int = 5, algo: str = "library", **spawn_options: Any) -> list[Row]:
    """Time ``op`` ("allreduce", "allgather", "reducescatter", "broadcast") at doubling sizes.

    ``algo="ring"`` times ``dtlib.ring.send_recv.ring_all_reduce`` instead of the library's all-reduce.
    Example: ``sweep("allreduce", 2, "1K", "1M", iters=10)``.
    """
    if op not in OPS:
        raise ValueError(f"unknown operation {op!r}; choose one of {', '.join(OPS)}")
    if algo not in ("library", "ring"):
        raise ValueError(f"algo must be 'library' or 'ring', got {algo!r}")
    if algo == "ring" and op != "allreduce":
        raise ValueError("--algo ring is the send/recv ring all-reduce: use it with allreduce")
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got {iters} and {warmup}")
    sizes = sizes_between(parse_size(min_bytes), parse_size(max_bytes), world_size)
    per_rank = spawn(_sweep_rank, world_size, args=(op, algo, sizes, iters, warmup), **spawn_options)
    rows = []
    for i, size in enumerate(sizes):
        seconds = slowest_median(times[i] for times in per_rank)  # the collective ends with its slowest rank
        algbw = size / seconds / 1e9
        rows.append(Row(op, algo, world_size, size, size // 4, "float32", seconds * 1e6, algbw,
                        algbw * BUS_FACTOR[op](world_size)))
    return rows


def _reference_rank(rank: int, world_size: int, size: int, iters: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per all-reduce, three ways, one sample per each of ``rounds`` interleaved rounds.

    Each round times the sweep's method (a barrier, then one timed call; the median of
    ``iters``), the same for the send/recv ring, and a bare loop of ``iters`` calls timed
    as a whole. The order alternates from round to round so that drift and noise on a
    busy machine hit all three alike; the median over rounds (taken by the caller) throws out
    the unlucky ones.
    """
    device = rank_device()
    timed = _clock(device)
    library = _operation("allreduce", "library", size, world_size, device)
    by_ring = _operation("allreduce", "ring", size, world_size, device)

    def sweep_style(run: Callable[[], Any]) -> float:
        run()  # warm-up
        seconds = []
        for _ in range(iters):
            dist.barrier()
            seconds.append(timed(run))
        return statistics.median(seconds)

    def bare_loop() -> float:
        library()  # warm-up
        dist.barrier()
        return timed(lambda: [library() for _ in range(iters)]) / iters

    ways = {"sweep": lambda: sweep_style(library), "bare loop": bare_loop, "sweep, ring": lambda: sweep_style(by_ring)}
    samples: dict[str, list[float]] = {name: [] for name in ways}
    for round_index in range(rounds):
        names = list(ways) if round_index % 2 == 0 else list(reversed(ways))
        for name in names:
            samples[name].append(ways[name]())
    return samples


def reference(world_size: int = 2, size_bytes: int | str = "16M", *, iters: int = 10, rounds: int = 9,
              **spawn_options: Any) -> dict[str, float]:
    """busbw (GB/s) of the sweep's all-reduce, a bare timed loop of ``dist.all_reduce``, and the
    send/recv ring, measured in one run at one size: how much the benchmark itself costs.

    Example: ``reference(2, "16M")`` -> ``{"sweep": 1.5, "bare loop": 1.52, "sweep, ring": 1.1}``.
    """
    size = sizes_between(parse_size(size_bytes), parse_size(size_bytes), world_size)[0]
    per_rank = spawn(_reference_rank, world_size, args=(size, iters, rounds), **spawn_options)
    factor = BUS_FACTOR["allreduce"](world_size)
    return {name: size / slowest_median(r[name] for r in per_rank) / 1e9 * factor for name in per_rank[0]}


def fit(rows: list[Row]) -> ring.AlphaBeta:
    """The alpha-beta model of ``dtlib.ring`` fitted to a sweep's times: alpha read off the smallest
    sizes, the bandwidth b off the largest (``ring.fit_alpha_beta``), so that the model meets the
    sweep at both ends and predicts large buffers from the rate large buffers reached.

    Example: ``fit(sweep("allreduce")).bandwidth_bytes_per_s``.
    """
    return ring.fit_alpha_beta([r.size_bytes for r in rows], [r.time_us / 1e6 for r in rows],
                               algorithm=MODEL[rows[0].op], world_size=rows[0].world_size)


def format_table(rows: list[Row]) -> str:
    """An nccl-tests-like table: size, count, type, time (us), algbw and busbw (GB/s)."""
    first = rows[0]
    title = (f"dtlib.bench {first.op}{' --algo ring' if first.algo == 'ring' else ''}: "
             f"world_size={first.world_size}, torch {torch.__version__}, slowest rank's median per size")
    return _format_table(title, [
        Column("size", 12, lambda r: r.size_bytes), Column("count", 12, lambda r: r.count),
        Column("type", 8, lambda r: r.dtype), Column("time(us)", 11, lambda r: r.time_us, ".1f"),
        Column("algbw(GB/s)", 12, lambda r: r.algbw_gbs, ".3f"),
        Column("busbw(GB/s)", 12, lambda r: r.busbw_gbs, ".3f"),
    ], rows)


def format_comparison(rows: list[Row], others: list[Row], model: ring.AlphaBeta | None = None, last: int = 3) -> str:
    """Two sweeps of the same sizes side by side at their ``last`` largest sizes: busbw (GB/s) of each,
    the fitted model's busbw there, and the second sweep's share of the first one's rate.

    Example: ``print(format_comparison(library, by_ring, fit(library)))`` with
    ``library = sweep("allreduce")`` and ``by_ring = sweep("allreduce", algo="ring")``.
    """
    if [r.size_bytes for r in rows] != [r.size_bytes for r in others]:
        raise ValueError("the two sweeps must cover the same sizes")
    first, second = rows[0].algo, others[0].algo
    pairs = list(zip(rows[-last:], others[-last:], strict=True))
    columns = [Column("size", 8, lambda pair: f"{pair[0].size_bytes / 2**20:.0f} MiB")]
    if model is not None:
        columns.append(Column("model", 7, lambda pair: _model_busbw(model, pair[0]), ".2f"))
    columns += [Column(first, 8, lambda pair: pair[0].busbw_gbs, ".2f"),
                Column(second, 8, lambda pair: pair[1].busbw_gbs, ".2f"),
                Column(f"{second}/{first}", 14, lambda pair: pair[1].busbw_gbs / pair[0].busbw_gbs, ".2f")]
    return _format_table(f"busbw (GB/s) at the {last} largest sizes, {rows[0].op} on {rows[0].world_size} ranks",
                         columns, pairs)


def _model_busbw(model: ring.AlphaBeta, row: Row) -> float:
    """The busbw (GB/s) that ``model`` predicts at ``row``'s size."""
    seconds = model.time(MODEL[row.op], row.world_size, row.size_bytes)
    return row.size_bytes / seconds / 1e9 * BUS_FACTOR[row.op](row.world_size)
