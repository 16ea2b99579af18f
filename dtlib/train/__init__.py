"""Training machinery: the course's toy models and synthetic data, the DDP and FSDP runners that put
strategies side by side and under torchrun (``python -m dtlib.train``), their checkpoints, and the decision
guide that says which strategy fits a model.

The lesson's own training code lives in the notebooks; these runners exist to compare, benchmark and
launch.
"""

from types import ModuleType

from dtlib._lazy import submodule


def __getattr__(name: str) -> ModuleType:
    return submodule(__name__, name)
