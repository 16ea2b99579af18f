"""Live ranks: ``dtlib.LiveRanks``, the loop each live rank runs, the hang doctor that names where ranks
wait, the ``%ranks`` and ``%%ranks`` magics, and the side-by-side view of each rank's values.
"""

from types import ModuleType

from dtlib._lazy import submodule


def __getattr__(name: str) -> ModuleType:
    return submodule(__name__, name)
