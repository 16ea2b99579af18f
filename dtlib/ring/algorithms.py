"""The all-reduce algorithms, each a list of simulated steps, and the bytes each one sends.

Every function takes one sequence per rank and returns a :class:`dtlib.ring.simulator.Trace`;
``ALL_REDUCE_ALGORITHMS`` names the all-reduces and ``traffic_table`` compares them::

    simulate_all_reduce([[1, 2], [3, 4]]).outputs    # [array([4, 6]), array([4, 6])]
    traffic_table([4])["ring all-reduce"]             # [1.5]: 2(N-1)/N x S
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from dtlib.ring.simulator import Simulation, Trace, as_arrays, largest_power_of_two, start


def _ring_reduce_scatter(sim: Simulation) -> None:
    n = len(sim.buffers)
    for s in range(n - 1):  # rank r passes chunk r-1-s on; after N-1 steps it holds chunk r, fully reduced
        sim.step("reduce-scatter", [(r, (r + 1) % n, (r - 1 - s) % n, "add") for r in range(n)])


def _ring_all_gather(sim: Simulation) -> None:
    n = len(sim.buffers)
    for s in range(n - 1):  # rank r passes on chunk r-s, the one it completed or received last
        sim.step("all-gather", [(r, (r + 1) % n, (r - s) % n, "copy") for r in range(n)])


def simulate_all_reduce(inputs: Sequence[Any], *, itemsize: int = 4, keep_buffers: bool = True) -> Trace:
    """Ring all-reduce: 2(N-1) steps, each rank sending 2(N-1)/N x S bytes in all.

    ``inputs``: one equal-length sequence per rank (lists, NumPy arrays or tensors).
    ``itemsize``: bytes per element for the traffic counts (4 = float32).
    ``keep_buffers=False`` skips the per-step snapshots (for large N and lengths).

    Example: ``simulate_all_reduce([[1, 2], [3, 4]]).outputs`` is ``[array([4, 6]), array([4, 6])]``.
    """
    sim = start(inputs, itemsize, keep_buffers)
    _ring_reduce_scatter(sim)
    _ring_all_gather(sim)
    return sim.trace("ring all-reduce", [b.copy() for b in sim.buffers])


def simulate_reduce_scatter(inputs: Sequence[Any], *, itemsize: int = 4, keep_buffers: bool = True) -> Trace:
    """Ring reduce-scatter: N-1 steps; rank r ends with chunk r of the sum (``.outputs[r]``).

    Example: ``simulate_reduce_scatter([[1, 2], [3, 4]]).outputs`` is ``[array([4]), array([6])]``.
    """
    sim = start(inputs, itemsize, keep_buffers)
    _ring_reduce_scatter(sim)
    outputs = [sim.buffers[r][sim.span(r)].copy() for r in range(len(sim.buffers))]
    return sim.trace("ring reduce-scatter", outputs)


def simulate_all_gather(shards: Sequence[Any], *, itemsize: int = 4, keep_buffers: bool = True) -> Trace:
    """Ring all-gather: N-1 steps; every rank ends with all shards, concatenated in rank order.

    ``shards[r]`` is rank r's piece; pieces may differ in length (as uneven chunks do).

    Example: ``simulate_all_gather([[1], [2, 3]]).outputs`` is ``[array([1, 2, 3])] * 2``.
    """
    if itemsize < 1:
        raise ValueError(f"itemsize must be a positive number of bytes, got {itemsize}")
    pieces = as_arrays(shards, equal_lengths=False)
    n = len(pieces)
    stops = np.cumsum([len(p) for p in pieces])
    bounds = [(int(stop - len(p)), int(stop)) for p, stop in zip(pieces, stops, strict=True)]
    buffers = [np.zeros(int(stops[-1]), dtype=pieces[0].dtype) for _ in range(n)]
    contributions = np.zeros((n, n), dtype=np.int64)
    for rank, piece in enumerate(pieces):
        buffers[rank][bounds[rank][0]:bounds[rank][1]] = piece
        contributions[rank, rank] = 1
    sim = Simulation(buffers, bounds, itemsize, keep_buffers, contributions)
    _ring_all_gather(sim)
    return sim.trace("ring all-gather", [b.copy() for b in sim.buffers])


def simulate_naive_all_reduce(inputs: Sequence[Any], *, itemsize: int = 4, keep_buffers: bool = True) -> Trace:
    """Naive all-reduce: in one step every rank sends its whole buffer to every other: (N-1) x S each.

    Example: ``simulate_naive_all_reduce([[1], [2], [3]]).bytes_sent`` is ``array([8, 8, 8])``.
    """
    sim = start(inputs, itemsize, keep_buffers)
    n = len(sim.buffers)
    sim.step("exchange", [(src, dst, None, "add") for src in range(n) for dst in range(n) if src != dst])
    return sim.trace("naive all-reduce", [b.copy() for b in sim.buffers])


def simulate_star_all_reduce(inputs: Sequence[Any], *, itemsize: int = 4, keep_buffers: bool = True) -> Trace:
    """Reduce to rank 0, then broadcast from it: rank 0 receives and sends (N-1) x S, the bottleneck.

    Example: ``len(simulate_star_all_reduce([[1], [2]]).steps)`` is 2 (reduce, broadcast).
    """
    sim = start(inputs, itemsize, keep_buffers)
    n = len(sim.buffers)
    if n > 1:
        sim.step("reduce", [(src, 0, None, "add") for src in range(1, n)])
        sim.step("broadcast", [(0, dst, None, "copy") for dst in range(1, n)])
    return sim.trace("reduce + broadcast", [b.copy() for b in sim.buffers])


def simulate_recursive_doubling_all_reduce(inputs: Sequence[Any], *, itemsize: int = 4,
                                           keep_buffers: bool = True) -> Trace:
    """Recursive doubling: in step k, rank r swaps whole buffers with rank r XOR 2^k; log2(N) steps.

    For N not a power of two, the P = 2^floor(log2 N) first ranks do the doubling; each
    rank r >= P first folds its buffer into rank r - P and gets the result back at the end.

    Example: ``len(simulate_recursive_doubling_all_reduce([[1]] * 4).steps)`` is 2.
    """
    sim = start(inputs, itemsize, keep_buffers)
    n = len(sim.buffers)
    p = largest_power_of_two(n)
    if n > p:
        sim.step("fold in", [(r, r - p, None, "add") for r in range(p, n)])
    distance = 1
    while distance < p:
        sim.step(f"exchange at distance {distance}", [(r, r ^ distance, None, "add") for r in range(p)])
        distance *= 2
    if n > p:
        sim.step("hand back", [(r - p, r, None, "copy") for r in range(p, n)])
    return sim.trace("recursive doubling all-reduce", [b.copy() for b in sim.buffers])


def simulate_halving_doubling_all_reduce(inputs: Sequence[Any], *, itemsize: int = 4,
                                         keep_buffers: bool = True) -> Trace:
    """Rabenseifner's algorithm: a reduce-scatter by recursive halving, then an all-gather by recursive doubling.

    Halving: at distances N/2, N/4, ..., 1 rank r sends the half of its chunks that rank r XOR distance
    keeps and adds the other half in. Doubling retraces the distances, copying. 2 log2(N) steps, and each
    rank sends 2(N-1)/N x S, the ring's bytes. Other N fold in and hand back as recursive doubling does.

    Example: ``simulate_halving_doubling_all_reduce([[1, 2, 3, 4]] * 4).bytes_sent`` is ``array([24, 24, 24, 24])``.
    """
    sim = start(inputs, itemsize, keep_buffers)
    n = len(sim.buffers)
    p = largest_power_of_two(n)
    if n > p:
        sim.step("fold in", [(r, r - p, None, "add") for r in range(p, n)])
    groups = np.array_split(np.arange(n), p)  # chunks per group; rank r < p ends up reducing group r
    segment = dict.fromkeys(range(p), (0, p))  # [first, last) groups each rank still holds
    distances = [p >> k for k in range(1, p.bit_length())]  # p/2, p/4, ..., 1
    for distance in distances:
        moves, kept = [], {}
        for r, (first, last) in segment.items():
            middle = (first + last) // 2
            low, high = (first, middle), (middle, last)
            kept[r], give = (low, high) if r & distance == 0 else (high, low)
            moves += [(r, r ^ distance, int(c), "add") for g in range(*give) for c in groups[g]]
        sim.step(f"halving at distance {distance}", moves)
        segment = kept
    for distance in reversed(distances):  # send everything held; each pair then holds the union
        moves = [(r, r ^ distance, int(c), "copy") for r, (first, last) in segment.items()
                 for g in range(first, last) for c in groups[g]]
        sim.step(f"doubling at distance {distance}", moves)
        segment = {r: (min(first, segment[r ^ distance][0]), max(last, segment[r ^ distance][1]))
                   for r, (first, last) in segment.items()}
    if n > p:
        sim.step("hand back", [(r - p, r, None, "copy") for r in range(p, n)])
    return sim.trace("halving-doubling all-reduce", [b.copy() for b in sim.buffers])


ALL_REDUCE_ALGORITHMS = {
    "ring all-reduce": simulate_all_reduce,
    "naive all-reduce": simulate_naive_all_reduce,
    "reduce + broadcast": simulate_star_all_reduce,
    "recursive doubling all-reduce": simulate_recursive_doubling_all_reduce,
    "halving-doubling all-reduce": simulate_halving_doubling_all_reduce,
}


def traffic_table(world_sizes: Sequence[int], length: int = 6720) -> dict[str, list[float]]:
    """Busiest rank's bytes sent, in units of S, per all-reduce algorithm and world size.

    Measured by running each simulator (6720 = 2^6 x 3 x 5 x 7 elements divide evenly for
    N up to 8 and every power of two up to 64). Example: ``traffic_table([4])["ring all-reduce"] == [1.5]``.
    """
    table: dict[str, list[float]] = {name: [] for name in ALL_REDUCE_ALGORITHMS}
    for world_size in world_sizes:
        inputs = [np.zeros(length, dtype=np.float32)] * world_size
        for name, simulate in ALL_REDUCE_ALGORITHMS.items():
            trace = simulate(inputs, keep_buffers=False)
            table[name].append(float(trace.bytes_sent.max()) / trace.buffer_bytes)
    return table

