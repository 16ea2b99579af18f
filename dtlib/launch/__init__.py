"""Launching ranks: ``dtlib.spawn`` (ranks as child processes of a notebook or script) and ``dtlib.run``
(the same call under torchrun), with the job, the workers, their processes, the output relay, shipping
functions by value, the one place that knows a rank's device, and torchrun helpers.

Every other package stands on this one (what each layer may import: ``docs/architecture.md``). Modules load
on first use (``dtlib.launch.torchrun``), so a rank that only needs ``spawn`` stays light.
"""

from types import ModuleType

from dtlib._lazy import submodule


def __getattr__(name: str) -> ModuleType:
    return submodule(__name__, name)
