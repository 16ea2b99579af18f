"""dtlib.measure.stages: a schedule's spans, bubble and activations in flight, against hand-made timelines and
torch's own pipeline schedules (GPipe holds every micro-batch, 1F1B at most one per stage)."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dtlib
from dtlib.measure.stages import StageClock, _cycles_per_second, bubble, in_flight_peak, pipeline_bubble
from dtlib.measure.timing import DeviceClock


def test_bubble_and_in_flight_on_hand_made_spans():
    rank_0 = [("F", 0, 0, 0.0, 1.0), ("F", 0, 1, 1.0, 2.0), ("B", 0, 0, 3.0, 4.0), ("B", 0, 1, 4.0, 5.0)]
    rank_1 = [("F", 1, 0, 1.0, 2.0), ("B", 1, 0, 2.0, 3.0), ("F", 1, 1, 3.0, 4.0), ("B", 1, 1, 4.0, 4.5)]
    assert bubble([rank_0]) == pytest.approx(1 - 4 / 5)
    assert bubble([rank_0, rank_1]) == pytest.approx(1 - (4 + 3.5) / (2 * 5))
    assert in_flight_peak(rank_0, 0) == 2 and in_flight_peak(rank_1, 1) == 1 and in_flight_peak(rank_0, 1) == 0
    with pytest.raises(ValueError, match="no spans"):
        bubble([[], []])


def test_the_clock_records_each_pass_with_its_micro_batch_and_changes_no_gradient():
    clock = StageClock()
    torch.manual_seed(0)
    layer = nn.Linear(3, 3)
    wrapped = clock.wrap(layer, stage=2)
    for _ in range(2):
        wrapped(torch.ones(1, 3)).sum().backward()
    assert [(kind, stage, index) for kind, stage, index, _, _ in clock.spans()] == [
        ("F", 2, 0), ("B", 2, 0), ("F", 2, 1), ("B", 2, 1)]
    assert torch.allclose(layer.weight.grad, 2 * torch.ones(3, 1) @ torch.ones(1, 3))  # the plain layer's gradient
    clock.clear()
    assert clock.spans() == []
    slow = StageClock(forward_s=0.01)
    slow.wrap(nn.Identity(), 0)(torch.ones(1, requires_grad=True))
    assert slow.spans()[0][4] - slow.spans()[0][3] >= 0.01  # a sleep of at least the time asked
    with pytest.raises(ValueError, match=">= 0"):
        StageClock(backward_s=-1)
    with pytest.raises(ValueError, match="finite"):
        StageClock(forward_s=float("nan"))
    with pytest.raises(TypeError, match="one tensor"):
        StageClock().wrap(nn.LSTM(2, 2), 0)(torch.ones(1, 1, 2))


def _pipelined(rank, world_size, schedule, micro_batches):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    clock = StageClock(forward_s=0.002, backward_s=0.004)
    torch.manual_seed(0)
    model = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(world_size)]
    stage = PipelineStage(clock.wrap(model[rank], rank), rank, world_size, torch.device("cpu"))
    kind = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[schedule]
    pipe = kind(stage, n_microbatches=micro_batches, loss_fn=F.mse_loss)
    torch.manual_seed(1)
    x, y = torch.randn(2 * micro_batches, 8), torch.randn(2 * micro_batches, 8)
    for _ in range(2):  # the first step also infers shapes
        clock.clear()
        model[rank].zero_grad()
        losses = []
        pipe.step(*(x,) if rank == 0 else (), **({"target": y, "losses": losses} if rank == world_size - 1 else {}))
    reference = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(world_size)]  # same seed, one process
    for a, b in zip(reference, model, strict=True):
        a.load_state_dict(b.state_dict())
    out = x
    for layer in reference:
        out = layer(out)
    F.mse_loss(out, y).backward()
    same = torch.allclose(model[rank][0].weight.grad, reference[rank][0].weight.grad, atol=1e-6)
    return clock.spans(), same, [loss.item() for loss in losses]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule, held", [("GPipe", 6), ("1F1B", 3)])
def test_gpipe_holds_every_micro_batch_and_1f1b_one_per_stage(schedule, held):
    reports = dtlib.spawn(_pipelined, 3, args=(schedule, 6), output="none", timeout=120)
    spans = [spans for spans, _, _ in reports]
    assert [in_flight_peak(s, rank) for rank, s in enumerate(spans)] == (
        [6, 6, 6] if schedule == "GPipe" else [3, 2, 1])  # 1F1B: p - stage
    assert all(same for _, same, _ in reports)  # every stage's gradient equals one process's
    assert all(len(s) == 12 for s in spans)  # 6 forwards and 6 backwards per rank, the inference step left out
    assert 0 < bubble(spans) < 1


class _SlowLayer(nn.Module):
    def forward(self, x):
        import time

        time.sleep(0.02)
        return x * 2


def test_a_forward_span_holds_the_modules_own_work_and_evaluation_is_not_recorded():
    clock = StageClock()
    stage = clock.wrap(_SlowLayer(), stage=0)
    out = stage(torch.ones(2, requires_grad=True))
    out.add_(1)  # the output is a tensor of its own: in-place ops on it are legal
    (kind, _, _, start, end), = clock.spans()
    assert kind == "F" and end - start >= 0.02  # the layer's own 20 ms, with no stand-in sleep
    with torch.no_grad():
        stage(torch.ones(2))
    assert len(clock.spans()) == 1  # no backward will follow an evaluation: nothing in flight


# -- on a GPU: spans from CUDA events ------------------------------------------------------
class _LaggingGPU:
    """A stand-in for one CUDA device whose queue runs behind the CPU, as a real one does under NCCL: work is
    queued and the call returns at once; an event passes when the queue reaches it; ``_sleep`` occupies the
    queue, never the CPU. Times are on perf_counter's clock, so what the clock should report is known."""

    cycles_per_second = 1e9

    def __init__(self) -> None:
        self.free_at = time.perf_counter()  # the queue is busy with earlier work until then
        self.synchronized = 0
        gpu = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.at, self.device = None, torch.device("cuda", 0)

            def record(self, stream: object = None) -> None:
                self.at = gpu.free_at = max(gpu.free_at, time.perf_counter())

            def synchronize(self) -> None:  # the CPU waits until the queue has reached the event
                _cpu_sleep(max(0.0, self.at - time.perf_counter()))

            def elapsed_time(self, other: Event) -> float:
                return (other.at - self.at) * 1e3  # ms, as CUDA reports it

        self.Event = Event

    def sleep(self, cycles: int) -> None:
        self.free_at = max(self.free_at, time.perf_counter()) + cycles / self.cycles_per_second

    def synchronize(self, device: object = None) -> None:  # the CPU waits until the queue is empty
        self.synchronized += 1
        _cpu_sleep(max(0.0, self.free_at - time.perf_counter()))


_cpu_sleep = time.sleep


@pytest.fixture
def lagging_gpu(monkeypatch):
    from dtlib.measure import stages

    gpu = _LaggingGPU()
    monkeypatch.setattr(torch.cuda, "Event", gpu.Event)
    monkeypatch.setattr(torch.cuda, "_sleep", gpu.sleep)
    monkeypatch.setattr(torch.cuda, "synchronize", gpu.synchronize)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    stages._cycles_per_second.cache_clear()
    yield gpu
    stages._cycles_per_second.cache_clear()  # never keep the stand-in's rate for a real GPU


def test_cuda_spans_are_the_gpus_times_on_the_cpus_clock_and_the_cpu_never_sleeps(lagging_gpu, monkeypatch):
    """The oracle is the stand-in GPU's own timeline. Behind 0.3 s of queued work, each pass is queued at once
    (the CPU never sleeps), takes forward_s and backward_s on the GPU, and lands after that work; spans()
    synchronises once and reads them on the CPU's clock. The CPU's clock alone would give spans of 0 s at once."""
    cuda = torch.device("cuda", 0)
    clock = StageClock(forward_s=0.05, backward_s=0.1)
    clock._record("F", 1, clock.forward_s, clock._now(cuda), cuda)  # a first step: calibration and reference
    clock.clear()
    cpu_sleeps = []
    monkeypatch.setattr(time, "sleep", cpu_sleeps.append)
    before = lagging_gpu.synchronized
    lagging_gpu.sleep(int(0.3 * lagging_gpu.cycles_per_second))  # earlier work that the CPU does not wait for
    backlog_ends = lagging_gpu.free_at
    clock._record("F", 1, clock.forward_s, clock._now(cuda), cuda)
    clock._record("B", 1, clock.backward_s, device=cuda)
    assert cpu_sleeps == [] and lagging_gpu.synchronized == before  # queued: nothing waited
    (f_kind, _, _, f_start, f_end), (b_kind, _, _, b_start, b_end) = clock.spans()
    assert (f_kind, b_kind) == ("F", "B") and lagging_gpu.synchronized == before + 1
    assert f_end - f_start == pytest.approx(0.05, abs=1e-6) and b_end - b_start == pytest.approx(0.1, abs=1e-6)
    assert b_start == pytest.approx(f_end, abs=1e-6)  # back to back on the GPU's queue
    assert f_start == pytest.approx(backlog_ends, abs=0.05)  # on the CPU's clock, give or take the reference
    assert clock.spans()[0][3:] == (f_start, f_end)  # read once: floats from then on


def test_the_device_clock_reads_the_cpu_clock_on_a_cpu():
    clock = DeviceClock("cpu")
    start = clock.mark()
    time.sleep(0.01)
    end = clock.mark()
    assert isinstance(start, float) and clock.seconds(start) == start
    assert 0.01 <= clock.elapsed(start, end) == end - start


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_each_pass_is_timed_on_the_gpu_behind_queued_work():
    """A real GPU, one process: 200 ms of work queued ahead of the stage, which the CPU does not wait for.
    The forward span must start after that work and last forward_s, the backward span backward_s, on the
    CPU's clock; read from the CPU's clock alone, the forward would have started at once."""
    device = torch.device("cuda", torch.cuda.current_device())
    clock = StageClock(forward_s=0.02, backward_s=0.04)
    stage = clock.wrap(nn.Linear(8, 8).to(device), stage=0)
    x = torch.ones(4, 8, device=device, requires_grad=True)
    stage(x).sum().backward()  # warm-up: calibration, the reference event, the kernels' first launch
    clock.clear()
    torch.cuda.synchronize()
    queued = time.perf_counter()
    torch.cuda._sleep(round(0.2 * _cycles_per_second(device)))  # 200 ms of earlier work on the stream
    stage(x).sum().backward()
    (_, _, _, f_start, f_end), (_, _, _, b_start, b_end) = clock.spans()
    assert f_start >= queued + 0.15  # the GPU reached the stage after the queued work
    assert 0.015 <= f_end - f_start < 0.2 and 0.03 <= b_end - b_start < 0.2
    assert f_end <= b_start


def _gpipe_on_gpus(rank, world_size):
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    device = dtlib.rank_device()
    clock = StageClock(forward_s=0.01, backward_s=0.02)
    torch.manual_seed(0)
    model = [nn.Linear(8, 8).to(device) for _ in range(world_size)]
    pipe = ScheduleGPipe(PipelineStage(clock.wrap(model[rank], rank), rank, world_size, device), n_microbatches=4,
                         loss_fn=F.mse_loss)
    x, y = torch.randn(8, 8, device=device), torch.randn(8, 8, device=device)
    for _ in range(2):
        clock.clear()
        pipe.step(*(x,) if rank == 0 else (), **({"target": y} if rank == world_size - 1 else {}))
    return device.type, clock.spans()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.timeout(180)
def test_on_nccl_the_last_stage_starts_after_the_first_forward_arrives():
    """NCCL never blocks the CPU, so only GPU times can show the pipeline filling: stage 1's first forward
    starts after stage 0's first forward has ended, and the bubble lies strictly between 0 and 1."""
    (kind_0, first), (kind_1, last) = dtlib.spawn(_gpipe_on_gpus, 2, output="none", timeout=150)
    assert kind_0 == kind_1 == "cuda"
    # each rank puts its events on the CPU's clock through its own reference: allow it a millisecond or two
    assert last[0][3] >= first[0][4] - 0.002 and all(end - start >= 0.009 for *_, start, end in first + last)
    assert 0 < bubble([first, last]) < 1


def test_the_bubble_formula():
    assert pipeline_bubble(4, 8) == 3 / 11 and pipeline_bubble(1, 5) == 0.0
    assert pipeline_bubble(4, 8, chunks=2) == 3 / 19  # interleaved: the bubble divides by about v
    with pytest.raises(ValueError, match="must be >= 1"):
        pipeline_bubble(0, 8)
