"""dtlib.train.ddp_options: each experiment run once, its numbers checked against the physics they illustrate."""

from __future__ import annotations

import math

import pytest

import dtlib
from dtlib.train import ddp_options, models
from dtlib.train.ddp import TrainConfig, run


def _grad_bytes(name: str) -> int:
    return 4 * sum(p.numel() for p in models.build(name).parameters())  # float32


def _finite(values) -> bool:
    return len(values) > 0 and all(math.isfinite(v) for v in values)


@pytest.fixture(scope="module")
def layout():
    return ddp_options.bucket_layout([None, 0.001])  # DDP's default cap (25 MB), then ~1 KB: one per gradient


@pytest.mark.timeout(180)
def test_bucket_layout(layout):
    total = _grad_bytes("wide_mlp")
    for row in layout:
        assert row["calls"][0] == 1 and row["bucket_bytes"][0] == [total]  # step 0: every gradient in one bucket
        assert row["calls"][1:] == [len(sizes) for sizes in row["bucket_bytes"][1:]]
        assert row["bucket_bytes"][1] == row["bucket_bytes"][2]  # rebuilt once, after step 0
        assert all(sum(sizes) == total for sizes in row["bucket_bytes"])  # nothing sent twice or skipped
        assert row["bytes_per_step"] == total
        assert row["find_unused_parameters"] is False and row["static_graph"] is False
    default, tiny = layout
    assert default["calls"][1] == 2  # the 1 MiB first bucket, then the rest under 25 MB
    first = default["bucket_bytes"][1][0]  # closes once it reaches 1 MiB; a gradient is never split
    assert 2**20 <= first < 2**20 + 4 * 512 * 512
    assert tiny["calls"][1] > default["calls"][1]
    assert tiny["calls"][1] == 9  # 10 tensors; the last layer's 4-byte bias shares a bucket with its weight


@pytest.mark.timeout(180)
def test_bucket_cap_is_a_threshold_and_a_gradient_is_never_split():
    # wide_mlp, last layer first: 4 B + 2 KiB (output layer), then per hidden layer a 2 KiB bias and a 1 MiB weight
    (row,) = ddp_options.bucket_layout([0.5], steps=2)
    hidden_weight, bias = 4 * 512 * 512, 4 * 512
    assert row["bucket_bytes"][1] == [4 + 4 * 512 + bias + hidden_weight, bias + hidden_weight, bias + hidden_weight,
                                      bias + 4 * 16 * 512]


@pytest.mark.timeout(240)
def test_find_unused_parameters_and_static_graph_change_the_bucket_schedule():
    total = _grad_bytes("wide_mlp")
    (unused,) = ddp_options.bucket_layout([None], find_unused_parameters=True)
    assert unused["calls"][0] > 1  # several buckets from step 0: assigned at construction
    assert unused["bucket_bytes"][0] == unused["bucket_bytes"][1] == unused["bucket_bytes"][2]  # never rebuilt
    assert all(sum(sizes) == total for sizes in unused["bucket_bytes"])
    (static,) = ddp_options.bucket_layout([None], static_graph=True)
    assert static["calls"] == [1, 1, 2]  # one bucket for steps 0 and 1, rebuilt after
    assert static["bucket_bytes"][0] == static["bucket_bytes"][1] == [total]


@pytest.mark.timeout(180)
def test_unused_parameters_need_the_flag():
    with pytest.raises(dtlib.WorkerError, match="find_unused_parameters"):
        run(TrainConfig(model="branchy", steps=2), 2, output="none")


@pytest.mark.timeout(180)
def test_find_unused_parameters_searches_every_step_and_static_graph_never():
    search = ddp_options.unused_parameter_search(steps=3)
    branch = models.build("branchy").branch
    unused_bytes = 4 * (branch.weight.numel() + branch.bias.numel())  # float32: the head that is never used
    flag, static = search["find_unused_parameters=True"], search["static_graph=True"]
    assert flag["searches"] == [1, 1, 1]
    assert static["searches"] == [0, 0, 0]
    assert flag["unused_bytes"] == static["unused_bytes"] == unused_bytes == 260
    assert flag["losses"] == static["losses"] and _finite(flag["losses"])


@pytest.mark.timeout(180)
def test_gradient_as_bucket_view_keeps_no_separate_gradients_unless_set_to_none():
    views = ddp_options.gradient_views(model="mlp", steps=3)
    total, tensors = _grad_bytes("mlp"), len(list(models.build("mlp").parameters()))
    plain = views["gradient_as_bucket_view=False, set_to_none=True"]
    as_view = views["gradient_as_bucket_view=True, set_to_none=False"]
    to_none = views["gradient_as_bucket_view=True, set_to_none=True"]
    assert plain["grad_bytes_apart"] == total and plain["copied_per_step"] == [tensors] * 3  # .grad and the bucket
    assert as_view["grad_bytes_apart"] == 0  # .grad is a view into the bucket
    assert as_view["copied_per_step"] == [tensors, 0, 0]  # step 0 has no .grad yet to be a view
    assert to_none["grad_bytes_apart"] == 0  # set_to_none does not detach .grad for good: DDP re-points it
    assert to_none["copied_per_step"] == [tensors] * 3  # but every step copies again
    assert plain["losses"] == as_view["losses"] == to_none["losses"] and _finite(plain["losses"])


@pytest.mark.timeout(180)
def test_buffer_sync_keeps_batchnorm_statistics_closer():
    spread = ddp_options.buffer_sync(steps=3)
    assert 0 < spread["sync_buffers=True"] < spread["sync_buffers=False"]


@pytest.mark.timeout(240)
def test_resumed_training_equals_uninterrupted_training(stop_and_resume):
    # 16 steps per epoch (512 samples, 2 ranks, 16 per rank): stopping after 17 resumes inside epoch 1
    losses = stop_and_resume(run, TrainConfig(model="mlp"), 2, steps=20, stop_after=17, location="checkpoint_path")
    assert len(losses["straight"]) == 20 and _finite(losses["straight"])
    assert losses["stopped_and_resumed"] == losses["straight"]


@pytest.mark.parametrize("stop_after, steps", [(0, 10), (10, 10), (12, 10), (-1, 10)])
def test_bad_stop_after_is_refused(stop_after, steps, stop_and_resume):
    with pytest.raises(ValueError, match=f"need 0 < stop_after < steps, got {stop_after} and {steps}"):
        stop_and_resume(run, TrainConfig(model="mlp"), 2, steps=steps, stop_after=stop_after,
                        location="checkpoint_path")


def test_sampler_coverage_numbers():
    padded = ddp_options.sampler_coverage(10, 4)
    assert padded["samples_per_rank"] == 3 and len(padded["repeated"]) == 2 and padded["dropped"] == []
    assert len(padded["per_rank"]) == 4
    dropped = ddp_options.sampler_coverage(10, 4, drop_last=True)
    assert dropped["samples_per_rank"] == 2 and dropped["repeated"] == [] and len(dropped["dropped"]) == 2
    even = ddp_options.sampler_coverage(12, 4)
    assert even["samples_per_rank"] == 3 and even["repeated"] == [] and even["dropped"] == []


@pytest.mark.timeout(120)
def test_data_parallel_counts_and_runs_the_gpus_in_a_child_process(monkeypatch):
    """This process claims two GPUs more than the machine has: a count taken here would then try to run
    DataParallel here (and initialise CUDA in a notebook's kernel); the child counts the real ones."""
    import torch

    gpus = torch.cuda.device_count()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus + 2)
    result = ddp_options.data_parallel(steps=3)
    assert result["gpus"] == gpus
    assert ("step_ms" in result) == (gpus >= 2) and ("note" in result) == (gpus < 2)
    assert not torch.cuda.is_initialized()
