"""A pure-Python simulator of all-reduce algorithms: the ring as data you can step through.

One process, no ``torch.distributed``. Each algorithm is a list of steps; in a step
every rank sends at the same time, then every receiver adds (reduce) or copies
(gather) what arrived. The trace records who sent which chunk to whom, the bytes,
and optionally every rank's buffer after each step::

    trace = simulate_all_reduce([[1, 2, 3], [10, 20, 30]])
    trace.outputs          # [array([11, 22, 33]), array([11, 22, 33])]
    len(trace.steps)       # 2 = 2 * (N - 1): reduce-scatter, then all-gather
    trace.bytes_sent       # array([12, 12]): each rank sent one chunk of 2 elements and one of 1, 4 bytes each

Buffers are cut into N chunks as ``numpy.array_split`` does (the first
``length % N`` chunks one element longer), so any length works, shorter than N
included (some chunks are then empty and their transfers carry 0 bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

Op = Literal["add", "copy"]


@dataclass(frozen=True)
class Transfer:
    """One message: ``src`` sends ``elements`` (``bytes``) of ``chunk`` to ``dst``.

    ``chunk`` is None when the whole buffer is sent. ``op`` is what the receiver
    does with it: "add" into its own copy, or "copy" over it.
    """

    src: int
    dst: int
    chunk: int | None
    elements: int
    bytes: int
    op: Op


@dataclass
class Step:
    """Every rank's transfers in one round, and the state after it."""

    phase: str
    transfers: list[Transfer]
    buffers: list[np.ndarray] | None  # each rank's whole buffer after the step, if kept
    contributions: np.ndarray  # (ranks, chunks): how many ranks' inputs each chunk holds


@dataclass
class Trace:
    """What an algorithm did: its steps, results and traffic per rank (bytes)."""

    algorithm: str
    world_size: int
    itemsize: int
    chunk_bounds: list[tuple[int, int]]  # [start, stop) of each chunk, in elements
    steps: list[Step]
    outputs: list[np.ndarray]
    bytes_sent: np.ndarray  # (ranks,)
    bytes_received: np.ndarray  # (ranks,)
    initial_contributions: np.ndarray  # (ranks, chunks) before the first step

    def contributions(self, step: int) -> np.ndarray:
        """(ranks, chunks) counts after ``step`` steps (0 = the start)."""
        return self.initial_contributions if step == 0 else self.steps[step - 1].contributions

    @property
    def buffer_bytes(self) -> int:
        """S: the bytes of one rank's whole buffer."""
        return self.chunk_bounds[-1][1] * self.itemsize if self.chunk_bounds else 0


def _as_arrays(inputs: Sequence[Any], *, equal_lengths: bool = True) -> list[np.ndarray]:
    if isinstance(inputs, (str, bytes)) or not hasattr(inputs, "__len__"):
        raise TypeError("inputs must be a list with one sequence per rank, e.g. [[1, 2], [3, 4]]")
    if len(inputs) == 0:
        raise ValueError("inputs is empty: give one sequence per rank (at least one rank)")
    arrays = []
    for rank, values in enumerate(inputs):
        if hasattr(values, "detach"):  # a torch tensor
            values = values.detach().cpu().numpy()
        array = np.asarray(values)
        if array.ndim != 1:
            raise ValueError(f"rank {rank}'s input has shape {array.shape}; each rank needs one flat sequence")
        if array.size and array.dtype.kind not in "biufc":
            raise TypeError(f"rank {rank}'s input is not numeric (dtype {array.dtype})")
        arrays.append(array)
    lengths = [len(a) for a in arrays]
    if equal_lengths and len(set(lengths)) > 1:
        raise ValueError(f"every rank needs a buffer of the same length; got lengths {lengths} for ranks 0..")
    dtype = np.result_type(*[a.dtype for a in arrays if a.size] or [np.float32])
    return [a.astype(dtype, copy=True) for a in arrays]


def chunk_bounds(length: int, world_size: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each of ``world_size`` chunks, as ``numpy.array_split`` cuts them.

    Example: ``chunk_bounds(5, 2) == [(0, 3), (3, 5)]``.
    """
    base, extra = divmod(length, world_size)
    bounds, start = [], 0
    for chunk in range(world_size):
        stop = start + base + (chunk < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


class _Simulation:
    """Buffers, traffic counters and contributions, advanced one step at a time."""

    def __init__(self, buffers: list[np.ndarray], bounds: list[tuple[int, int]], itemsize: int,
                 keep_buffers: bool, contributions: np.ndarray) -> None:
        self.buffers = buffers
        self.bounds = bounds
        self.itemsize = itemsize
        self.keep_buffers = keep_buffers
        self.contributions = contributions
        self.initial_contributions = contributions.copy()
        n = len(buffers)
        self.bytes_sent = np.zeros(n, dtype=np.int64)
        self.bytes_received = np.zeros(n, dtype=np.int64)
        self.steps: list[Step] = []

    def _span(self, chunk: int | None) -> slice:
        if chunk is None:
            return slice(0, self.bounds[-1][1])
        start, stop = self.bounds[chunk]
        return slice(start, stop)

    def step(self, phase: str, moves: list[tuple[int, int, int | None, Op]]) -> None:
        """Run one round: every (src, dst, chunk, op) message is sent at once, then applied."""
        def columns(chunk: int | None) -> int | slice:
            return slice(None) if chunk is None else chunk

        sent = [(self.buffers[src][self._span(chunk)].copy(), self.contributions[src, columns(chunk)].copy())
                for src, _, chunk, _ in moves]  # what was there before anyone received
        transfers = []
        for (src, dst, chunk, op), (data, counts) in zip(moves, sent, strict=True):
            span = self._span(chunk)
            if op == "add":
                self.buffers[dst][span] += data
                self.contributions[dst, columns(chunk)] += counts
            else:
                self.buffers[dst][span] = data
                self.contributions[dst, columns(chunk)] = counts
            nbytes = len(data) * self.itemsize
            self.bytes_sent[src] += nbytes
            self.bytes_received[dst] += nbytes
            transfers.append(Transfer(src, dst, chunk, len(data), nbytes, op))
        snapshot = [b.copy() for b in self.buffers] if self.keep_buffers else None
        self.steps.append(Step(phase, transfers, snapshot, self.contributions.copy()))

    def trace(self, algorithm: str, outputs: list[np.ndarray]) -> Trace:
        return Trace(algorithm, len(self.buffers), self.itemsize, self.bounds, self.steps, outputs,
                     self.bytes_sent, self.bytes_received, self.initial_contributions)


def _start(inputs: Sequence[Any], itemsize: int, keep_buffers: bool) -> _Simulation:
    if itemsize < 1:
        raise ValueError(f"itemsize must be a positive number of bytes, got {itemsize}")
    buffers = _as_arrays(inputs)
    n = len(buffers)
    return _Simulation(buffers, chunk_bounds(len(buffers[0]), n), itemsize, keep_buffers,
                       np.ones((n, n), dtype=np.int64))


def _ring_reduce_scatter(sim: _Simulation) -> None:
    n = len(sim.buffers)
    for s in range(n - 1):  # rank r passes chunk r-1-s on; after N-1 steps it holds chunk r, fully reduced
        sim.step("reduce-scatter", [(r, (r + 1) % n, (r - 1 - s) % n, "add") for r in range(n)])


def _ring_all_gather(sim: _Simulation) -> None:
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
    sim = _start(inputs, itemsize, keep_buffers)
    _ring_reduce_scatter(sim)
    _ring_all_gather(sim)
    return sim.trace("ring all-reduce", [b.copy() for b in sim.buffers])


def simulate_reduce_scatter(inputs: Sequence[Any], *, itemsize: int = 4, keep_buffers: bool = True) -> Trace:
    """Ring reduce-scatter: N-1 steps; rank r ends with chunk r of the sum (``.outputs[r]``).

    Example: ``simulate_reduce_scatter([[1, 2], [3, 4]]).outputs`` is ``[array([4]), array([6])]``.
    """
    sim = _start(inputs, itemsize, keep_buffers)
    _ring_reduce_scatter(sim)
    outputs = [sim.buffers[r][sim._span(r)].copy() for r in range(len(sim.buffers))]
    return sim.trace("ring reduce-scatter", outputs)


def simulate_all_gather(shards: Sequence[Any], *, itemsize: int = 4, keep_buffers: bool = True) -> Trace:
    """Ring all-gather: N-1 steps; every rank ends with all shards, concatenated in rank order.

    ``shards[r]`` is rank r's piece; pieces may differ in length (as uneven chunks do).

    Example: ``simulate_all_gather([[1], [2, 3]]).outputs`` is ``[array([1, 2, 3])] * 2``.
    """
    if itemsize < 1:
        raise ValueError(f"itemsize must be a positive number of bytes, got {itemsize}")
    pieces = _as_arrays(shards, equal_lengths=False)
    n = len(pieces)
    stops = np.cumsum([len(p) for p in pieces])
    bounds = [(int(stop - len(p)), int(stop)) for p, stop in zip(pieces, stops, strict=True)]
    buffers = [np.zeros(int(stops[-1]), dtype=pieces[0].dtype) for _ in range(n)]
    contributions = np.zeros((n, n), dtype=np.int64)
    for rank, piece in enumerate(pieces):
        buffers[rank][bounds[rank][0]:bounds[rank][1]] = piece
        contributions[rank, rank] = 1
    sim = _Simulation(buffers, bounds, itemsize, keep_buffers, contributions)
    _ring_all_gather(sim)
    return sim.trace("ring all-gather", [b.copy() for b in sim.buffers])


def simulate_naive_all_reduce(inputs: Sequence[Any], *, itemsize: int = 4, keep_buffers: bool = True) -> Trace:
    """Naive all-reduce: in one step every rank sends its whole buffer to every other: (N-1) x S each.

    Example: ``simulate_naive_all_reduce([[1], [2], [3]]).bytes_sent`` is ``array([8, 8, 8])``.
    """
    sim = _start(inputs, itemsize, keep_buffers)
    n = len(sim.buffers)
    sim.step("exchange", [(src, dst, None, "add") for src in range(n) for dst in range(n) if src != dst])
    return sim.trace("naive all-reduce", [b.copy() for b in sim.buffers])


def simulate_star_all_reduce(inputs: Sequence[Any], *, itemsize: int = 4, keep_buffers: bool = True) -> Trace:
    """Reduce to rank 0, then broadcast from it: rank 0 receives and sends (N-1) x S, the bottleneck.

    Example: ``len(simulate_star_all_reduce([[1], [2]]).steps)`` is 2 (reduce, broadcast).
    """
    sim = _start(inputs, itemsize, keep_buffers)
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
    sim = _start(inputs, itemsize, keep_buffers)
    n = len(sim.buffers)
    p = 1 << (n.bit_length() - 1)  # largest power of two <= n
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
    sim = _start(inputs, itemsize, keep_buffers)
    n = len(sim.buffers)
    p = _power(n)
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


# -- the alpha-beta cost model -------------------------------------------------------------

#: For each algorithm: (messages in sequence, bytes in sequence per byte of S) as functions of N.
#: Time = messages * alpha + bytes_factor * S / bandwidth. Ring: 2(N-1) steps of S/N bytes each.
COST_TERMS = {
    "ring all-reduce": lambda n: (2 * (n - 1), 2 * (n - 1) / n),
    "ring reduce-scatter": lambda n: (n - 1, (n - 1) / n),
    "ring all-gather": lambda n: (n - 1, (n - 1) / n),
    # A rank sends its N-1 messages one after another through one link.
    "naive all-reduce": lambda n: (n - 1, n - 1),
    "reduce + broadcast": lambda n: (2 * (n - 1), 2 * (n - 1)),
    "recursive doubling all-reduce": lambda n: (_doubling_steps(n), _doubling_steps(n)),
    # Rabenseifner: log2 P halving steps and log2 P doubling ones move 2(P-1)/P x S; other N fold in and back.
    "halving-doubling all-reduce": lambda n: (2 * (_power(n).bit_length() - 1) + (2 if _folded(n) else 0),
                                              2 * (_power(n) - 1) / _power(n) + (2 if _folded(n) else 0)),
    # Cut into many small pieces and passed down a chain: S once, after N-1 start-up hops.
    "pipelined broadcast": lambda n: (n - 1, 1.0),
}


def _power(n: int) -> int:
    return 1 << (n.bit_length() - 1)  # the largest power of two <= n


def _folded(n: int) -> bool:
    return n > _power(n)


def _doubling_steps(n: int) -> int:
    return (_power(n).bit_length() - 1) + (2 if _folded(n) else 0)


@dataclass(frozen=True)
class AlphaBeta:
    """Latency per message (seconds) and bandwidth (bytes per second) of one link."""

    alpha_s: float
    bandwidth_bytes_per_s: float

    def time(self, algorithm: str, world_size: int, nbytes: float) -> float:
        """Predicted seconds for ``algorithm`` on ``world_size`` ranks with S = ``nbytes`` per rank.

        Example: ``AlphaBeta(1e-5, 1e9).time("ring all-reduce", 4, 1e6)`` is 6e-5 + 1.5e-3 seconds.
        """
        if algorithm not in COST_TERMS:
            raise ValueError(f"unknown algorithm {algorithm!r}; known: {sorted(COST_TERMS)}")
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        messages, bytes_factor = COST_TERMS[algorithm](world_size)
        return messages * self.alpha_s + bytes_factor * nbytes / self.bandwidth_bytes_per_s


def fit_alpha_beta(sizes_bytes: Sequence[float], seconds: Sequence[float], *, algorithm: str = "ring all-reduce",
                   world_size: int = 2, share: float = 0.2) -> AlphaBeta:
    """alpha and bandwidth of ``algorithm`` read off the two ends of a sweep of measured times.

    Each term of the model dominates at one end, so each is read off there: the model goes through the
    median time of the smallest ``share`` of the sizes and the median time of the largest ``share``
    (a fifth by default: 3 of the 15 sizes from 1 KiB to 16 MiB). A least-squares fit over every size
    would let the middle sizes, which on a CPU can move faster than the largest ones, set the
    bandwidth, and over-predict large buffers.

    Needs at least two different sizes. Example: times made by ``AlphaBeta(2e-5, 5e9)``
    give back ``AlphaBeta(2e-5, 5e9)``.
    """
    sizes = np.asarray(sizes_bytes, dtype=np.float64)
    times = np.asarray(seconds, dtype=np.float64)
    if sizes.shape != times.shape or sizes.ndim != 1:
        raise ValueError(f"need one time per size; got {sizes.shape} sizes and {times.shape} times")
    if len(np.unique(sizes)) < 2:
        raise ValueError("need timings at two or more different sizes to separate latency from bandwidth")
    if world_size < 2:
        raise ValueError("one rank sends nothing: fit with world_size >= 2")
    if not 0 < share <= 0.5:
        raise ValueError(f"share is the part of the sizes at each end, between 0 and 0.5; got {share}")
    messages, bytes_factor = COST_TERMS[algorithm](world_size)
    if np.any(times <= 0):
        raise ValueError("every time must be positive")
    order = np.argsort(sizes, kind="stable")
    sizes, times = sizes[order], times[order]
    k = max(1, min(len(sizes) // 2, round(share * len(sizes))))  # sizes at each end
    small_size, small_time = np.median(sizes[:k]), np.median(times[:k])  # (s, t): t is affine in s, so
    large_size, large_time = np.median(sizes[-k:]), np.median(times[-k:])  # exact times stay exact
    if large_size <= small_size:
        raise ValueError("the smallest and the largest sizes coincide: measure a wider range of sizes")
    inverse_bandwidth = (large_time - small_time) / (bytes_factor * (large_size - small_size))  # s per byte
    if inverse_bandwidth <= 0:
        raise ValueError("the times do not grow with size, so no bandwidth can be fitted; measure larger sizes")
    alpha = max(0.0, (small_time - bytes_factor * small_size * inverse_bandwidth) / messages)
    return AlphaBeta(float(alpha), float(1 / inverse_bandwidth))
