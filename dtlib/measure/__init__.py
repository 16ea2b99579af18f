"""Counting and measuring inside ranks: collectives counted as torch dispatches them and a log of every
call, bytes each collective moves by group, bytes held for parameters, gradients and optimizer state against
the ZeRO formulas, the peak of a step by category, bytes saved for backward, step times, and the machine
itself (its torch build, GPUs, cores and backends).
"""

from types import ModuleType

from dtlib._lazy import submodule


def __getattr__(name: str) -> ModuleType:
    return submodule(__name__, name)
