"""dtlib.train.ddp: DDP on N ranks reaches what one process reaches with the whole global batch."""

from __future__ import annotations

import errno
import io
import math
import os
import re
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

import dtlib
from dtlib.train import ddp, models
from dtlib.train.ddp_scratch import BucketedDDP, NaiveDDP, _trainable

CONFIG = ddp.TrainConfig(steps=6)


def _num_params(name: str) -> int:
    return sum(p.numel() for p in models.build(name).parameters())


@pytest.fixture(scope="module")
def plain():
    return ddp.run(CONFIG, 2, output="none")


@pytest.fixture(scope="module")
def single():
    return ddp.train_single(CONFIG)


@pytest.fixture(scope="module")
def accumulated():
    """grad_accum=4: under no_sync (one all-reduce per step), and without it (one per micro-batch)."""
    return {no_sync: ddp.run(replace(CONFIG, grad_accum=4, no_sync=no_sync), 2, output="none")
            for no_sync in (True, False)}


def _assert_matches_single(results, reference, what):
    assert reference.params is not None and reference.params.numel() > 0
    for result in results:
        torch.testing.assert_close(result.params, reference.params, rtol=0, atol=1e-5,
                                   msg=lambda m, r=result.rank: f"{what}, rank {r}: {m}")
    mean_losses = np.mean([result.losses for result in results], axis=0)  # equal batch sizes: mean of means
    np.testing.assert_allclose(mean_losses, reference.losses, rtol=0, atol=1e-5, err_msg=what)


@pytest.mark.timeout(120)
def test_two_ranks_reach_the_single_process_parameters(plain, single):
    _assert_matches_single(plain, single, "DDP x2")
    assert torch.equal(plain[0].params, plain[1].params)  # replicas stay bit-identical
    assert plain[0].losses != plain[1].losses  # the ranks saw different samples
    assert not torch.allclose(plain[0].params, ddp.train_single(replace(CONFIG, steps=1)).params)  # it trained


@pytest.mark.timeout(180)
def test_gradient_accumulation_gives_the_same_parameters(accumulated, plain, single):
    for no_sync, results in accumulated.items():
        _assert_matches_single(results, single, f"grad_accum=4, no_sync={no_sync}")
        for result, reference in zip(results, plain, strict=True):
            torch.testing.assert_close(result.params, reference.params, rtol=0, atol=1e-5)
            np.testing.assert_allclose(result.losses, reference.losses, rtol=0, atol=1e-5)


@pytest.mark.timeout(180)
def test_no_sync_communicates_once_per_step_and_without_it_once_per_micro_batch(accumulated, plain):
    for with_no_sync, without, reference in zip(accumulated[True], accumulated[False], plain, strict=True):
        assert with_no_sync.comm_calls == reference.comm_calls == [1] * CONFIG.steps
        assert with_no_sync.comm_bytes == reference.comm_bytes
        assert without.comm_calls == [4 * calls for calls in reference.comm_calls]
        assert without.comm_bytes == [4 * nbytes for nbytes in reference.comm_bytes]


@pytest.mark.timeout(180)
def test_transformer_on_four_ranks_matches_one_process():
    """Four ranks, the transformer, and ``gradient_as_bucket_view`` (gradients live in DDP's buckets and are
    zeroed, not freed): one run for two claims, to keep the suite fast."""
    config = ddp.TrainConfig(model="transformer", steps=3, global_batch=16, gradient_as_bucket_view=True)
    results = ddp.run(config, 4, output="none")
    assert [r.rank for r in results] == [0, 1, 2, 3] and {r.world_size for r in results} == {4}
    reference = ddp.train_single(config, world_size=4)
    _assert_matches_single(results, reference, "transformer, DDP x4")
    assert reference.losses[0] == pytest.approx(math.log(models.VOCAB), rel=0.1)  # near uniform at the start
    params = _num_params("transformer")
    for result in results:
        assert result.comm_bytes == [4 * params] * config.steps


@pytest.mark.timeout(120)
def test_rank_result_sanity(plain):
    params = _num_params("mlp")
    for rank, result in enumerate(plain):
        assert (result.rank, result.world_size, result.backend, result.first_step) == (rank, 2, "gloo", 0)
        for name in ("losses", "step_times_s", "comm_calls", "comm_bytes", "comm_sizes", "hidden_share"):
            assert len(getattr(result, name)) == CONFIG.steps, name
        assert all(math.isfinite(loss) for loss in result.losses)
        assert result.comm_bytes[-1] == 4 * params  # float32 gradients, once, with the default allreduce hook
        assert result.comm_sizes == [[4 * params]] * CONFIG.steps  # the mlp fits one bucket
        assert all(t > 0 for t in result.step_times_s)
        assert all(0 <= h <= 1 for h in result.hidden_share)
        assert len(result.timeline["comm"]) == 1 and result.timeline["step"] == CONFIG.steps - 1
        assert result.params.shape == result.grads.shape == (params,)
        assert result.buffers.numel() == 0  # the mlp has no buffers


def _refused_before_any_process(monkeypatch, config, world_size, pattern):
    def no_processes(*args, **kwargs):
        raise AssertionError("ddp.run started processes for a config it should refuse")

    monkeypatch.setattr(sys.modules["dtlib.launch.entry"], "spawn", no_processes)
    monkeypatch.setattr(sys.modules["dtlib.launch.spawn"], "spawn", no_processes)
    with pytest.raises(ValueError, match=pattern) as info:  # the patched spawn proves no process started
        ddp.run(config, world_size, output="none")
    return str(info.value)


@pytest.mark.parametrize("config, world_size, pattern", [
    (ddp.TrainConfig(model="resnet"), 2, r"unknown model 'resnet'; choose one of mlp, wide_mlp, transformer"),
    (ddp.TrainConfig(wrapper="apex"), 2, r"wrapper must be one of .*'ddp'.*got 'apex'"),
    (ddp.TrainConfig(steps=0), 2, r"grad_accum and global_batch must all be >= 1"),
    (ddp.TrainConfig(num_samples=4, global_batch=4), 8, r"world_size=8 is larger than the data set \(4 samples\)"),
    (ddp.TrainConfig(global_batch=1024), 2, r"global_batch=1024 exceeds the 512 samples"),
    (ddp.TrainConfig(resume=True), 2, r"saving or resuming needs checkpoint_path"),
    (ddp.TrainConfig(save_after_step=2), 2, r"saving or resuming needs checkpoint_path"),
    (ddp.TrainConfig(straggler_ms=-5), 2, r"straggler_ms must be >= 0, got -5"),
])
def test_bad_settings_are_refused_before_any_process_starts(monkeypatch, config, world_size, pattern):
    _refused_before_any_process(monkeypatch, config, world_size, pattern)


@pytest.mark.parametrize("config, world_size, pattern", [
    (ddp.TrainConfig(steps=2.5), 2, r"^steps must be a whole number \(an int\), got 2.5$"),
    (ddp.TrainConfig(global_batch=32.0), 2, r"^global_batch must be a whole number \(an int\), got 32.0$"),
    (ddp.TrainConfig(grad_accum="2"), 2, r"^grad_accum must be a whole number \(an int\), got '2'$"),
    (ddp.TrainConfig(threads=True), 2, r"^threads must be a whole number \(an int\), got True$"),
    (ddp.TrainConfig(), 2.0, r"^world_size must be a whole number \(an int\), got 2.0$"),
    (ddp.TrainConfig(save_after_step=1.5, checkpoint_path="x.pt"), 2, r"^save_after_step must be a whole number"),
    (ddp.TrainConfig(steps=4, save_after_step=5, checkpoint_path="x.pt"), 2,
     r"save_after_step=5 is not one of the steps 1..4, so nothing would be saved; use a value from 1 to steps=4"),
    (ddp.TrainConfig(save_after_step=0, checkpoint_path="x.pt"), 2, r"save_after_step=0 is not one of the steps"),
], ids=["steps=2.5", "global_batch=32.0", "grad_accum='2'", "threads=True", "world_size=2.0",
        "save_after_step=1.5", "save_after_step>steps", "save_after_step=0"])
def test_settings_that_used_to_fail_inside_the_ranks_or_save_nothing(monkeypatch, config, world_size, pattern):
    _refused_before_any_process(monkeypatch, config, world_size, pattern)


@pytest.mark.timeout(120)
def test_numpy_integers_are_accepted_and_train_like_ints(plain):
    config = replace(CONFIG, steps=np.int64(CONFIG.steps), global_batch=np.int32(CONFIG.global_batch),
                     save_after_step=None, num_samples=np.int64(CONFIG.num_samples))
    ddp.validate(config, np.int64(2))
    assert [type(getattr(config, name)) for name in ("steps", "global_batch", "num_samples")] == [int, int, int]
    results = ddp.run(replace(config, steps=np.int64(CONFIG.steps)), 2, output="none")  # run() converts them too
    for result, reference in zip(results, plain, strict=True):
        assert torch.equal(result.params, reference.params) and result.losses == reference.losses


@pytest.mark.parametrize("global_batch, world_size, grad_accum, suggestion", [(30, 4, 1, 28), (36, 2, 4, 32),
                                                                              (3, 4, 1, 4)])
def test_indivisible_global_batch_is_refused_with_a_value_that_works(monkeypatch, global_batch, world_size,
                                                                     grad_accum, suggestion):
    config = ddp.TrainConfig(global_batch=global_batch, grad_accum=grad_accum)
    message = _refused_before_any_process(monkeypatch, config, world_size, rf"global_batch={global_batch} must "
                                          rf"divide evenly into world_size={world_size}")
    assert re.search(rf"try global_batch={suggestion}$", message)
    ddp.validate(replace(config, global_batch=suggestion), world_size)  # the suggestion is accepted


@pytest.mark.parametrize("global_batch", [0, -4])
def test_non_positive_global_batch_is_refused_before_any_process_starts(monkeypatch, global_batch):
    _refused_before_any_process(monkeypatch, ddp.TrainConfig(global_batch=global_batch), 2, "global_batch")


def test_a_model_without_trainable_parameters_is_refused():
    frozen = models.build("mlp")
    for param in frozen.parameters():
        param.requires_grad_(False)
    pattern = "no trainable parameters"
    with pytest.raises(ValueError, match=pattern):
        _trainable(frozen)
    with pytest.raises(ValueError, match=pattern):  # before the constructor's broadcast: no process group needed
        NaiveDDP(frozen)
    with pytest.raises(ValueError, match=pattern):
        BucketedDDP(frozen)
    frozen.net[0].weight.requires_grad_(True)
    assert [p is frozen.net[0].weight for p in _trainable(frozen)] == [True]


@pytest.mark.timeout(120)
def test_command_line_prints_the_losses(plain):
    completed = subprocess.run([sys.executable, "-m", "dtlib.train", "ddp", "--world-size", "2", "--steps", "3"],
                               capture_output=True, text=True, timeout=100)
    assert completed.returncode == 0, completed.stderr
    match = re.search(r"DDP on 2 rank\(s\), gloo: losses ((?:[-\d.]+ ?){3})$", completed.stdout, re.MULTILINE)
    assert match, completed.stdout
    printed = [float(v) for v in match.group(1).split()]
    np.testing.assert_allclose(printed, plain[0].losses[:3], atol=1e-4)  # rank 0's first steps, to 4 decimals
    params = _num_params("mlp")
    assert f"all-reduce calls per step: 1, bytes per step: {4 * params}" in completed.stdout


# --- checkpoints: a failed save leaves the previous one whole ------------------------------------------------


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = models.build("mlp", seed=0)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def test_a_save_that_fails_half_way_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ddp.pt"
    model, optimizer = _model_and_optimizer()
    ddp._save(model, optimizer, 3, str(path), rank=0)  # no process group: no barrier
    before = path.read_bytes()
    real_save = torch.save

    def disk_full_half_way(obj, file, *args, **kwargs):
        whole = io.BytesIO()
        real_save(obj, whole)
        file.write(whole.getvalue()[:len(whole.getvalue()) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full_half_way)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    named = re.escape(str(path))
    with pytest.raises(OSError, match=rf"^could not write {named}: OSError: \[Errno 28\] No space left on device; "
                                      rf"the previous {named} is unchanged$"):
        ddp._save(model, optimizer, 4, str(path), rank=0)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["ddp.pt", "ddp.pt.sha256"]  # the partial file is gone
    assert torch.load(path, weights_only=True)["step"] == 3


_FILL_THE_DISK = """
import os, resource, signal, sys
import torch
from dtlib.train import ddp, models
path = sys.argv[1]
model = models.build("wide_mlp", seed=0)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
ddp._save(model, optimizer, 1, path, rank=0)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path) // 2, resource.RLIM_INFINITY))
try:
    ddp._save(model, optimizer, 2, path, rank=0)
except OSError as error:
    print(error)
"""


@pytest.mark.timeout(120)
def test_a_save_that_runs_out_of_room_keeps_the_previous_checkpoint(tmp_path):
    """A real failing write: the file-size limit (RLIMIT_FSIZE) stops torch.save half way, as a full disk does."""
    path = tmp_path / "ddp.pt"
    completed = subprocess.run([sys.executable, "-c", _FILL_THE_DISK, str(path)], capture_output=True, text=True,
                               timeout=100)
    assert completed.returncode == 0, completed.stderr
    assert f"could not write {path}" in completed.stdout and f"the previous {path} is unchanged" in completed.stdout
    assert sorted(os.listdir(tmp_path)) == ["ddp.pt", "ddp.pt.sha256"]
    from dtlib.train.checkpoint import load_file

    assert load_file(str(path), "cpu")["step"] == 1  # the previous file and its digest still agree
    saved = torch.load(path, weights_only=True)
    assert saved["step"] == 1
    reference = models.build("wide_mlp", seed=0).state_dict()
    assert all(torch.equal(saved["model"][name], tensor) for name, tensor in reference.items())


# --- the command line: usage errors, and a timeout of its own -------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["ddp", "--bucket-cap-mb", "-5"], "ddp: bucket_cap_mb must be >= 0, got -5.0"),
    (["ddp", "--global-batch", "7"], "ddp: global_batch=7 must divide evenly"),
    (["fsdp", "--steps", "0"], "fsdp: steps and grad_accum must be >= 1"),
    (["fsdp", "--timeout", "0"], "argument --timeout: timeout must be a positive number of seconds"),
])
def test_bad_settings_are_usage_errors_before_any_rank_starts(monkeypatch, capsys, argv, message):
    from dtlib.train import cli

    monkeypatch.setattr(sys.modules["dtlib.launch.entry"], "spawn", lambda *a, **k: pytest.fail("ranks started"))
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, timeout", [([], 3600.0), (["--timeout", "7200"], 7200.0),
                                           (["--timeout", "none"], None)])
def test_the_command_line_gives_a_long_job_its_own_timeout(monkeypatch, capsys, argv, timeout):
    """spawn's default (120 s) would stop a healthy long job; the runners' command line has its own."""
    from dtlib.train import cli

    seen = {}

    def run(config, world_size, **spawn_options):
        seen.update(spawn_options)
        raise SystemExit(0)

    monkeypatch.setattr(ddp, "run", run)
    with pytest.raises(SystemExit):
        cli.main(["ddp", *argv])
    assert seen == {"timeout": timeout}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.timeout(180)
def test_cuda_all_reduces_are_timed_by_cuda_events():
    """NCCL at world size 1: CommLog reads each bucket's start and finish from CUDA events, so the timeline has
    finishes and the hidden share is a number, not NaN."""
    (result,) = ddp.run(ddp.TrainConfig(model="transformer", steps=3, global_batch=16), 1, output="none")
    assert result.backend == "nccl"
    line = result.timeline
    assert line["comm"] and all(not math.isnan(done) for _, done, _ in line["comm"])
    assert all(line["start_s"] <= launched <= done <= line["end_s"] for launched, done, _ in line["comm"])
    assert all(0.0 <= share <= 1.0 for share in result.hidden_share)


def test_cpu_all_reduces_keep_the_cpu_clock(plain):
    """gloo: each finish is stamped on the CPU clock as the collective ends; nothing waits for CUDA events."""
    for result in plain:
        assert all(launched <= done for launched, done, _ in result.timeline["comm"])
        assert all(not math.isnan(share) for share in result.hidden_share)


@pytest.mark.timeout(120)
def test_a_straggler_makes_every_other_rank_wait_in_each_all_reduce():
    """straggler_ms=60 on the last rank: it launches each all-reduce only after its delay, and rank 0's copy of
    every all-reduce finishes no earlier than the straggler launched it (on one clock: each rank's origin_s plus
    its times, perf_counter being the machine's monotonic clock). Orderings only, no speeds. Step 2 is read:
    DDP's second forward broadcasts its rebuilt bucket order, one more point where rank 0 waits."""
    results = ddp.run(ddp.TrainConfig(model="wide_mlp", steps=3, global_batch=64, straggler_ms=60), 2, output="none")
    fast, slow = ([(launched + r.timeline["origin_s"], done + r.timeline["origin_s"]) for launched, done, _ in
                   r.timeline["comm"]] for r in results)  # each rank's times from its own zero: on one clock now
    assert len(fast) == len(slow) >= 1
    straggler = results[1].timeline
    assert straggler["comm"][0][0] >= straggler["start_s"] + 0.06  # its own sleep came first, in its own step
    for (_, done), (late, _) in zip(fast, slow, strict=True):
        assert done >= late  # rank 0's all-reduce ended only once the straggler had launched it


# -- buckets, unused parameters, buffers and resuming, as the runner records them ----------------------------


def bucket_layout(cap: float | None, steps: int = 3, **flags) -> dict:
    """Rank 0's all-reduces and bucket sizes per step on wide_mlp, as the runner records them."""
    first = ddp.run(ddp.TrainConfig(model="wide_mlp", steps=steps, bucket_cap_mb=cap, **flags), 2, output="none")[0]
    return {"calls": first.comm_calls, "bucket_bytes": first.comm_sizes, "bytes_per_step": first.comm_bytes[-1]}


@pytest.fixture(scope="module")
def layout():
    return [bucket_layout(None), bucket_layout(0.001)]  # DDP's default cap (25 MB), then ~1 KB: one per gradient


@pytest.mark.timeout(180)
def test_bucket_layout(layout):
    total = 4 * _num_params("wide_mlp")
    for row in layout:
        assert row["calls"][0] == 1 and row["bucket_bytes"][0] == [total]  # step 0: every gradient in one bucket
        assert row["calls"][1:] == [len(sizes) for sizes in row["bucket_bytes"][1:]]
        assert row["bucket_bytes"][1] == row["bucket_bytes"][2]  # rebuilt once, after step 0
        assert all(sum(sizes) == total for sizes in row["bucket_bytes"])  # nothing sent twice or skipped
        assert row["bytes_per_step"] == total
    default, tiny = layout
    assert default["calls"][1] == 2  # the 1 MiB first bucket, then the rest under 25 MB
    first = default["bucket_bytes"][1][0]  # closes once it reaches 1 MiB; a gradient is never split
    assert 2**20 <= first < 2**20 + 4 * 512 * 512
    assert tiny["calls"][1] > default["calls"][1]
    assert tiny["calls"][1] == 9  # 10 tensors; the last layer's 4-byte bias shares a bucket with its weight


@pytest.mark.timeout(180)
def test_bucket_cap_is_a_threshold_and_a_gradient_is_never_split():
    # wide_mlp, last layer first: 4 B + 2 KiB (output layer), then per hidden layer a 2 KiB bias and a 1 MiB weight
    row = bucket_layout(0.5, steps=2)
    hidden_weight, bias = 4 * 512 * 512, 4 * 512
    assert row["bucket_bytes"][1] == [4 + 4 * 512 + bias + hidden_weight, bias + hidden_weight, bias + hidden_weight,
                                      bias + 4 * 16 * 512]


@pytest.mark.timeout(240)
def test_find_unused_parameters_and_static_graph_change_the_bucket_schedule():
    total = 4 * _num_params("wide_mlp")
    unused = bucket_layout(None, find_unused_parameters=True)
    assert unused["calls"][0] > 1  # several buckets from step 0: assigned at construction
    assert unused["bucket_bytes"][0] == unused["bucket_bytes"][1] == unused["bucket_bytes"][2]  # never rebuilt
    assert all(sum(sizes) == total for sizes in unused["bucket_bytes"])
    static = bucket_layout(None, static_graph=True)
    assert static["calls"] == [1, 1, 2]  # one bucket for steps 0 and 1, rebuilt after
    assert static["bucket_bytes"][0] == static["bucket_bytes"][1] == [total]


@pytest.mark.timeout(180)
def test_unused_parameters_need_the_flag():
    with pytest.raises(dtlib.WorkerError, match="find_unused_parameters"):
        ddp.run(ddp.TrainConfig(model="branchy", steps=2), 2, output="none")


@pytest.mark.timeout(180)
def test_buffer_sync_keeps_batchnorm_statistics_closer():
    spread = {}
    for flag in (True, False):
        results = ddp.run(ddp.TrainConfig(model="batchnorm", steps=3, sync_buffers=flag), 2, output="none")
        spread[flag] = max((r.buffers - results[0].buffers).abs().max().item() for r in results)
    assert 0 < spread[True] < spread[False]


@pytest.mark.timeout(240)
def test_resumed_training_equals_uninterrupted_training(stop_and_resume):
    # 16 steps per epoch (512 samples, 2 ranks, 16 per rank): stopping after 17 resumes inside epoch 1
    losses = stop_and_resume(ddp.run, ddp.TrainConfig(model="mlp"), 2, steps=20, stop_after=17,
                             location="checkpoint_path")
    assert len(losses["straight"]) == 20 and all(math.isfinite(v) for v in losses["straight"])
    assert losses["stopped_and_resumed"] == losses["straight"]


@pytest.mark.parametrize("stop_after, steps", [(0, 10), (10, 10), (12, 10), (-1, 10)])
def test_bad_stop_after_is_refused(stop_after, steps, stop_and_resume):
    with pytest.raises(ValueError, match=f"need 0 < stop_after < steps, got {stop_after} and {steps}"):
        stop_and_resume(ddp.run, ddp.TrainConfig(model="mlp"), 2, steps=steps, stop_after=stop_after,
                        location="checkpoint_path")
