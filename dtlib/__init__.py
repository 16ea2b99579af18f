"""dtlib: the support package of the distributed-training course.

The launcher's names are here; submodules (``dtlib.checks``, ``dtlib.plots``,
``dtlib.sysinfo``, ``dtlib.compat``, ``dtlib.bench``, ...) load on first use, so
``import dtlib`` stays light inside every rank.
"""

import importlib
from typing import Any

from dtlib.entry import rank_device, run, under_torchrun
from dtlib.errors import RankFailure, WorkerError, WorkerTimeout
from dtlib.launch import spawn
from dtlib.live import LiveRanks

__all__ = ["LiveRanks", "RankFailure", "WorkerError", "WorkerTimeout", "load_ipython_extension", "rank_device", "run",
           "spawn", "under_torchrun"]
__version__ = "0.1.0"

# dtlib.run is the function (the module that holds it is dtlib.entry), so that the name means one thing.
_SUBMODULES = {"bench", "checks", "collectives", "commlog", "compat", "counting", "data", "ddp", "ddp_options",
               "ddp_scratch", "entry", "examples", "feedback", "fsdp", "fsdp_checkpoint", "fsdp_compare",
               "fsdp_measure", "fsdp_wrap", "guide", "launch", "live", "magics", "memory", "models",
               "plots", "rankview", "ring", "runs", "sysinfo", "torchrun", "train"}


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext dtlib``: the ``%ranks`` and ``%%ranks`` magics (see :mod:`dtlib.magics`)."""
    from dtlib.magics import load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext dtlib``: stop the live ranks."""
    from dtlib.magics import unload

    unload(ipython)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"dtlib.{name}")
    raise AttributeError(f"module 'dtlib' has no attribute {name!r}")
