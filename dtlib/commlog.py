"""Count and time every ``dist.all_reduce`` a rank makes: calls, bytes, launch and finish times.

DDP's communication hooks, PowerSGD and dtlib's DDP-from-scratch all call
``torch.distributed.all_reduce``; inside :meth:`CommLog.recording` that name is
wrapped, so the log sees every call whoever makes it. Torch DDP's built-in C++
all-reduce bypasses Python: the runner registers ``allreduce_hook``, the hook
that does the same thing in Python, so that it is counted too.

Example (inside a rank)::

    log = CommLog()
    with log.recording():
        dist.all_reduce(torch.ones(4))
    log.events[0].nbytes   # 16
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class CommEvent:
    """One all-reduce: its step, size, and when it was launched and finished (s since the log began)."""

    step: int
    numel: int
    nbytes: int
    launched_s: float
    done_s: float = float("nan")
    blocking: bool = False  # async_op=False: the caller waited, so nothing else ran meanwhile


@dataclass
class CommLog:
    """The all-reduce calls of one rank, tagged with the training step they belong to."""

    events: list[CommEvent] = field(default_factory=list)
    step: int = 0
    origin: float = field(default_factory=time.perf_counter)

    def now(self) -> float:
        """Seconds since this log began: the clock of every event."""
        return time.perf_counter() - self.origin

    @contextlib.contextmanager
    def recording(self) -> Iterator[CommLog]:
        """Wrap ``torch.distributed.all_reduce`` for the duration of the block."""
        original = dist.all_reduce

        def all_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None,
                       async_op: bool = False) -> Any:
            event = CommEvent(self.step, tensor.numel(), tensor.numel() * tensor.element_size(), self.now(),
                              blocking=not async_op)
            self.events.append(event)
            work = original(tensor, op=op, group=group, async_op=async_op)
            if not async_op:
                event.done_s = self.now()
            else:
                work.get_future().then(lambda _: setattr(event, "done_s", self.now()))
            return work

        dist.all_reduce = all_reduce
        try:
            yield self
        finally:
            dist.all_reduce = original

    def in_step(self, step: int) -> list[CommEvent]:
        """The events of one step, in launch order."""
        return [e for e in self.events if e.step == step]


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals: time with at least one all-reduce in flight.

    Example: ``busy_seconds([(0, 2), (1, 3), (5, 6)]) == 4``.
    """
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def hidden_share(events: list[CommEvent], compute_end_s: float) -> float:
    """Share of communication time that ran before ``compute_end_s`` (the end of backward's compute).

    1.0: every all-reduce finished while gradients were still being computed;
    0.0: all communication was exposed, after the compute or blocking it (``async_op=False``).
    """
    busy = busy_seconds([(e.launched_s, e.done_s) for e in events])
    if busy <= 0:
        return 0.0
    overlapping = [(e.launched_s, min(e.done_s, compute_end_s)) for e in events
                   if not e.blocking and e.launched_s < compute_end_s]
    hidden = busy_seconds(overlapping)
    return hidden / busy
