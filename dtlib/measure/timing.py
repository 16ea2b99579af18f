"""How many ranks' times become one number: the slowest rank's median (the benchmarks and the runners share it)."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence


def slowest_median(per_rank: Iterable[Sequence[float]], skip: int = 0) -> float:
    """Each rank's median time (its first ``skip`` times left out where others remain), then the largest.

    A collective, or a step that ends in one, finishes when its slowest rank does; the median keeps a
    busy machine's odd slow sample out. Example: ``slowest_median([[9, 1, 2], [9, 3, 3]], skip=1)`` -> 3.0.
    """
    medians = [statistics.median(times[skip:] or times) for times in per_rank]
    if not medians:
        raise ValueError("no rank's times to take the median of")
    return float(max(medians))
