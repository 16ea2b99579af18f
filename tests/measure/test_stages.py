"""dtlib.measure.stages: a schedule's spans, bubble and activations in flight, against hand-made timelines and
torch's own pipeline schedules (GPipe holds every micro-batch, 1F1B at most one per stage)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dtlib
from dtlib.measure.stages import StageClock, bubble, in_flight_peak


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
