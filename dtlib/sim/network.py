"""Seconds of communication per step from a simulated traffic table, with the alpha-beta model of notebook 03:
each collective costs (its ring steps) x alpha + (the bytes this rank sends) / b, on the link its mesh
dimension runs over.

An upper bound on what the step waits for: FSDP and DDP overlap much of it with compute, tensor parallelism's
all-reduces little. The presets, :data:`dtlib.ring.cost.LINKS`, are nominal figures, not measurements; pass a
link fitted on your own machine (``dtlib.bench.bandwidth.fit``) to compare.

Example::

    network_seconds(result, {"dp": LINKS["InfiniBand NDR"], "tp": LINKS["NVLink 4"]})   # {"dp": ..., "tp": ...}
    network_seconds(result, {"dp": bandwidth.fit(bandwidth.sweep("allreduce")), "tp": ...})   # a link of your own
"""

from __future__ import annotations

from dtlib.measure.traffic import call_kind
from dtlib.ring.cost import AlphaBeta, ring_terms
from dtlib.sim.step import Simulated


def network_seconds(result: Simulated, links: dict[str, AlphaBeta]) -> dict[str, float]:
    """Seconds rank 0 spends communicating per step, per mesh dimension ("dp", "tp", and "pp" for a pipeline),
    nothing overlapped: each row's calls times its ring's messages in sequence times alpha
    (:func:`dtlib.ring.cost.ring_terms`), plus the bytes rank 0 sent over the bandwidth."""
    layout = result.layout
    sizes = {"dp": layout.dp, "tp": layout.tp, **({"pp": layout.pp} if layout.pp > 1 else {})}
    seconds = dict.fromkeys(sizes, 0.0)
    for row in result.traffic:
        if row.group not in sizes:
            continue
        if row.group not in links:
            raise ValueError(f"no link given for the {row.group!r} dimension; give one for each of {list(sizes)}")
        link = links[row.group]
        messages, _ = ring_terms(call_kind(row.call), sizes[row.group])
        seconds[row.group] += row.calls * messages * link.alpha_s + row.sent / link.bandwidth_bytes_per_s
    return seconds
