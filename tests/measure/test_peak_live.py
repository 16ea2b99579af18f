"""dtlib.measure.peak's running total of live bytes against every followed storage measured anew: storages made,
resized in place (FSDP's ``storage.resize_(0)`` and back, which no dispatch mode sees) and freed."""

from __future__ import annotations

import torch
from torch import nn

from dtlib.measure.peak import PeakTracker


def _both(peak: PeakTracker) -> tuple[int, int]:
    """The running total and every storage followed measured now."""
    return peak.live(), peak._summed()


def test_live_bytes_follow_storages_made_resized_to_nothing_and_back_and_freed():
    model = nn.Linear(16, 16, bias=False)
    weights = 16 * 16 * 4
    with PeakTracker(model) as peak:
        assert _both(peak) == (weights, weights)
        x = torch.ones(256)  # 1 KiB
        assert _both(peak) == (weights + 1024, weights + 1024)
        x.untyped_storage().resize_(0)  # FSDP's free of a gathered weight: a call on the storage, no op
        assert _both(peak) == (weights, weights)
        x.untyped_storage().resize_(1024)  # and FSDP's gathering into it again
        assert _both(peak) == (weights + 1024, weights + 1024)
        x.resize_(512)  # aten.resize_: an op, returning what it resized
        assert _both(peak) == (weights + 2048, weights + 2048)
        torch.ops.inductor.resize_storage_bytes_(x, 0)  # an op that returns nothing
        assert _both(peak) == (weights, weights)
        torch.ops.inductor.resize_storage_bytes_(x, 4096)
        y = x.view(16, 32)  # a view: the same storage, counted once
        assert _both(peak) == (weights + 4096, weights + 4096)
        del x, y
        assert _both(peak) == (weights, weights)
    assert peak.peak == weights + 4096
    assert "resize_" not in vars(torch.UntypedStorage)  # torch's own method again, once the block is left


def test_live_bytes_outside_the_block_measure_every_storage_and_nested_trackers_each_see_resizes():
    outer_model, inner_model = nn.Linear(8, 8, bias=False), nn.Linear(4, 4, bias=False)
    with PeakTracker(outer_model) as outer:
        x = torch.ones(64)  # 256 bytes
        with PeakTracker(inner_model) as inner:
            y = torch.ones(32)  # 128 bytes, followed by both
            y.untyped_storage().resize_(0)
            x.untyped_storage().resize_(0)
            assert _both(inner) == (4 * 4 * 4, 4 * 4 * 4)
            assert _both(outer) == (8 * 8 * 4, 8 * 8 * 4)
        y.untyped_storage().resize_(512)  # the inner tracker is out of its block: the outer still sees it
        assert _both(outer) == (8 * 8 * 4 + 512, 8 * 8 * 4 + 512)
    x.untyped_storage().resize_(256)  # neither sees this; live() outside the block measures it anyway
    assert outer.live() == 8 * 8 * 4 + 512 + 256
    assert inner.live() == 4 * 4 * 4 + 512
    assert "resize_" not in vars(torch.UntypedStorage)


def test_the_running_total_equals_every_storage_measured_at_every_check_of_a_simulated_step(monkeypatch):
    """A simulated pipeline with FSDP2 (which frees its gathered weights by resizing their storages to nothing and
    gathers into them again) and tensor parallelism: at every check of the peak, the running total is what
    measuring every storage followed gives."""
    from dtlib.sim.llama import Shape
    from dtlib.sim.step import parallelize, simulate

    def mine(model, mesh, checkpointing=False):  # not dtlib's own: simulated here, never a kept answer
        return parallelize(model, mesh, checkpointing)

    checked: list[tuple[int, int]] = []
    resized: list[int] = []
    check, resize = PeakTracker._check_peak, torch.UntypedStorage.resize_

    def checking(self, *read):
        checked.append(_both(self))
        return check(self, *read)

    def resizing(storage, size):
        resized.append(size)
        return resize(storage, size)

    monkeypatch.setattr(PeakTracker, "_check_peak", checking)
    monkeypatch.setattr(torch.UntypedStorage, "resize_", resizing)
    shape = Shape(layers=4, hidden=64, heads=4, kv_heads=2, ffn=160, vocab=256)
    simulate(shape, pp=2, dp=2, tp=2, seq_len=16, micro_batches=3, depths=None, parallelize=mine)
    assert 0 in resized and any(size > 0 for size in resized)  # freed and gathered again, in the measured step
    assert len(checked) > 1000 and all(running == measured for running, measured in checked)


def test_a_tracker_whose_mode_cannot_start_leaves_nothing_installed(monkeypatch):
    """A dispatch mode that fails to start (its ``__enter__`` raising) must not leave the resize watch, the
    saved-tensor hooks or the optimizer's hooks behind: they would count every later storage."""
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def refuse(self):
        raise RuntimeError("no mode today")

    monkeypatch.setattr(torch.utils._python_dispatch.TorchDispatchMode, "__enter__", refuse)
    try:
        with PeakTracker(model, optimizer):
            raise AssertionError("the block must not run")
    except RuntimeError as err:
        assert "no mode today" in str(err)
    assert "resize_" not in vars(torch.UntypedStorage)
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None  # no saved-tensor hooks left
