"""Notebook 16's exercise: the checkpoint interval that wastes the least time, as a function of the job.

The answer is a function ``interval(failures_per_gpu_hour, gpus, checkpoint_s, restart_s)`` returning seconds of
work between checkpoints (a number, a string of one with its unit, "1780 s", or a ``datetime.timedelta``). The
checker owns the jobs it asks about: it draws several per call (failure rates of real clusters, 512 to 16,384
GPUs, a job's mean time between failures of half an hour to eight hours), so no constant passes. One job's
checkpoints are long against its MTBF, another's restarts are, and a third's checkpoints are short, so that a
formula right only where both are short (the restart added to or taken from the MTBF, the checkpoint counted in
the interval) is refused, and so is a wrong factor. An answer is judged by the time it would cost, not by its
digits: the checkpoints and the work failures throw away, per second of work (:func:`dtlib.sim.failures.overhead`,
exact, and checked against the notebook's simulation; restarts cost the same at any interval). Any interval within
:data:`SLACK` of the least is right: Young's, Daly's and the exact minimum alike.

Why a wrong factor is refused on every call, not on some: where checkpoints are short, first-order theory is exact,
and an interval k times the best costs (k - 1)^2 / 2k more than the least, whatever the job: for Young's rule with
a factor f for its 2, k = sqrt(f / 2). :data:`SLACK` is set between what right answers cost and what wrong factors
do, on the jobs every call draws: Young's rule itself costs up to 0.12% more than the least where checkpoints
take 1% of the MTBF (the first job), and 0.2% refuses a factor below about 1.75 on the third job (1.7, or 3,000
seconds for an hour's 3,600, cost 0.25% to 0.4% there) and above about 2.1 on the first (4,000 s for 3,600: 0.45%
to 0.5%). Only a factor within a few hundredths of those bounds gets a verdict that depends on the draw.
"""

from __future__ import annotations

import datetime
import math
import random
from collections.abc import Callable, Sequence
from typing import Any

from dtlib.checks import typed
from dtlib.checks.feedback import Feedback
from dtlib.sim import failures

#: How much more overhead (checkpoints and lost work per second of work) than the least a right interval may
#: cost, relative: 0.2%, so 8.00 s per 100 s of work may become 8.016 s (the module says why this much).
SLACK = 0.002

Job = tuple[float, int, float, float]  # (failures per GPU-hour, GPUs, checkpoint seconds, restart seconds)


def _mtbf_s(job: Job) -> float:
    rate, gpus, _, _ = job
    return 3600 / (rate * gpus)


def _jobs(draw: random.Random, count: int) -> list[Job]:
    """``count`` jobs (at least 3). The first's checkpoints take 0.8% to 1% of its MTBF, the second's restarts a
    quarter to a third of it, the third's checkpoints 0.01% to 0.02% (first-order theory's own ground); the others'
    checkpoints 0.01% to 1%, their restarts 2% to 30%. A checkpoint takes at least a second."""
    jobs = []
    for index in range(count):
        while True:
            rate, gpus = 10 ** draw.uniform(-5.3, -4), 2 ** draw.randint(9, 14)
            mtbf_s = 3600 / (rate * gpus)
            if 1800 <= mtbf_s <= 8 * 3600:
                break
        low, high = {0: (0.008, 0.01), 2: (1e-4, 2e-4)}.get(index, (None, None))
        checkpoint = 10 ** draw.uniform(-4, -2) if low is None else draw.uniform(low, high)
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
        return (f"Your function returned {_seconds(got[0])} for every job: the best interval depends on the job, "
                "its MTBF (the failure rate and the number of GPUs) and its checkpoint's seconds.")
    for seconds, unit, mixed in ((60, "minutes", "the MTBF in hours with the checkpoint in seconds (or both in "
                                                 "minutes)"),
                                 (3600, "hours", "the MTBF and the checkpoint both in hours")):
        if all(_right(job, value * seconds) for job, value in zip(jobs, got, strict=True)):
            return (f"That is the best interval divided by {seconds:,}: the interval in {unit}, or {mixed} under "
                    "the root. Put both in seconds, and return seconds.")
    for slip, said in _SLIPS:
        if all(math.isclose(value, slip(job), rel_tol=0.02) for job, value in zip(jobs, got, strict=True)):
            return said
    factors = [value * value / (job[2] * _mtbf_s(job)) for job, value in zip(jobs, got, strict=True)]
    if max(factors) <= min(factors) * 1.04 < math.inf and not math.isclose(factors[0], 2, rel_tol=0.04):
        return (f"That is sqrt({sum(factors) / len(factors):.2g} * checkpoint_s * mtbf): Young's interval has a "
                "factor 2 inside the root.")
    return "Minimise the overhead: the checkpoints' share of the time against the work a failure throws away."


def _seconds(value: float) -> str:
    """Seconds as a learner reads them: 1,780 s, 0.5 s, 1e-09 s or 1e+300 s, never 0 s or 300 digits."""
    return f"{value:,.0f} s" if 1 <= value < 1e9 else f"{value:.3g} s"


def _least(job: Job) -> tuple[float, float]:
    """The best interval for ``job`` and its overhead."""
    best = failures.best_interval(_mtbf_s(job), job[2], job[3])
    return best, failures.overhead(best, _mtbf_s(job), job[2])


def _right(job: Job, seconds: float) -> bool:
    """Whether ``seconds`` of work between checkpoints costs ``job`` at most :data:`SLACK` more than the least."""
    return math.isfinite(seconds) and failures.overhead(seconds, _mtbf_s(job), job[2]) <= _least(job)[1] * (1 + SLACK)


def _cost(seconds: float, job: Job) -> str:
    cost = 100 * failures.overhead(seconds, _mtbf_s(job), job[2])
    return f"{cost:.2f} s" if cost < 1e6 else f"{cost:.3g} s"


def checkpoint_interval(fn: Any, jobs: int = 6, seed: int | None = None) -> Feedback:
    """Notebook 16: is ``fn(failures_per_gpu_hour, gpus, checkpoint_s, restart_s)`` an interval (seconds of work
    between checkpoints) whose overhead is at most :data:`SLACK` more than the least, on ``jobs`` jobs drawn per
    call (at least 3)?"""
    if not callable(fn):
        return Feedback(False, f"Pass your function itself, interval(failures_per_gpu_hour, gpus, checkpoint_s, "
                               f"restart_s), not {type(fn).__name__}.")
    asked = _jobs(random.Random(seed), max(int(jobs), 3))
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
        if isinstance(returned, datetime.timedelta):
            returned = returned.total_seconds()
        value = typed.number(returned, "seconds")
        if isinstance(value, str):
            said = typed.quoted(returned, 40) if isinstance(returned, str) else repr(returned)
            said = said if len(said) <= 42 else said[:37] + "..."
            return Feedback(False, f"{_said_job(job)} returned {said}. {value}")
        if value <= 0:
            return Feedback(False, f"{_said_job(job)} returned {value:g}: an interval is a positive number of "
                                   "seconds.")
        if value < 1e-9:  # below what dtlib.sim.failures computes with
            return Feedback(False, f"{_said_job(job)} returned {_seconds(value)}: each checkpoint takes "
                                   f"{job[2]:g} s, so an interval this short does nothing but checkpoint.")
        got.append(float(value))
    worst = 0.0
    for job, value in zip(asked, got, strict=True):
        (best, least), cost = _least(job), failures.overhead(value, _mtbf_s(job), job[2])
        if math.isinf(cost):
            return Feedback(False, f"{_said_job(job)} returned {_seconds(value)}: the job then fails long before "
                                   f"each checkpoint and keeps almost no work, where {_seconds(best)} costs "
                                   f"{_cost(best, job)} per 100 s of work. {_hint(asked, got)}")
        if not _right(job, value):
            return Feedback(False, f"{_said_job(job)} returned {_seconds(value)}: checkpoints and lost work then cost "
                                   f"{_cost(value, job)} per 100 s of work, where {_seconds(best)} costs "
                                   f"{_cost(best, job)}. {_hint(asked, got)}")
        worst = max(worst, cost / least - 1)
    return Feedback(True, f"Right on {len(asked)} jobs drawn just now, from {min(j[1] for j in asked):,} to "
                          f"{max(j[1] for j in asked):,} GPUs: at most {worst:.2%} more overhead than the best "
                          "interval.")
