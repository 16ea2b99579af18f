"""What the DDP and FSDP runners share: their settings checks, the step time they report, stop-and-resume.

``dtlib.train.ddp`` and ``dtlib.train.fsdp`` each train their own way; the rules around a run are the same for both::

    stop_and_resume(ddp.run, ddp.TrainConfig(steps=6), 2, stop_after=3, location="checkpoint_path")  # dtlib.train.ddp
    slowest_median_step_s(results)      # seconds: the step time of the slowest rank
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from dtlib.arguments import count
from dtlib.measure.timing import slowest_median
from dtlib.train.config import FSDPConfig, TrainConfig


def validate_counts(config: TrainConfig | FSDPConfig, world_size: Any, names: Sequence[str]) -> None:
    """Refuse counts that are not whole numbers (``steps=2.5``, ``global_batch=32.0``, ``True``); store other
    integral types (numpy's) back into ``config`` as ``int``, which torch's samplers need.

    ``save_after_step`` may be None. Example: ``validate_counts(config, 2, ("steps", "global_batch"))``.
    """
    for name, value in {"world_size": world_size, **{name: getattr(config, name) for name in names}}.items():
        if value is None and name == "save_after_step":
            continue
        number = count(name, value)  # numpy ints are fine; 2.5 is not
        if name != "world_size":
            setattr(config, name, number)


def validate_checkpointing(config: TrainConfig | FSDPConfig, location: str, example: str = "") -> None:
    """Refuse a save or resume without a place to write (``config.<location>``), and a ``save_after_step``
    that is not one of the run's steps, so that nothing would be saved."""
    if (config.save_after_step is not None or config.resume) and not getattr(config, location):
        raise ValueError(f"saving or resuming needs {location}{example}")
    if config.save_after_step is not None and not 1 <= config.save_after_step <= config.steps:
        raise ValueError(f"save_after_step={config.save_after_step} is not one of the steps 1..{config.steps}, so "
                         f"nothing would be saved; use a value from 1 to steps={config.steps}")


def slowest_median_step_s(results: Sequence[Any], skip_first: bool = True) -> float:
    """The median step time of the slowest rank, in seconds: a step ends when every rank has finished it.

    ``skip_first`` leaves out step 0 (DDP builds its buckets there, FSDP allocates), unless it is the only one.
    Example: ``slowest_median_step_s(dtlib.train.ddp.run(config, 2)) * 1e3`` (ms).
    """
    return slowest_median((r.step_times_s for r in results), skip=1 if skip_first else 0)


def stop_and_resume(run: Callable[..., list[Any]], config: TrainConfig | FSDPConfig, world_size: int = 2, *,
                    steps: int = 6, stop_after: int = 3, location: str,
                    **spawn_options: Any) -> dict[str, list[float]]:
    """Rank 0's losses trained ``steps`` straight through, and trained again in two jobs: the first stops
    after ``stop_after`` steps and saves, a new one loads and goes on. The two lists must be equal.

    ``location`` names the config's checkpoint setting (``"checkpoint_path"`` for DDP, a file;
    ``"checkpoint_dir"`` for FSDP, a folder); the checkpoint lives in a temporary folder.
    Example: ``stop_and_resume(dtlib.train.fsdp.run, FSDPConfig(), location="checkpoint_dir")``.
    """
    if not 0 < stop_after < steps:
        raise ValueError(f"need 0 < stop_after < steps, got {stop_after} and {steps}")
    spawn_options = {"output": "none", **spawn_options}
    straight = run(replace(config, steps=steps), world_size, **spawn_options)[0].losses
    with tempfile.TemporaryDirectory() as folder:
        where = {location: os.path.join(folder, "checkpoint.pt") if location == "checkpoint_path" else folder}
        first = run(replace(config, steps=stop_after, save_after_step=stop_after, **where), world_size,
                    **spawn_options)[0].losses
        second = run(replace(config, steps=steps, resume=True, **where), world_size, **spawn_options)[0].losses
    return {"straight": straight, "stopped_and_resumed": first + second}
