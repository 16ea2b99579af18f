"""How long things take: the slowest rank's median (the benchmarks and the runners share it), and a clock for
work that a GPU runs after the CPU has moved on.

On a CPU a timestamp is ``time.perf_counter()``. On a GPU it cannot be: a kernel, or an NCCL transfer, is
only queued when its Python call returns, so the CPU's clock says when work was queued, not when it ran.
:class:`DeviceClock` then records CUDA events on the current stream instead, which the GPU passes when it
reaches that point of its queue, and puts them on ``perf_counter``'s clock afterwards through a reference
event recorded when GPU and CPU were in step (the pattern of :meth:`dtlib.measure.commlog.CommLog.resolve`).
Synchronising the whole device before reading the CPU's clock is no substitute: it waits for every stream,
NCCL's included, so a wait for a transfer would read as about 0.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch


def slowest_median(per_rank: Iterable[Sequence[float]], skip: int = 0) -> float:
    """Each rank's median time (its first ``skip`` times left out where others remain), then the largest.

    A collective, or a step that ends in one, finishes when its slowest rank does; the median keeps a
    busy machine's odd slow sample out. Example: ``slowest_median([[9, 1, 2], [9, 3, 3]], skip=1)`` -> 3.0.
    """
    medians = [statistics.median(times[skip:] or times) for times in per_rank]
    if not medians:
        raise ValueError("no rank's times to take the median of")
    return float(max(medians))


Mark = Any  # a float (perf_counter seconds) on a CPU, a torch.cuda.Event on a GPU


class DeviceClock:
    """Timestamps of the work that ``device`` runs, on ``time.perf_counter``'s clock.

    :meth:`mark` is the moment the device reaches this point of its work: on a CPU, now; on a GPU, a CUDA
    event on the current stream (nothing waits for it). Read marks once the work is queued, after the timed
    part: :meth:`elapsed` between two marks, :meth:`seconds` for one mark on the CPU's clock (CLOCK_MONOTONIC
    on Linux, which every process of the machine shares). Reading a GPU mark waits for it.

    Example (inside a rank)::

        clock = DeviceClock(device)
        began = clock.mark()
        y = x @ x                       # queued on the GPU, or run on the CPU
        done = clock.mark()
        clock.elapsed(began, done)      # seconds the device spent on it
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._reference: tuple[Any, float] | None = None  # (CUDA event, perf_counter) recorded in step

    def mark(self) -> Mark:
        """This point of the device's work: ``perf_counter()`` on a CPU, a recorded CUDA event on a GPU."""
        # GPU run must confirm: notebook 12's waits, read between marks on the compute stream, are not all ~0.
        if not self.cuda:
            return time.perf_counter()
        if self._reference is None:  # once: GPU and CPU in step, so the reference runs at this perf_counter
            torch.cuda.synchronize(self.device)
            reference = torch.cuda.Event(enable_timing=True)
            reference.record(torch.cuda.current_stream(self.device))
            self._reference = (reference, time.perf_counter())
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def elapsed(self, start: Mark, end: Mark) -> float:
        """Seconds between two marks (on a GPU: waits until the device has passed ``end``)."""
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3  # elapsed_time is in ms

    def seconds(self, mark: Mark) -> float:
        """``mark`` on ``time.perf_counter``'s clock (on a GPU: waits until the device has passed it)."""
        if not self.cuda:
            return mark
        # GPU run must confirm: a GPU's event timer and CLOCK_MONOTONIC drift apart by well under a
        # millisecond over the few seconds a step takes (the reference is read once per clock).
        reference, at = self._reference
        mark.synchronize()
        return at + reference.elapsed_time(mark) / 1e3
