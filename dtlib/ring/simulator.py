"""The ring simulator's engine: buffers cut into chunks, and rounds of messages applied to them.

One process, no ``torch.distributed``. In a step every rank sends at the same time, then every
receiver adds (reduce) or copies (gather) what arrived; :class:`Simulation` counts the bytes and
which ranks' inputs each chunk holds. The algorithms in :mod:`dtlib.ring.algorithms` are lists of
such steps. Example::

    sim = start([[1, 2], [10, 20]], itemsize=4, keep_buffers=True)
    sim.step("reduce-scatter", [(0, 1, 1, "add"), (1, 0, 0, "add")])
    sim.buffers            # [array([11, 2]), array([10, 22])]
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


def as_arrays(inputs: Sequence[Any], *, equal_lengths: bool = True) -> list[np.ndarray]:
    """One flat numeric copy per rank of ``inputs`` (lists, NumPy arrays or tensors), with a clear error otherwise.

    Example: ``as_arrays([[1, 2], [3, 4]])`` is ``[array([1, 2]), array([3, 4])]``.
    """
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


class Simulation:
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

    def span(self, chunk: int | None) -> slice:
        """The elements of ``chunk`` (the whole buffer for None)."""
        if chunk is None:
            return slice(0, self.bounds[-1][1])
        start, stop = self.bounds[chunk]
        return slice(start, stop)

    def step(self, phase: str, moves: list[tuple[int, int, int | None, Op]]) -> None:
        """Run one round: every (src, dst, chunk, op) message is sent at once, then applied."""
        def columns(chunk: int | None) -> int | slice:
            return slice(None) if chunk is None else chunk

        sent = [(self.buffers[src][self.span(chunk)].copy(), self.contributions[src, columns(chunk)].copy())
                for src, _, chunk, _ in moves]  # what was there before anyone received
        transfers = []
        for (src, dst, chunk, op), (data, counts) in zip(moves, sent, strict=True):
            span = self.span(chunk)
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
        """What happened so far, with ``outputs`` as each rank's result."""
        return Trace(algorithm, len(self.buffers), self.itemsize, self.bounds, self.steps, outputs,
                     self.bytes_sent, self.bytes_received, self.initial_contributions)


def start(inputs: Sequence[Any], itemsize: int, keep_buffers: bool) -> Simulation:
    """A simulation of ``inputs``, one equal-length sequence per rank, each cut into N chunks."""
    if itemsize < 1:
        raise ValueError(f"itemsize must be a positive number of bytes, got {itemsize}")
    buffers = as_arrays(inputs)
    n = len(buffers)
    return Simulation(buffers, chunk_bounds(len(buffers[0]), n), itemsize, keep_buffers,
                      np.ones((n, n), dtype=np.int64))


def largest_power_of_two(n: int) -> int:
    """The largest power of two <= ``n``: the ranks that take part in a doubling.

    Example: ``largest_power_of_two(6) == 4``.
    """
    return 1 << (n.bit_length() - 1)
