"""Count and time the collectives a rank makes: kind, calls, bytes, launch and finish times.

DDP's communication hooks, PowerSGD, dtlib's DDP-from-scratch, FSDP2 and FSDP1 all
call the collectives as ``torch.distributed.<name>`` at call time; inside
:meth:`CommLog.recording` those names are wrapped, so the log sees every call
whoever makes it, on any thread, at no cost to the other operators. Torch DDP's built-in
C++ all-reduce does not pass through Python: the DDP runner registers ``allreduce_hook``,
the same all-reduce written in Python, so that its launch and finish can be timed.

Why a wrapper and not a dispatch mode (measured on torch 2.13, gloo, 2 CPU ranks): a ``TorchDispatchMode``
(``dtlib.measure.counting.count_collectives``, torch's ``CommDebugMode``) does see DDP's built-in all-reduce
(``c10d::allreduce_`` goes through the dispatcher), but it intercepts every operator of the step (the
transformer's step took about twice as long), which would distort the timeline, and it is thread-local:
PowerSGD starts its later all-reduces from future callbacks on gloo's threads, which no dispatch mode (nor
``torch.profiler``) sees. Use ``count_collectives`` where counts are all you need.

Times are this CPU's clock: right for gloo, which runs a collective on its own CPU threads. A CUDA
collective (NCCL) returns, and its future fires, as soon as the work is queued on the GPU, so the CPU's
clock cannot see it run. For those the log records two CUDA events instead: one on the caller's stream
before the call (the collective cannot start before the work queued ahead of it), one on a side stream
made to wait for the collective. :meth:`CommLog.resolve` synchronises, reads both against a reference
event recorded when GPU and CPU were in step, and sets ``launched_s`` (when the GPU reached the call)
and ``done_s`` (when the collective finished) on this clock. Until then ``done_s`` is NaN, and
:func:`hidden_share` says NaN (not measured) rather than a share that would mean nothing. On one H100 at
world size 1 every bucket's all-reduce started and ended inside its step (docs/gpu_status.md); the overlap
with backward over real links needs 2 GPUs, not yet run.

``nbytes`` is the size of the whole buffer S, as nccl-tests counts it: the tensor of
an all-reduce, the gathered output of an all-gather, the input of a reduce-scatter.

Example (inside a rank)::

    log = CommLog()
    with log.recording():
        dist.all_reduce(torch.ones(4))
    log.events[0].nbytes   # 16
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dtlib.calls import op_called
from dtlib.launch import strict

#: The ``torch.distributed`` functions the log can wrap.
LOGGED = ("all_reduce", "all_gather_single", "all_gather_into_tensor", "all_gather", "reduce_scatter_single",
          "reduce_scatter_tensor", "broadcast")
#: Each logged function -> the position of the whole buffer S in its arguments (the gathered output, the input
#: being reduced): the payload of the op it dispatches (:func:`dtlib.calls.op_called`).
SIZED_BY = {name: op.payload for name in LOGGED if (op := op_called(name)) is not None}
#: The ring kinds of :mod:`dtlib.calls` under the names a timeline shows.
_SHOWN = {"gather": "all_gather", "scatter": "reduce_scatter"}
#: Each logged function -> the kind its events are shown as: all_reduce, all_gather, reduce_scatter, broadcast.
KIND = {name: _SHOWN.get(op.kind, op.kind) for name in LOGGED if (op := op_called(name)) is not None}


@dataclass
class CommEvent:
    """One collective: its step, kind, size, and when it was launched and finished (s since the log began)."""

    step: int
    numel: int
    nbytes: int
    launched_s: float
    done_s: float = float("nan")
    blocking: bool = False  # async_op=False: the caller waited, so nothing else ran meanwhile
    kind: str = "all_reduce"  # all_reduce, all_gather, reduce_scatter or broadcast
    group_size: int = 1  # ranks in the collective's process group


@dataclass
class CommLog:
    """The all-reduce calls of one rank, tagged with the training step they belong to."""

    events: list[CommEvent] = field(default_factory=list)
    step: int = 0
    origin: float = field(default_factory=time.perf_counter)
    _by_step: dict[int, list[CommEvent]] = field(default_factory=dict, repr=False)  # in_step without a scan
    # CUDA collectives not yet read: (event, CUDA event before the call, CUDA event after the collective)
    _pending: list[tuple[CommEvent, Any, Any]] = field(default_factory=list, repr=False)
    _reference: tuple[Any, float] | None = field(default=None, repr=False)  # (CUDA event, this clock) in step
    _side: Any = field(default=None, repr=False)  # the stream that waits for each collective
    # CPU collectives whose finish is stamped by a callback: the futures that complete after it ran
    _stamping: list[Any] = field(default_factory=list, repr=False)

    def now(self) -> float:
        """Seconds since this log began: the clock of every event."""
        return time.perf_counter() - self.origin

    @contextlib.contextmanager
    def recording(self, names: tuple[str, ...] = ("all_reduce",)) -> Iterator[CommLog]:
        """Wrap ``torch.distributed.<name>`` for each of ``names`` (of :data:`LOGGED`) in the block."""
        originals = {name: getattr(dist, name) for name in names if hasattr(dist, name)}
        for name, original in originals.items():
            setattr(dist, name, self._wrapped(name, original))
        try:
            yield self
        finally:
            for name, original in originals.items():
                setattr(dist, name, original)

    def _wrapped(self, name: str, original: Any) -> Any:
        signature = inspect.signature(original)

        @strict.passes_through
        def collective(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            buffer = list(bound.arguments.values())[SIZED_BY[name]]
            pieces = buffer if isinstance(buffer, (list, tuple)) else [buffer]
            numel = sum(t.numel() for t in pieces)
            async_op = bool(bound.arguments.get("async_op", False))
            event = CommEvent(self.step, numel, sum(t.numel() * t.element_size() for t in pieces), self.now(),
                              blocking=not async_op, kind=KIND[name],
                              group_size=dist.get_world_size(bound.arguments.get("group")))
            self.events.append(event)
            self._by_step.setdefault(event.step, []).append(event)
            if any(t.is_cuda for t in pieces):
                before = self._cuda_mark()
                work = original(*args, **kwargs)
                self._pending.append((event, before, self._cuda_after(work)))
            else:
                work = original(*args, **kwargs)
                self._stamp(event, work, async_op)
            return work

        return collective

    def _stamp(self, event: CommEvent, work: Any, async_op: bool) -> None:
        """A CPU collective's finish on this clock: now if the caller waited, else when its future fires.

        The callback runs on gloo's thread and needs the GIL. If the caller holds it when the collective ends,
        a callback the caller chains later (DDP's hook) runs first, on the caller's thread, and the step goes
        on with this one still queued: :meth:`resolve` waits for it.
        """
        if not async_op or work is None:
            event.done_s = self.now()
        else:
            self._stamping.append(work.get_future().then(lambda _: setattr(event, "done_s", self.now())))

    def _cuda_mark(self) -> Any:
        """A timing CUDA event on the caller's stream; the first one also fixes the reference."""
        if self._reference is None:
            torch.cuda.synchronize()  # GPU and CPU in step: the reference event runs at this clock's now()
            reference = torch.cuda.Event(enable_timing=True)
            reference.record()
            self._reference = (reference, self.now())
        mark = torch.cuda.Event(enable_timing=True)
        mark.record()
        return mark

    def _cuda_after(self, work: Any) -> Any:
        """A timing CUDA event that runs when the collective has finished, without making anyone wait for it:
        a side stream waits for the work (``work.wait()`` blocks the current stream, not the CPU)."""
        done = torch.cuda.Event(enable_timing=True)
        if work is None:  # async_op=False: the caller's stream already waits for the collective
            done.record()
            return done
        if self._side is None:
            self._side = torch.cuda.Stream()
        with torch.cuda.stream(self._side):
            work.wait()
            done.record(self._side)
        return done

    def resolve(self) -> None:
        """Give every collective recorded so far its finish on this clock. A CPU collective's: wait for the
        callback that stamps it (see :meth:`_stamp`). A CUDA collective's: read from its events (synchronises
        the GPU once, and only if there are some). Call it after a step, not inside one."""
        for stamped in self._stamping:
            stamped.wait()  # releases the GIL, so that gloo's thread can run the stamp
        self._stamping.clear()
        if not self._pending or self._reference is None:
            return
        torch.cuda.synchronize()
        reference, at = self._reference
        for event, before, done in self._pending:
            event.launched_s = at + reference.elapsed_time(before) / 1e3  # elapsed_time is in ms
            event.done_s = at + reference.elapsed_time(done) / 1e3
        self._pending.clear()

    def totals(self, step: int) -> dict[str, dict[str, int]]:
        """``{kind: {"calls": n, "bytes": S summed}}`` for one step."""
        out: dict[str, dict[str, int]] = {}
        for event in self.in_step(step):
            entry = out.setdefault(event.kind, {"calls": 0, "bytes": 0})
            entry["calls"] += 1
            entry["bytes"] += event.nbytes
        return out

    def in_step(self, step: int) -> list[CommEvent]:
        """The events of one step, in launch order (looked up, not searched: a long run's last step costs
        what its first did)."""
        return list(self._by_step.get(step, []))


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
    NaN: some finish is not known (CUDA collectives before :meth:`CommLog.resolve`).
    """
    if any(math.isnan(e.done_s) for e in events):
        return math.nan
    busy = busy_seconds([(e.launched_s, e.done_s) for e in events])
    if busy <= 0:
        return 0.0
    overlapping = [(e.launched_s, min(e.done_s, compute_end_s)) for e in events
                   if not e.blocking and e.launched_s < compute_end_s]
    hidden = busy_seconds(overlapping)
    return hidden / busy
