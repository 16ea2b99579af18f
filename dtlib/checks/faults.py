"""Notebook 16's exercise: the checkpoint interval that wastes the least time, as a function of the job.

The answer is a function ``interval(failures_per_gpu_hour, gpus, checkpoint_s, restart_s)`` returning seconds of
work between checkpoints. The checker owns the jobs it asks about: it draws several per call (failure rates of
real clusters, from 8 to 16,384 GPUs, checkpoints of seconds to minutes), so no constant passes, and judges each
answer by the time it would waste (:func:`dtlib.sim.failures.waste`, exact, and checked against the notebook's
simulation), not by its digits: any interval within 1% of the least waste is right, Young's and Daly's alike.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

from dtlib.checks import typed
from dtlib.checks.feedback import Feedback
from dtlib.sim import failures

#: How much more waste than the least possible a right interval may cost, relative (1%).
SLACK = 0.01


def _jobs(draw: random.Random, count: int) -> list[tuple[float, int, float, float]]:
    """``count`` jobs: (failures per GPU-hour, GPUs, checkpoint seconds, restart seconds)."""
    return [(10 ** draw.uniform(-5, -3.5), 2 ** draw.randint(3, 14), round(draw.uniform(5, 600), 1),
             round(draw.uniform(60, 1800), 1)) for _ in range(count)]


def _said_job(rate: float, gpus: int, checkpoint_s: float, restart_s: float) -> str:
    return (f"interval({rate:.3g}, {gpus}, {checkpoint_s:g}, {restart_s:g}) (one failure per {1 / rate:,.0f} "
            f"GPU-hours on {gpus:,} GPUs, checkpoints of {checkpoint_s:g} s, restarts of {restart_s:g} s)")


def _hint(got: float, best: float, mtbf_s: float, gpus: int, checkpoint_s: float, restart_s: float) -> str:
    """Why ``got`` is off, where a usual slip explains it."""
    def near(value: float) -> bool:
        return abs(got - value) <= 0.02 * value
    if gpus > 1 and near(failures.young(checkpoint_s, mtbf_s * gpus)):
        return ("That is Young's interval for one GPU's failures: the job stops when any of its GPUs fails, so its "
                "mean time between failures is one GPU's divided by the number of GPUs.")
    for factor, unit in ((1 / 60, "minutes"), (1 / 3600, "hours")):
        if near(best * factor):
            return f"That looks like the interval in {unit}: return seconds."
    if near(failures.young(checkpoint_s, mtbf_s) / math.sqrt(2)):
        return "That is sqrt(checkpoint_s * mtbf): Young's interval has a factor 2 inside the root."
    if near(failures.young(checkpoint_s + restart_s, mtbf_s)):
        return ("That puts the restart inside the root. A restart costs the same whenever you checkpoint: it adds "
                "to the waste, but does not move the best interval.")
    return "Minimise the waste: the checkpoints' share of the time against the work a failure throws away."


def checkpoint_interval(fn: Any, jobs: int = 6, seed: int | None = None) -> Feedback:
    """Notebook 16: is ``fn(failures_per_gpu_hour, gpus, checkpoint_s, restart_s)`` an interval (seconds of work
    between checkpoints) that wastes at most 1% more time than the best one, on ``jobs`` jobs drawn per call?"""
    if not callable(fn):
        return Feedback(False, f"Pass your function itself, interval(failures_per_gpu_hour, gpus, checkpoint_s, "
                               f"restart_s), not {type(fn).__name__}.")
    draw = random.Random(seed)
    asked = _jobs(draw, jobs)
    worst = 0.0
    for rate, gpus, checkpoint_s, restart_s in asked:
        mtbf_s = 3600 / (rate * gpus)
        call: Callable[..., Any] = fn
        try:
            returned = call(rate, gpus, checkpoint_s, restart_s)
        except Exception as exc:  # noqa: BLE001 - a learner's function may raise anything
            return Feedback(False, f"{_said_job(rate, gpus, checkpoint_s, restart_s)} raised "
                                   f"{type(exc).__name__}: {exc}")
        got = typed.number(returned, "seconds")
        if isinstance(got, str):
            return Feedback(False, f"{_said_job(rate, gpus, checkpoint_s, restart_s)} returned {returned!r:.40}. "
                                   f"{got}")
        if got <= 0:
            return Feedback(False, f"{_said_job(rate, gpus, checkpoint_s, restart_s)} returned {got:g}: an interval "
                                   "is a positive number of seconds.")
        best = failures.best_interval(mtbf_s, checkpoint_s, restart_s)
        least = failures.waste(best, mtbf_s, checkpoint_s, restart_s)
        wasted = failures.waste(got, mtbf_s, checkpoint_s, restart_s)
        if wasted > least * (1 + SLACK):
            return Feedback(False, f"{_said_job(rate, gpus, checkpoint_s, restart_s)} returned {got:,.0f} s, which "
                                   f"wastes {wasted:.2%} of the time; {best:,.0f} s wastes {least:.2%}. "
                                   f"{_hint(got, best, mtbf_s, gpus, checkpoint_s, restart_s)}")
        worst = max(worst, wasted / least - 1)
    return Feedback(True, f"Right on {jobs} jobs drawn just now, from {min(j[1] for j in asked):,} to "
                          f"{max(j[1] for j in asked):,} GPUs: at most {worst:.2%} more waste than the best interval.")
