"""What the DDP and FSDP runners share: their settings checks and the step time they report.

``dtlib.train.ddp`` and ``dtlib.train.fsdp`` each train their own way; the rules around a run are the same for both::

    validate_counts(config, world_size, ("steps", "global_batch"))   # whole numbers, or a clear error
    slowest_median_step_s(results)      # seconds: the step time of the slowest rank
"""

from __future__ import annotations

from collections.abc import Sequence
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
