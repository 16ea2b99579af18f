"""dtlib.ddp_options: each experiment run once, its numbers checked against the physics they illustrate."""

from __future__ import annotations

import math

import pytest
import torch

from dtlib import ddp_options, models


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
        assert row["calls"][1] == len(row["bucket_bytes"][1])
        assert [sum(sizes) for sizes in row["bucket_bytes"]] == [total, total]  # nothing sent twice or skipped
        assert row["bytes_per_step"] == total
    default, tiny = layout
    assert default["calls"][1] == 2  # the 1 MiB first bucket, then the rest under 25 MB
    first = default["bucket_bytes"][1][0]  # closes once it reaches 1 MiB; a gradient is never split
    assert 2**20 <= first < 2**20 + 4 * 512 * 512
    assert tiny["calls"][1] > default["calls"][1]
    assert tiny["calls"][1] == 9  # 10 tensors; the last layer's 4-byte bias shares a bucket with its weight


@pytest.fixture(scope="module")
def unused():
    return ddp_options.unused_parameters(steps=2)


@pytest.mark.timeout(240)
def test_unused_parameters_need_the_flag(unused):
    assert "find_unused_parameters" in unused["error"]
    assert len(unused["losses_with_flag"]) == 2 and _finite(unused["losses_with_flag"])
    assert unused["step_s_without_flag"] > 0 and unused["step_s_with_needless_flag"] > 0


@pytest.mark.timeout(180)
def test_gradient_as_bucket_view_keeps_no_separate_gradients():
    views = ddp_options.gradient_views(model="mlp")
    total = _grad_bytes("mlp")
    assert views["False"]["grad_bytes_separate"] == total  # .grad and the bucket: two copies
    assert views["True"]["grad_bytes_separate"] == 0  # .grad is a view into the bucket
    assert views["False"]["bucket_bytes"] == views["True"]["bucket_bytes"] == total
    assert views["False"]["losses"] == views["True"]["losses"] and _finite(views["True"]["losses"])


@pytest.mark.timeout(180)
def test_static_graph_changes_nothing_in_the_numbers():
    result = ddp_options.static_graph(steps=3)
    assert result["losses_equal"] is True and result["max_loss_difference"] == 0.0
    assert all(seconds > 0 for seconds in result["step_s"].values())


@pytest.fixture(scope="module")
def hooks():
    return {row["hook"]: row for row in ddp_options.comm_hooks(steps=3)}  # PowerSGD compresses from step 2


@pytest.mark.timeout(240)
def test_compression_hooks_send_fewer_bytes(hooks):
    default = hooks["allreduce (default)"]
    assert default["bytes_per_step"] == _grad_bytes("wide_mlp") and default["calls_per_step"] == 1
    assert hooks["fp16"]["bytes_per_step"] == hooks["bf16"]["bytes_per_step"] == default["bytes_per_step"] // 2
    assert hooks["powersgd"]["bytes_per_step"] < 0.1 * default["bytes_per_step"]
    for row in hooks.values():
        assert len(row["losses"]) == 3 and _finite(row["losses"]), row["hook"]


@pytest.mark.timeout(240)
def test_compression_only_perturbs_the_losses(hooks):
    default = hooks["allreduce (default)"]["losses"]
    for name in ("fp16", "bf16"):
        assert hooks[name]["losses"][0] == default[0]  # before any update
        assert hooks[name]["losses"] == pytest.approx(default, rel=1e-4)
    assert hooks["powersgd"]["losses"] == pytest.approx(default, rel=1e-6)  # steps 0 and 1: plain all-reduce


@pytest.mark.timeout(180)
def test_buffer_sync_keeps_batchnorm_statistics_closer():
    spread = ddp_options.buffer_sync(steps=3)
    assert 0 < spread["sync_buffers=True"] < spread["sync_buffers=False"]


@pytest.mark.timeout(90)
def test_batchnorm_statistics_are_the_whole_batch_statistics():
    reports = ddp_options.batchnorm_statistics()
    samples = []
    for rank in range(2):  # the data each rank made, remade here
        torch.manual_seed(rank)
        samples.append(torch.randn(8, 4) + rank)
    whole = torch.cat(samples)  # (16, 4)
    for rank, report in enumerate(reports):
        torch.testing.assert_close(report["local_mean"], samples[rank].mean(0))
        torch.testing.assert_close(report["global_mean"], whole.mean(0), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(report["global_var"], whole.var(0, unbiased=False), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(report["whole_mean"], whole.mean(0))
        assert report["converted_layer"] == "SyncBatchNorm"
        assert report["sync_bn_mean"] is None  # gloo: the real layer needs GPUs
    assert not torch.allclose(reports[0]["local_mean"], reports[1]["local_mean"])


@pytest.mark.timeout(240)
def test_resumed_training_equals_uninterrupted_training():
    # 16 steps per epoch (512 samples, 2 ranks, 16 per rank): stopping after 17 resumes inside epoch 1
    losses = ddp_options.resume_from_checkpoint(steps=20, stop_after=17)
    assert len(losses["straight"]) == 20 and _finite(losses["straight"])
    assert losses["stopped_and_resumed"] == losses["straight"]


@pytest.mark.parametrize("stop_after, steps", [(0, 10), (10, 10), (12, 10), (-1, 10)])
def test_bad_stop_after_is_refused(stop_after, steps):
    with pytest.raises(ValueError, match=f"need 0 < stop_after < steps, got {stop_after} and {steps}"):
        ddp_options.resume_from_checkpoint(steps=steps, stop_after=stop_after)


def test_sampler_coverage_numbers():
    padded = ddp_options.sampler_coverage(10, 4)
    assert padded["samples_per_rank"] == 3 and len(padded["repeated"]) == 2 and padded["dropped"] == []
    assert len(padded["per_rank"]) == 4
    dropped = ddp_options.sampler_coverage(10, 4, drop_last=True)
    assert dropped["samples_per_rank"] == 2 and dropped["repeated"] == [] and len(dropped["dropped"]) == 2
    even = ddp_options.sampler_coverage(12, 4)
    assert even["samples_per_rank"] == 3 and even["repeated"] == [] and even["dropped"] == []
