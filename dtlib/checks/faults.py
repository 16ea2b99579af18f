"""Notebook 16's exercise: the checkpoint interval that wastes the least time, as a function of the job.

The answer is a function ``interval(failures_per_gpu_hour, gpus, checkpoint_s, restart_s)`` returning seconds of
work between checkpoints. The checker owns the jobs it asks about: it draws several per call (failure rates of
real clusters, 512 to 16,384 GPUs, a job's mean time between failures of half an hour to eight hours), so no
constant passes. One job's checkpoints are long against its MTBF and another's restarts are, so that a formula
right only where both are short (a wrong factor, the restart added to or taken from the MTBF, the checkpoint
counted in the interval) is refused. An answer is judged by the time it would cost, not by its digits: the
checkpoints and the work failures throw away, per second of work (:func:`dtlib.sim.failures.overhead`, exact,
and checked against the notebook's simulation; restarts cost the same at any interval). Any interval within
:data:`SLACK` of the least is right: Young's, Daly's and the exact minimum alike.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any

from dtlib.checks import typed
from dtlib.checks.feedback import Feedback
from dtlib.sim import failures

#: How much more overhead (checkpoints and lost work per second of work) than the least a right interval may
#: cost, relative: 0.5%, so 8.00 s per 100 s of work may become 8.04 s.
SLACK = 0.005

Job = tuple[float, int, float, float]  # (failures per GPU-hour, GPUs, checkpoint seconds, restart seconds)


def _mtbf_s(job: Job) -> float:
    rate, gpus, _, _ = job
    return 3600 / (rate * gpus)


def _jobs(draw: random.Random, count: int) -> list[Job]:
    """``count`` jobs. The first's checkpoints take 0.8% to 1% of its MTBF, the second's restarts a quarter to a
    third of it; the others' checkpoints 0.01% to 1% (and at least a second), their restarts 2% to 30%."""
    jobs = []
    for index in range(count):
        while True:
            rate, gpus = 10 ** draw.uniform(-5.3, -4), 2 ** draw.randint(9, 14)
            mtbf_s = 3600 / (rate * gpus)
            if 1800 <= mtbf_s <= 8 * 3600:
                break
        checkpoint = draw.uniform(0.008, 0.01) if index == 0 else 10 ** draw.uniform(-4, -2)
        restart = draw.uniform(0.25, 0.35) if index == 1 else draw.uniform(0.02, 0.3)
        jobs.append((rate, gpus, round(max(checkpoint * mtbf_s, 1.0), 1), round(restart * mtbf_s, 1)))
    return jobs


def _said_job(job: Job) -> str:
    rate, gpus, checkpoint_s, restart_s = job
    return (f"interval({rate:.3g}, {gpus}, {checkpoint_s:g}, {restart_s:g}) (one failure per {1 / rate:,.0f} "
            f"GPU-hours on {gpus:,} GPUs: the job fails every {_mtbf_s(job) / 60:,.0f} min; checkpoints of "
            f"{checkpoint_s:g} s, restarts of {restart_s:g} s)")


#: The usual slips, each as the interval it gives for a job, and what to say when every answer matches it.
_SLIPS: list[tuple[Callable[[Job], float], str]] = [
    (lambda job: failures.young(job[2], _mtbf_s(job) * job[1]),
     "That is Young's interval for one GPU's failures: the job stops when any of its GPUs fails, so its mean time "
     "between failures is one GPU's divided by the number of GPUs."),
    (lambda job: failures.young(job[2] + job[3], _mtbf_s(job)),
     "That puts the restart inside the root. A restart costs the same whenever you checkpoint: it adds to the "
     "waste, but does not move the best interval."),
    (lambda job: failures.young(job[2], _mtbf_s(job) - job[3]),
     "That takes the restart from the MTBF. A restart costs the same whenever you checkpoint, so it does not move "
     "the best interval: use the MTBF as it is."),
    (lambda job: failures.young(job[2], _mtbf_s(job) + job[3]),
     "That adds the restart to the MTBF. A restart costs the same whenever you checkpoint, so it does not move the "
     "best interval: use the MTBF as it is."),
    (lambda job: failures.young(job[2], _mtbf_s(job)) + job[2],
     "That counts the checkpoint's own time in the interval. The interval is the seconds of work between two "
     "checkpoints: Young's rule gives it as it is."),
]


def _hint(jobs: Sequence[Job], got: Sequence[float]) -> str:
    """Why the answers ``got`` (one per job in ``jobs``) are off, where one usual slip explains all of them."""
    if len(set(got)) == 1 and len(jobs) > 1:
        return (f"Your function returned {got[0]:,.0f} s for every job: the best interval depends on the job, "
                "its MTBF (the failure rate and the number of GPUs) and its checkpoint's seconds.")
    for unit, seconds in (("minutes", 60), ("hours", 3600)):
        if all(_right(job, value * seconds) for job, value in zip(jobs, got, strict=True)):
            return f"That looks like the interval in {unit}: return seconds."
    for slip, said in _SLIPS:
        if all(math.isclose(value, slip(job), rel_tol=0.02) for job, value in zip(jobs, got, strict=True)):
            return said
    factors = [value * value / (job[2] * _mtbf_s(job)) for job, value in zip(jobs, got, strict=True)]
    if max(factors) <= min(factors) * 1.04 and not math.isclose(factors[0], 2, rel_tol=0.04):
        return (f"That is sqrt({sum(factors) / len(factors):.2g} * checkpoint_s * mtbf): Young's interval has a "
                "factor 2 inside the root.")
    return "Minimise the overhead: the checkpoints' share of the time against the work a failure throws away."


def _least(job: Job) -> tuple[float, float]:
    """The best interval for ``job`` and its overhead."""
    best = failures.best_interval(_mtbf_s(job), job[2], job[3])
    return best, failures.overhead(best, _mtbf_s(job), job[2])


def _right(job: Job, seconds: float) -> bool:
    """Whether ``seconds`` of work between checkpoints costs ``job`` at most :data:`SLACK` more than the least."""
    return failures.overhead(seconds, _mtbf_s(job), job[2]) <= _least(job)[1] * (1 + SLACK)


def _cost(seconds: float, job: Job) -> str:
    return f"{100 * failures.overhead(seconds, _mtbf_s(job), job[2]):.2f} s"


def checkpoint_interval(fn: Any, jobs: int = 6, seed: int | None = None) -> Feedback:
    """Notebook 16: is ``fn(failures_per_gpu_hour, gpus, checkpoint_s, restart_s)`` an interval (seconds of work
    between checkpoints) whose overhead is at most :data:`SLACK` more than the least, on ``jobs`` jobs drawn per
    call (at least 2)?"""
    if not callable(fn):
        return Feedback(False, f"Pass your function itself, interval(failures_per_gpu_hour, gpus, checkpoint_s, "
                               f"restart_s), not {type(fn).__name__}.")
    asked = _jobs(random.Random(seed), max(int(jobs), 2))
    got: list[float] = []
    for job in asked:
        call: Callable[..., Any] = fn
        try:
            returned = call(*job)
        except Exception as exc:  # noqa: BLE001 - a learner's function may raise anything
            return Feedback(False, f"{_said_job(job)} raised {type(exc).__name__}: {exc}")
        if returned is None:
            return Feedback(False, f"{_said_job(job)} returned None: return the interval's seconds (a function "
                                   "without a return statement returns None).")
        value = typed.number(returned, "seconds")
        if isinstance(value, str):
            return Feedback(False, f"{_said_job(job)} returned {returned!r:.40}. {value}")
        if value <= 0:
            return Feedback(False, f"{_said_job(job)} returned {value:g}: an interval is a positive number of "
                                   "seconds.")
        got.append(value)
    worst = 0.0
    for job, value in zip(asked, got, strict=True):
        (best, least), cost = _least(job), failures.overhead(value, _mtbf_s(job), job[2])
        if not _right(job, value):
            return Feedback(False, f"{_said_job(job)} returned {value:,.0f} s: checkpoints and lost work then cost "
                                   f"{_cost(value, job)} per 100 s of work, where {best:,.0f} s costs "
                                   f"{_cost(best, job)}. {_hint(asked, got)}")
        worst = max(worst, cost / least - 1)
    return Feedback(True, f"Right on {len(asked)} jobs drawn just now, from {min(j[1] for j in asked):,} to "
                          f"{max(j[1] for j in asked):,} GPUs: at most {worst:.2%} more overhead than the best "
                          "interval.")
