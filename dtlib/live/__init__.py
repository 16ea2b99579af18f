"""Live ranks: ``dtlib.LiveRanks``, the loop each live rank runs, the hang doctor that names where ranks
wait, the ``%ranks`` and ``%%ranks`` magics, and the side-by-side view of each rank's values.

May import: ``dtlib.launch`` (it starts and stops the ranks), ``dtlib.compat``, ``dtlib.errors``.
"""

from types import ModuleType

from dtlib._lazy import submodule


def __getattr__(name: str) -> ModuleType:
    return submodule(__name__, name)
