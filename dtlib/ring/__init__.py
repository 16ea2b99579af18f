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

Three modules, one concern each: ``simulator`` (buffers, chunks, one step of
messages), ``algorithms`` (ring, naive, star, recursive doubling, halving-doubling;
their traffic) and ``cost`` (the alpha-beta model that predicts their times). Beside
them, ``send_recv``: the same ring run on real ranks with ``dist.send``/``dist.recv``
(the only module here that needs ``torch.distributed``; it is loaded on first use).
"""

from types import ModuleType

from dtlib._lazy import submodule
from dtlib.ring.algorithms import (
    ALL_REDUCE_ALGORITHMS,
    simulate_all_gather,
    simulate_all_reduce,
    simulate_halving_doubling_all_reduce,
    simulate_naive_all_reduce,
    simulate_recursive_doubling_all_reduce,
    simulate_reduce_scatter,
    simulate_star_all_reduce,
    traffic_table,
)
from dtlib.ring.cost import (
    BUS_FACTOR,
    COLLECTIVE_MODEL,
    COST_TERMS,
    LINKS,
    RING_OF,
    AlphaBeta,
    fit_alpha_beta,
    ring_terms,
)
from dtlib.ring.simulator import Step, Trace, Transfer, chunk_bounds

__all__ = ["ALL_REDUCE_ALGORITHMS", "BUS_FACTOR", "COLLECTIVE_MODEL", "COST_TERMS", "LINKS", "RING_OF", "AlphaBeta",
           "Step", "Trace", "Transfer", "chunk_bounds", "ring_terms",
           "fit_alpha_beta", "simulate_all_gather", "simulate_all_reduce", "simulate_halving_doubling_all_reduce",
           "simulate_naive_all_reduce", "simulate_recursive_doubling_all_reduce", "simulate_reduce_scatter",
           "simulate_star_all_reduce", "traffic_table"]


def __getattr__(name: str) -> ModuleType:
    return submodule(__name__, name)  # dtlib.ring.send_recv, loaded on first use
