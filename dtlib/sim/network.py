"""Seconds of communication per step from a simulated traffic table, with the alpha-beta model of notebook 03:
each collective costs (its ring steps) x alpha + (the bytes this rank sends) / b, on the link its mesh
dimension runs over.

An upper bound on what the step waits for: FSDP and DDP overlap much of it with compute, tensor parallelism's
all-reduces little. The presets are nominal figures, not measurements; pass a link fitted on your own
machine (``dtlib.bench.bandwidth.fit``) to compare.

Example::

    network_seconds(result, {"dp": LINKS["InfiniBand NDR"], "tp": LINKS["NVLink 4"]})   # {"dp": ..., "tp": ...}
"""

from __future__ import annotations

from dataclasses import dataclass

from dtlib.sim.step import Simulated


@dataclass(frozen=True)
class Link:
    """A link as the alpha-beta model sees it: seconds per message and bytes per second, per GPU."""

    alpha_s: float
    bytes_per_s: float

    def shared(self, gpus: int) -> Link:
        """This link as each of ``gpus`` GPUs sees it when they all send across it at once (one NIC for a node's
        GPUs, as FSDP across nodes makes every GPU of a node send together): the same alpha, a share of the bytes.

        Example: ``LINKS["100G Ethernet"].shared(8).bytes_per_s`` is 1.5625e9, one 100 Gbit/s NIC for 8 GPUs.
        """
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
            raise ValueError(f"gpus must be a whole number >= 1, the GPUs that share the link, got {gpus!r}")
        return Link(self.alpha_s, self.bytes_per_s / gpus)


#: Nominal links per GPU. NVLink 4 (H100 SXM): 900 GB/s both ways, 450 GB/s each way; InfiniBand NDR: one
#: 400 Gbit/s NIC per GPU, 50 GB/s; 100 Gbit/s Ethernet, 12.5 GB/s: a NIC per GPU (``.shared(8)`` for one
#: NIC per node of 8 GPUs, as many Ethernet clusters have). Alphas are typical per-step latencies of the order
#: NCCL reports (microseconds inside a node, several across nodes).
LINKS = {"NVLink 4": Link(2e-6, 450e9), "InfiniBand NDR": Link(5e-6, 50e9), "100G Ethernet": Link(10e-6, 12.5e9)}


def _steps(call: str, ranks: int) -> int:
    """Ring steps of one call over ``ranks`` ranks: 2(n-1) for an all-reduce, n-1 for the others, 1 for a send."""
    if ranks <= 1:
        return 0
    if call == "all_reduce":
        return 2 * (ranks - 1)
    return 1 if call in ("send", "recv", "broadcast") else ranks - 1


def network_seconds(result: Simulated, links: dict[str, Link]) -> dict[str, float]:
    """Seconds rank 0 spends communicating per step, per mesh dimension ("dp", "tp", and "pp" for a pipeline),
    nothing overlapped."""
    layout = result.layout
    sizes = {"dp": layout.dp, "tp": layout.tp, **({"pp": layout.pp} if layout.pp > 1 else {})}
    seconds = dict.fromkeys(sizes, 0.0)
    for row in result.traffic:
        if row.group not in sizes:
            continue
        if row.group not in links:
            raise ValueError(f"no link given for the {row.group!r} dimension; give one for each of {list(sizes)}")
        link = links[row.group]
        latency = row.calls * _steps(row.call, sizes[row.group]) * link.alpha_s
        seconds[row.group] += latency + row.sent / link.bytes_per_s
    return seconds
