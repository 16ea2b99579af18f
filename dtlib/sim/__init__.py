"""Your cluster, simulated: a Llama-shaped model's training step on 8 to 1,024 ranks, run in one process on
torch's fake backend and fake tensors, its memory per rank and its collectives measured as on live ranks,
and the same step on live ranks to prove it (notebook 14).
"""

from types import ModuleType

from dtlib._lazy import submodule


def __getattr__(name: str) -> ModuleType:
    return submodule(__name__, name)
