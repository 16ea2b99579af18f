"""Submodules that load on first use, so that ``import dtlib`` stays light inside every rank.

Example, in a package's ``__init__.py``::

    def __getattr__(name: str) -> ModuleType:
        return submodule(__name__, name)    # dtlib.launch.torchrun works without importing it first
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType


def submodule(package: str, name: str) -> ModuleType:
    """``package.name`` imported, or the ``AttributeError`` Python raises for a missing attribute."""
    if not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}") is not None:
        return importlib.import_module(f"{package}.{name}")
    raise AttributeError(f"module {package!r} has no attribute {name!r}")
