"""When each pipeline stage runs forward and backward, per micro-batch: a clock for pipeline schedules.

:class:`StageClock` wraps a stage's module so that every forward and every backward through it is
recorded with its start and end on ``time.perf_counter`` (CLOCK_MONOTONIC on Linux: one clock that every
process of the machine shares, so the ranks' records line up). It can also make each pass take a fixed
time, a stand-in for a GPU kernel: on a laptop the ranks share a few CPU cores, and a schedule's chart
would then show their contention instead of the schedule. The work is a sleep, which leaves the cores free.

A stage on a GPU is timed on the GPU (:class:`dtlib.measure.timing.DeviceClock`): under NCCL neither a kernel
nor a send or a receive blocks the CPU, so the CPU's clock would time the queueing of the work, not the
schedule. Each span starts and ends at a CUDA event on the current stream, the stand-in work is a GPU sleep
(``torch.cuda._sleep``) of the same length, and :meth:`StageClock.spans` synchronises once and puts the events
on ``perf_counter``'s clock, so the ranks' spans still line up.

The records give what a schedule is judged by: :func:`bubble`, the share of the ranks' time spent idle
inside the step, and :func:`in_flight_peak`, the most micro-batches whose activations a stage held at
once (GPipe holds every micro-batch; 1F1B at most the number of stages).

Example (inside a rank)::

    clock = StageClock(forward_s=0.01, backward_s=0.02)
    stage_module = clock.wrap(nn.Linear(16, 16), stage=rank)
    ...  # run a schedule
    clock.spans()   # [("F", stage, micro_batch, start_s, end_s), ...]
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from dtlib.measure.timing import DeviceClock

Span = tuple[str, int, int, float, float]  # ("F" or "B", stage, micro-batch, start s, end s)


class _Mark(torch.autograd.Function):
    """Identity that records (and, if asked, takes) time in forward and in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, clock: StageClock, stage: int, began: Any) -> torch.Tensor:
        ctx.clock, ctx.stage = clock, stage
        clock._record("F", stage, clock.forward_s, began, x.device)
        return x.clone()  # a tensor of its own: in-place ops on it, and torch's split backward, stay legal

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        ctx.clock._record("B", ctx.stage, ctx.clock.backward_s, device=grad.device)
        return grad, None, None, None


class _Clocked(nn.Module):
    def __init__(self, module: nn.Module, clock: StageClock, stage: int) -> None:
        super().__init__()
        self.module, self.clock, self.stage = module, clock, stage

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inputs = [a.device for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        began = self.clock._now(inputs[0] if inputs else None)
        out = self.module(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"StageClock wraps stages that return one tensor, got {type(out).__name__}")
        if not torch.is_grad_enabled():  # evaluation: no backward will follow, so no training pass to record
            return out
        return _Mark.apply(out, self.clock, self.stage, began)


class StageClock:
    """Records each forward and backward of the modules it wraps, as (kind, stage, start, end) on one clock.

    ``forward_s`` and ``backward_s``: the time each pass takes besides the module's own compute (a sleep).
    A forward span runs from the stage's input to its output, the module's own forward included. A backward
    span is the sleep alone, taken as the gradient arrives at the stage's output: the module's own backward
    runs after it, unrecorded, so the clock times a schedule with stand-in work, not real layers (for those,
    use torch.profiler). Under schedules that split a backward into its input and weight parts (the zero-bubble
    ones), only the input part is recorded. On a GPU the spans are CUDA events and the stand-in work is a GPU
    sleep (see the module's docstring); the records are floats again once :meth:`spans` has read them.
    """

    def __init__(self, forward_s: float = 0.0, backward_s: float = 0.0) -> None:
        if not (math.isfinite(forward_s) and math.isfinite(backward_s)) or forward_s < 0 or backward_s < 0:
            raise ValueError(f"forward_s and backward_s must be finite and >= 0, got {forward_s} and {backward_s}")
        self.forward_s, self.backward_s = forward_s, backward_s
        self.events: list[tuple[str, int, Any, Any]] = []  # start and end: seconds, or CUDA events until read
        self._clocks: dict[torch.device, DeviceClock] = {}  # one per GPU the stages run on

    def wrap(self, module: nn.Module, stage: int) -> nn.Module:
        """``module`` with every pass through it recorded as stage ``stage``; its parameters are unchanged."""
        return _Clocked(module, self, stage)

    def _gpu(self, device: torch.device | None) -> DeviceClock | None:
        """The clock of a CUDA device (None on a CPU, whose records are read from perf_counter at once)."""
        if device is None or device.type != "cuda":
            return None
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return self._clocks.setdefault(device, DeviceClock(device))

    def _now(self, device: torch.device | None) -> Any:
        gpu = self._gpu(device)
        return time.perf_counter() if gpu is None else gpu.mark()

    def _record(self, kind: str, stage: int, seconds: float, start: Any = None,
                device: torch.device | None = None) -> None:
        gpu = self._gpu(device)
        if gpu is None:
            start = time.perf_counter() if start is None else start
            if seconds:
                time.sleep(seconds)
            self.events.append((kind, stage, start, time.perf_counter()))
            return
        start = gpu.mark() if start is None else start
        if seconds:  # the stand-in work on the GPU's stream, where the stage's kernels and transfers wait for it
            with torch.cuda.device(gpu.device):
                torch.cuda._sleep(max(1, round(seconds * _cycles_per_second(gpu.device))))
        self.events.append((kind, stage, start, gpu.mark()))

    def _read(self) -> None:
        """Put every CUDA record on perf_counter's clock: one synchronize per GPU, then each event read."""
        if not self._clocks:
            return
        for device in self._clocks:
            torch.cuda.synchronize(device)
        self.events = [(kind, stage, self._on_cpu_clock(start), self._on_cpu_clock(end))
                       for kind, stage, start, end in self.events]

    def _on_cpu_clock(self, mark: Any) -> float:
        return mark if isinstance(mark, float) else self._clocks[mark.device].seconds(mark)

    def clear(self) -> None:
        """Forget what was recorded: a schedule's first step also runs its metadata inference."""
        self.events.clear()

    def spans(self) -> list[Span]:
        """The records, each with its micro-batch: GPipe, 1F1B and interleaved 1F1B run a stage's forwards, and
        its backwards, in micro-batch order, so the n-th forward (backward) of a stage is micro-batch n. (Not
        every schedule does: ScheduleLoopedBFS runs backwards last to first; a module used twice in a step
        counts twice.) On a GPU, call it after the step: it waits for the GPU to finish what was queued."""
        self._read()
        seen: dict[tuple[str, int], int] = {}
        out: list[Span] = []
        for kind, stage, start, end in self.events:
            index = seen.get((kind, stage), 0)
            seen[(kind, stage)] = index + 1
            out.append((kind, stage, index, start, end))
        return out


@functools.cache
def _cycles_per_second(device: torch.device) -> float:
    """How many cycles ``torch.cuda._sleep`` spins per second on ``device``, timed once with CUDA events."""
    # GPU run must confirm: a 10 ms stand-in (forward_s=0.01) shows as a 10 ms span, within a few percent.
    cycles = 10_000_000
    with torch.cuda.device(device):
        torch.cuda._sleep(cycles)  # warm-up: the first launch also loads the kernel
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
    return cycles / (start.elapsed_time(end) / 1e3)


def pipeline_bubble(stages: int, micro_batches: int, chunks: int = 1) -> float:
    """The idle share of a pipeline step with equal stages and free communication: (p - 1) / (v m + p - 1) for
    p stages' ranks, m micro-batches and v stages per rank (1 for GPipe and 1F1B; 2 or more interleaved).
    Example: ``pipeline_bubble(4, 8)`` is 3 / 11."""
    if stages < 1 or micro_batches < 1 or chunks < 1:
        raise ValueError(f"stages, micro_batches and chunks must be >= 1, got {stages}, {micro_batches}, {chunks}")
    return (stages - 1) / (chunks * micro_batches + stages - 1)


def bubble(spans_per_rank: Sequence[Sequence[Span]]) -> float:
    """The share of the ranks' time idle between the step's first start and its last end, all ranks together:
    1 - (time busy, summed over ranks) / (ranks x the step's length). Example: two ranks busy 3 s each
    within a 4 s step -> 0.25."""
    spans = [span for rank in spans_per_rank for span in rank]
    if not spans:
        raise ValueError("no spans recorded: wrap the stages with StageClock.wrap and run a step")
    begin, end = min(s[3] for s in spans), max(s[4] for s in spans)
    busy = sum(s[4] - s[3] for s in spans)
    return 1.0 - busy / (len(spans_per_rank) * (end - begin))


def in_flight_peak(spans: Sequence[Span], stage: int) -> int:
    """The most micro-batches of ``stage`` that had run forward but not yet backward at any moment: whose
    activations the stage held at once."""
    held = peak = 0
    for kind, where, _, _, _ in sorted(spans, key=lambda s: s[3]):
        if where == stage:
            held += 1 if kind == "F" else -1
            peak = max(peak, held)
    return peak
