"""A long training job that fails at random and restarts from its last checkpoint: how much time the checkpoint
interval wastes, simulated run by run and computed exactly.

A job of ``work_s`` seconds of training writes a checkpoint every ``interval_s`` seconds of work, which takes
``checkpoint_s``. Failures come at random (a Poisson process) ``mtbf_s`` apart on average: the mean time between
failures of the whole job, the GPUs' own divided by their number. A failure throws away the work since the last
complete checkpoint (and a checkpoint under way), then the job spends ``restart_s`` starting again (new
processes, the rendezvous, loading the checkpoint) and goes on from that checkpoint. Short intervals pay for many
checkpoints; long ones lose much work at each failure. Young's rule puts the best interval near
``sqrt(2 * checkpoint_s * mtbf_s)``; Daly's refines it.

:func:`simulate` draws one job's failures (the notebook shows one as a timeline); :func:`waste` is the exact
expected fraction of wall time not spent on new work, which :func:`simulate` agrees with on average (a test
checks it); :func:`best_interval` minimises it, and :func:`overhead` is the part of it the interval decides.

Example::

    young(checkpoint_s=60, mtbf_s=4 * 3600)              # 1315 s: checkpoint every 22 minutes
    waste(1315, mtbf_s=4 * 3600, checkpoint_s=60, restart_s=300)   # 0.11: 11% of the wall time lost
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from dtlib import arguments


def young(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's interval (1974): ``sqrt(2 * checkpoint_s * mtbf_s)`` seconds of work between checkpoints."""
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def daly(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's higher-order interval (2006), for ``checkpoint_s < 2 * mtbf_s``; ``mtbf_s`` beyond it."""
    if checkpoint_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = math.sqrt(checkpoint_s / (2 * mtbf_s))
    return math.sqrt(2 * checkpoint_s * mtbf_s) * (1 + ratio / 3 + ratio * ratio / 9) - checkpoint_s


def _segment_s(interval_s: float, mtbf_s: float, checkpoint_s: float, restart_s: float) -> float:
    """The expected wall time to get one interval of work and its checkpoint done, failures and restarts included
    (failures strike during work and checkpoints; a restart itself does not fail): ``(mtbf + restart) *
    (exp((interval + checkpoint) / mtbf) - 1)``."""
    return (mtbf_s + restart_s) * math.expm1((interval_s + checkpoint_s) / mtbf_s)


def waste(interval_s: float, mtbf_s: float, checkpoint_s: float, restart_s: float) -> float:
    """The expected fraction of wall time that produces no new work: checkpoints, work lost to failures, and
    restarts. Exact for the model in this module's docstring, over a job long enough that its last interval does
    not matter."""
    interval_s, mtbf_s = (arguments.finite(name, value, 1e-9) for name, value in
                          (("interval_s", interval_s), ("mtbf_s", mtbf_s)))
    checkpoint_s, restart_s = (arguments.finite(name, value) for name, value in
                               (("checkpoint_s", checkpoint_s), ("restart_s", restart_s)))
    segment = _segment_s(interval_s, mtbf_s, checkpoint_s, restart_s)
    return 1.0 - interval_s / segment if math.isfinite(segment) else 1.0


def overhead(interval_s: float, mtbf_s: float, checkpoint_s: float) -> float:
    """What the interval decides: the expected seconds of checkpoints and of work thrown away per second of new
    work, ``mtbf * (exp((interval + checkpoint) / mtbf) - 1) / interval - 1``. Restarts multiply the wall time
    by ``1 + restart_s / mtbf_s`` whatever the interval (:func:`waste` is ``1 - 1 / ((1 + overhead) * (1 +
    restart_s / mtbf_s))``), so the interval that minimises this minimises the waste too."""
    interval_s, mtbf_s = (arguments.finite(name, value, 1e-9) for name, value in
                          (("interval_s", interval_s), ("mtbf_s", mtbf_s)))
    checkpoint_s = arguments.finite("checkpoint_s", checkpoint_s)
    exponent = (interval_s + checkpoint_s) / mtbf_s
    return mtbf_s * math.expm1(exponent) / interval_s - 1.0 if exponent < 700 else math.inf  # exp(709) overflows


def best_interval(mtbf_s: float, checkpoint_s: float, restart_s: float) -> float:
    """The interval that minimises :func:`waste`, to a second's thousandth (golden-section search)."""
    low, high = 1e-3, 20 * max(mtbf_s, checkpoint_s, 1.0)
    ratio = (math.sqrt(5) - 1) / 2
    while high - low > 1e-3:
        a, b = high - ratio * (high - low), low + ratio * (high - low)
        if waste(a, mtbf_s, checkpoint_s, restart_s) <= waste(b, mtbf_s, checkpoint_s, restart_s):
            high = b
        else:
            low = a
    return (low + high) / 2


@dataclass
class Run:
    """One simulated job: its wall time, and each event as ``(start_s, end_s, kind)`` with kind "work",
    "checkpoint", "lost" (work or a checkpoint that a failure threw away) or "restart"."""

    wall_s: float = 0.0
    events: list[tuple[float, float, str]] = field(default_factory=list)

    @property
    def failures(self) -> int:
        return sum(kind == "restart" for _, _, kind in self.events)

    def seconds(self, kind: str) -> float:
        """The wall time spent on events of ``kind``."""
        return sum(end - start for start, end, event in self.events if event == kind)


def simulate(work_s: float, interval_s: float, mtbf_s: float, checkpoint_s: float, restart_s: float,
             seed: int = 0) -> Run:
    """One job of ``work_s`` seconds of work under random failures (see the module's docstring); the same
    ``seed`` draws the same failures."""
    work_s = arguments.finite("work_s", work_s, 1e-9)
    waste(interval_s, mtbf_s, checkpoint_s, restart_s)  # checks the other numbers
    draw = random.Random(seed)
    run, now, done = Run(), 0.0, 0.0
    next_failure = draw.expovariate(1 / mtbf_s)
    while done < work_s:
        chunk = min(interval_s, work_s - done)
        pieces = [(chunk, "work"), (checkpoint_s, "checkpoint")]
        started, survived = now, True
        for length, kind in pieces:
            if now + length > next_failure:
                run.events.append((now, next_failure, kind))
                run.events = [(s, e, "lost" if s >= started else k) for s, e, k in run.events]
                now = next_failure
                run.events.append((now, now + restart_s, "restart"))
                now += restart_s
                next_failure = now + draw.expovariate(1 / mtbf_s)
                survived = False
                break
            run.events.append((now, now + length, kind))
            now += length
        if survived:
            done += chunk
    run.wall_s = now
    return run
