"""Counting and measuring inside ranks: collectives counted as torch dispatches them and a log of every
call, bytes held for parameters, gradients and optimizer state against the ZeRO formulas, bytes saved for
backward, and step times.

May import: ``dtlib.launch``, ``dtlib.compat``, ``dtlib.errors``.
"""

from types import ModuleType

from dtlib._lazy import submodule


def __getattr__(name: str) -> ModuleType:
    return submodule(__name__, name)
