"""The alpha-beta cost model: a collective's time predicted from its messages and bytes.

Time = messages x alpha + bytes_factor x S / bandwidth, with each algorithm's terms (``COST_TERMS``)
written out as formulas of N; ``fit_alpha_beta`` reads alpha and the bandwidth off measured times::

    AlphaBeta(1e-5, 1e9).time("ring all-reduce", 4, 1e6)   # 6e-5 + 1.5e-3 seconds

``tests/ring/test_ring.py`` checks the ring's terms against the published formula, and halving-doubling's
against its simulation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from dtlib.ring.simulator import largest_power_of_two

#: For each algorithm: (messages in sequence, bytes in sequence per byte of S) as functions of N.
#: Time = messages * alpha + bytes_factor * S / bandwidth. Ring: 2(N-1) steps of S/N bytes each.
#: The one home of these terms: the traffic tables (``dtlib.measure.traffic``) and the simulated cluster's
#: seconds (``dtlib.sim.network``) read them through :data:`RING_OF`.
COST_TERMS = {
    "ring all-reduce": lambda n: (2 * (n - 1), 2 * (n - 1) / n),
    "ring reduce-scatter": lambda n: (n - 1, (n - 1) / n),
    "ring all-gather": lambda n: (n - 1, (n - 1) / n),
    # Each rank sends its N-1 other pieces, one per peer, through its link: (N-1)/N of its buffer.
    "pairwise all-to-all": lambda n: (n - 1, (n - 1) / n),
    # One message, the whole buffer, to one peer.
    "send": lambda n: (1, 1.0),
    # A rank sends its N-1 messages one after another through one link.
    "naive all-reduce": lambda n: (n - 1, n - 1),
    "reduce + broadcast": lambda n: (2 * (n - 1), 2 * (n - 1)),
    "recursive doubling all-reduce": lambda n: (_doubling_steps(n), _doubling_steps(n)),
    "halving-doubling all-reduce": lambda n: _halving_doubling(n),
    # Cut into many small pieces and passed down a chain: S once, after N-1 start-up hops.
    "pipelined broadcast": lambda n: (n - 1, 1.0),
}


#: The algorithm that carries each kind of call in the traffic tables, where a rank's bytes are counted: "gather"
#: (all-gathers), "scatter" (reduce-scatters), "all_reduce", "all_to_all", "send" (a send, or a rooted gather,
#: reduce or scatter: the buffer once), "broadcast" (pipelined down the ranks), "none" (a receive: nothing sent).
RING_OF = {"gather": "ring all-gather", "scatter": "ring reduce-scatter", "all_reduce": "ring all-reduce",
           "all_to_all": "pairwise all-to-all", "send": "send", "broadcast": "pipelined broadcast", "none": None}


def ring_terms(kind: str, n: int) -> tuple[int, float]:
    """(messages in sequence, bytes sent per byte of the payload) for one call of ``kind`` (:data:`RING_OF`) on a
    group of ``n`` ranks; ``(0, 0.0)`` for a receive, or a group of one, which sends nothing.

    Example: ``ring_terms("all_reduce", 4)`` is ``(6, 1.5)``.
    """
    if kind not in RING_OF:
        raise ValueError(f"unknown kind {kind!r}; known: {sorted(RING_OF)}")
    algorithm = RING_OF[kind]
    if algorithm is None or n <= 1:
        return 0, 0.0
    return COST_TERMS[algorithm](n)


#: busbw / algbw for each collective: the share of a buffer of S bytes that crosses the busiest link, n ranks
#: (nccl-tests' factors). Example: ``BUS_FACTOR["allreduce"](4)`` is 1.5.
BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "reducescatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}

#: The algorithm of ``COST_TERMS`` that models each collective's times.
COLLECTIVE_MODEL = {
    "allreduce": "ring all-reduce",
    "allgather": "ring all-gather",
    "reducescatter": "ring reduce-scatter",
    "broadcast": "pipelined broadcast",
}


def _folded(n: int) -> bool:
    return n > largest_power_of_two(n)


def _doubling_steps(n: int) -> int:
    return (largest_power_of_two(n).bit_length() - 1) + (2 if _folded(n) else 0)


def _halving_doubling(n: int) -> tuple[int, float]:
    """Rabenseifner: log2 P halving steps and log2 P doubling ones move 2(P-1)/P x S; other N fold in and back."""
    p, fold = largest_power_of_two(n), 2 if _folded(n) else 0
    return 2 * (p.bit_length() - 1) + fold, 2 * (p - 1) / p + fold


@dataclass(frozen=True)
class AlphaBeta:
    """Latency per message (seconds) and bandwidth (bytes per second) of one link."""

    alpha_s: float
    bandwidth_bytes_per_s: float

    def shared(self, gpus: int) -> AlphaBeta:
        """This link as each of ``gpus`` GPUs sees it when they all send across it at once (one NIC for a node's
        GPUs, as FSDP across nodes makes every GPU of a node send together): the same alpha, a share of the bytes.

        Example: ``AlphaBeta(1e-5, 12.5e9).shared(8).bandwidth_bytes_per_s`` is 1.5625e9.
        """
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
            raise ValueError(f"gpus must be a whole number >= 1, the GPUs that share the link, got {gpus!r}")
        return AlphaBeta(self.alpha_s, self.bandwidth_bytes_per_s / gpus)

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


#: Nominal links per GPU, the one home of these figures (the simulator's seconds and the decision guide's
#: both read them), as :class:`AlphaBeta` (the link the course fits on its own machine in
#: notebooks 02 and 03). NVLink 4 (H100 SXM): 900 GB/s both ways, 450 GB/s each way; InfiniBand NDR: one 400 Gbit/s
#: NIC per GPU, 50 GB/s; 100 Gbit/s Ethernet, 12.5 GB/s: a NIC per GPU (``.shared(8)`` for one NIC per node of 8
#: GPUs, as many Ethernet clusters have). Alphas are typical per-step latencies of the order NCCL reports
#: (microseconds inside a node, several across nodes).
LINKS = {"NVLink 4": AlphaBeta(2e-6, 450e9), "InfiniBand NDR": AlphaBeta(5e-6, 50e9),
         "100G Ethernet": AlphaBeta(10e-6, 12.5e9)}


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
