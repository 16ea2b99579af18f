"""dtlib: the support package of the distributed-training course.

The public names are here: ``dtlib.spawn``, ``dtlib.run``, ``dtlib.LiveRanks``, ``dtlib.rank_device`` and the
errors. The packages, one concern each, top layer first (each imports only from the layers below it):

- ``bench``: ``python -m dtlib.bench <what>``; nothing imports it;
- ``checks``, ``plots`` and ``examples``: exercise checkers, drawings, scripts for torchrun;
- ``train`` and ``sim``: models, data, the DDP and FSDP runners, ``python -m dtlib.train``; the simulated cluster;
- ``measure`` and ``ring``: counting and measuring inside ranks; the ring simulator and the real ring;
- ``live``: live ranks, the hang doctor, ``%%ranks``;
- ``launch``: ``spawn``, ``run``, the workers, a rank's device, torchrun;
- ``compat``, ``errors``, ``arguments``: torch versions, exceptions, checked arguments.

Packages load on first use (``dtlib.plots``, ``dtlib.train.fsdp``), so ``import dtlib`` stays light inside
every rank.
"""

from types import ModuleType
from typing import Any

from dtlib import compat
from dtlib._lazy import submodule
from dtlib.errors import ChangedFile, RankFailure, WorkerError, WorkerTimeout
from dtlib.launch.device import rank_device
from dtlib.launch.entry import run, under_torchrun
from dtlib.launch.spawn import spawn
from dtlib.live.ranks import LiveRanks

__all__ = ["ChangedFile", "LiveRanks", "RankFailure", "WorkerError", "WorkerTimeout", "load_ipython_extension",
           "rank_device", "run", "spawn", "under_torchrun"]
__version__ = "0.1.0"

compat.install()  # torch 2.13's names on an older torch, in the kernel and in every rank (see compat.shims())


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext dtlib``: the ``%ranks`` and ``%%ranks`` magics (see :mod:`dtlib.live.magics`)."""
    from dtlib.live.magics import load  # IPython's side loads only when Jupyter asks for it

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext dtlib``: stop the live ranks."""
    from dtlib.live.magics import unload

    unload(ipython)


def __getattr__(name: str) -> ModuleType:
    return submodule(__name__, name)
