"""What the runners' tests share: a run stopped, saved and resumed, against the same run straight through."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest


def _stop_and_resume(run: Callable[..., list[Any]], config: Any, world_size: int = 2, *, steps: int = 6,
                     stop_after: int = 3, location: str, folder: str | None = None,
                     **spawn_options: Any) -> dict[str, list[float]]:
    """Rank 0's losses trained ``steps`` straight through, and trained again in two jobs: the first stops
    after ``stop_after`` steps and saves, a new one loads and goes on. The two lists must be equal.

    ``location`` names the config's checkpoint setting (``"checkpoint_path"`` for DDP, a file;
    ``"checkpoint_dir"`` for FSDP, a folder); the checkpoint goes in ``folder`` (kept), else a temporary one.
    """
    if not 0 < stop_after < steps:
        raise ValueError(f"need 0 < stop_after < steps, got {stop_after} and {steps}")
    spawn_options = {"output": "none", **spawn_options}
    straight = run(replace(config, steps=steps), world_size, **spawn_options)[0].losses
    with tempfile.TemporaryDirectory() as temporary:
        where = folder or temporary
        at = {location: os.path.join(where, "checkpoint.pt") if location == "checkpoint_path" else where}
        first = run(replace(config, steps=stop_after, save_after_step=stop_after, **at), world_size,
                    **spawn_options)[0].losses
        second = run(replace(config, steps=steps, resume=True, **at), world_size, **spawn_options)[0].losses
    return {"straight": straight, "stopped_and_resumed": first + second}


@pytest.fixture(scope="session")
def stop_and_resume() -> Callable[..., dict[str, list[float]]]:
    """``stop_and_resume(run, config, world_size, steps=, stop_after=, location=, folder=None)``: see above."""
    return _stop_and_resume
