"""dtlib: the support package of the distributed-training course.

The names most notebooks need are here; the rest live in submodules
(``dtlib.compat``, ``dtlib.sysinfo``, ``dtlib.plots``, ``dtlib.checks``, ``dtlib.bench``).
"""

from dtlib.errors import RankFailure, WorkerError, WorkerTimeout
from dtlib.launch import spawn
from dtlib.run import run, under_torchrun

__all__ = ["RankFailure", "WorkerError", "WorkerTimeout", "run", "spawn", "under_torchrun"]
__version__ = "0.1.0"
