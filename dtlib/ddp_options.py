"""Each DDP option, with its effect measured: the experiments notebook 04 runs.

Every function starts ranks through :func:`dtlib.ddp.run` (or ``dtlib.spawn``) and returns
plain numbers; ``dtlib.plots`` draws them. Example::

    dtlib.ddp_options.bucket_layout([1, 25])    # all-reduce calls per step for two bucket caps
"""

from __future__ import annotations

import os
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtlib import data, models
from dtlib.ddp import TrainConfig, run
from dtlib.errors import WorkerError
from dtlib.launch import spawn

QUIET: dict[str, Any] = {"output": "none"}


def _median_step(results: Sequence[Any]) -> float:
    """The slowest rank's median step time, skipping step 0 (DDP builds its buckets then)."""
    return max(statistics.median(r.step_times_s[1:] or r.step_times_s) for r in results)


def bucket_layout(bucket_caps_mb: Sequence[float | None] = (None, 0.5, 2, 25), model: str = "wide_mlp",
                  world_size: int = 2) -> list[dict[str, Any]]:
    """For each ``bucket_cap_mb`` (None: DDP's default, 25): the all-reduce calls and the bucket
    sizes (bytes) in step 0 and step 1.

    In torch 2.13, DDP puts every gradient in one bucket for the first step (unless
    ``find_unused_parameters``), then rebuilds the buckets in the order gradients
    arrived; with the default cap, the first rebuilt bucket is capped at 1 MiB
    (``dist._DEFAULT_FIRST_BUCKET_BYTES``) so that communication starts early.
    A parameter is never split: a bucket holds at least one whole gradient.
    Example: ``bucket_layout([25])[0]["calls"]``.
    """
    rows = []
    for cap in bucket_caps_mb:
        first = run(TrainConfig(model=model, steps=2, bucket_cap_mb=cap), world_size, **QUIET)[0]
        rows.append({"bucket_cap_mb": cap, "calls": first.comm_calls, "bucket_bytes": first.comm_sizes,
                     "bytes_per_step": first.comm_bytes[-1]})
    return rows


def unused_branch_error(world_size: int = 2, steps: int = 3) -> str:
    """The error DDP raises when a branch goes unused without ``find_unused_parameters`` ("" if none)."""
    try:
        run(TrainConfig(model="branchy", steps=steps), world_size, **QUIET)
    except WorkerError as err:
        return err.failures[0].message
    return ""


def unused_parameters(world_size: int = 2, steps: int = 6) -> dict[str, Any]:
    """A model with an unused branch, without and with ``find_unused_parameters``, and the flag's cost.

    Returns the error DDP raises without the flag, the losses with it, and the median step
    times of a model that uses every parameter, trained with the flag needlessly on and off.
    """
    error = unused_branch_error(world_size, steps)
    fixed = run(TrainConfig(model="branchy", steps=steps, find_unused_parameters=True), world_size, **QUIET)
    base = TrainConfig(model="wide_mlp", steps=steps, global_batch=64)
    times = {flag: _median_step(run(replace(base, find_unused_parameters=flag), world_size, **QUIET))
             for flag in (False, True)}
    return {"error": error, "losses_with_flag": fixed[0].losses,
            "step_s_without_flag": times[False], "step_s_with_needless_flag": times[True]}


def gradient_views(world_size: int = 2, model: str = "wide_mlp") -> dict[str, dict[str, Any]]:
    """``gradient_as_bucket_view`` off and on: gradient bytes held apart from the buckets, and losses."""
    out = {}
    for flag in (False, True):
        first = run(TrainConfig(model=model, steps=3, gradient_as_bucket_view=flag), world_size, **QUIET)[0]
        out[str(flag)] = {"grad_bytes_separate": first.grad_bytes_separate, "bucket_bytes": sum(first.bucket_bytes),
                          "losses": first.losses}
    return out


def static_graph(world_size: int = 2, steps: int = 8) -> dict[str, Any]:
    """``static_graph=True`` against the default on the same model: equal losses, step times."""
    base = TrainConfig(model="transformer", steps=steps)
    runs = {flag: run(replace(base, static_graph=flag), world_size, **QUIET) for flag in (False, True)}
    return {"losses_equal": runs[False][0].losses == runs[True][0].losses,
            "max_loss_difference": max(abs(a - b) for a, b in zip(runs[False][0].losses, runs[True][0].losses,
                                                                  strict=True)),
            "step_s": {str(flag): _median_step(results) for flag, results in runs.items()}}


def comm_hooks(world_size: int = 2, steps: int = 12, model: str = "wide_mlp") -> list[dict[str, Any]]:
    """Plain all-reduce, fp16 and bf16 compression and PowerSGD (rank 1, from step 2): bytes sent per
    step (all-reduce payloads, bytes) and the loss curve of each.

    Every row uses one bucket (``bucket_cap_mb=1000``): PowerSGD on gloo needs it (see ``dtlib.ddp``),
    and the same layout keeps the rows comparable.
    """
    rows = []
    for hook in (None, "fp16", "bf16", "powersgd"):
        config = TrainConfig(model=model, steps=steps, comm_hook=hook, global_batch=64, bucket_cap_mb=1000)
        first = run(config, world_size, **QUIET)[0]
        rows.append({"hook": hook or "allreduce (default)", "bytes_per_step": first.comm_bytes[-1],
                     "calls_per_step": first.comm_calls[-1], "losses": first.losses})
    return rows


def buffer_sync(world_size: int = 2, steps: int = 6) -> dict[str, float]:
    """BatchNorm's running mean: the largest difference between ranks after training, with DDP's
    buffer sync on and off (each rank sees different samples, so their statistics drift apart)."""
    out = {}
    for flag in (True, False):
        results = run(TrainConfig(model="batchnorm", steps=steps, sync_buffers=flag), world_size, **QUIET)
        out[f"sync_buffers={flag}"] = max((r.buffers - results[0].buffers).abs().max().item() for r in results)
    return out


def _batchnorm_statistics(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(rank)
    x = torch.randn(8, 4) + rank  # (B, C): rank r's samples are shifted by r, so local means differ
    local_mean = x.mean(0)
    moments = torch.cat([x.sum(0), (x * x).sum(0), torch.tensor([float(x.shape[0])])])
    dist.all_reduce(moments)  # what SyncBatchNorm reduces: per-channel sum, sum of squares, count
    count = moments[-1]
    global_mean = moments[:4] / count
    global_var = moments[4:8] / count - global_mean**2
    everyone = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(everyone, x)
    whole = torch.cat(everyone)  # (world_size * B, C): the oracle, one BatchNorm over all samples
    sync_bn_mean = None
    if x.device.type == "cpu" and dist.get_backend() == "nccl":
        layer = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(4))).cuda()
        layer(x.cuda())
        sync_bn_mean = (layer[0].running_mean.cpu() / 0.1)  # momentum 0.1 from zero: mean = running / 0.1
    converted = type(nn.SyncBatchNorm.convert_sync_batchnorm(models.build("batchnorm")).net[1]).__name__
    return {"local_mean": local_mean, "global_mean": global_mean, "global_var": global_var,
            "whole_mean": whole.mean(0), "whole_var": whole.var(0, unbiased=False),
            "sync_bn_mean": sync_bn_mean, "converted_layer": converted}


def batchnorm_statistics(world_size: int = 2) -> list[dict[str, Any]]:
    """Per-rank BatchNorm batch means against the global ones that SyncBatchNorm computes.

    ``nn.SyncBatchNorm`` runs only on GPUs (its forward raises ValueError on CPU
    tensors), so on the CPU this computes what it computes (all-reduced sums) and
    checks it against one BatchNorm over every rank's samples; on NCCL the real
    layer runs too (``sync_bn_mean``).
    """
    return spawn(_batchnorm_statistics, world_size, **QUIET)


def resume_from_checkpoint(world_size: int = 2, steps: int = 10, stop_after: int = 4,
                           model: str = "mlp") -> dict[str, list[float]]:
    """Train ``steps`` straight through, and again stopping after ``stop_after`` steps: rank 0 saves,
    a new job loads the file on every rank (``map_location``, ``weights_only=True``) and goes on.

    Returns rank 0's losses both ways; the resumed ones must equal the uninterrupted ones.
    """
    if not 0 < stop_after < steps:
        raise ValueError(f"need 0 < stop_after < steps, got {stop_after} and {steps}")
    straight = run(TrainConfig(model=model, steps=steps), world_size, **QUIET)[0].losses
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "checkpoint.pt")
        first = run(TrainConfig(model=model, steps=stop_after, save_after_step=stop_after, checkpoint_path=path),
                    world_size, **QUIET)[0].losses
        second = run(TrainConfig(model=model, steps=steps, resume=True, checkpoint_path=path),
                     world_size, **QUIET)[0].losses
    return {"straight": straight, "stopped_and_resumed": first + second}


def sampler_coverage(dataset_len: int, world_size: int, *, drop_last: bool = False) -> dict[str, Any]:
    """What one epoch of ``DistributedSampler`` gives: indices per rank, repeats (padding), dropped ones."""
    per_rank = data.sampler_indices(dataset_len, world_size, drop_last=drop_last)[0]
    seen = [i for indices in per_rank for i in indices]
    return {"per_rank": per_rank, "samples_per_rank": len(per_rank[0]),
            "repeated": sorted({i for i in seen if seen.count(i) > 1}),
            "dropped": sorted(set(range(dataset_len)) - set(seen))}


def data_parallel(steps: int = 5, model: str = "wide_mlp", global_batch: int = 512) -> dict[str, Any]:
    """``nn.DataParallel`` (one process, one thread per GPU) for a few steps, where there are 2+ GPUs.

    Returns the GPU count and, with 2 or more, the median step time in ms; otherwise a note.
    DataParallel has no CPU mode: it exists to drive several GPUs from one process.
    """
    import time

    gpus = torch.cuda.device_count()
    if gpus < 2:
        return {"gpus": gpus, "note": f"DataParallel needs 2 or more GPUs; this machine has {gpus}: not run"}
    net = nn.DataParallel(models.build(model).cuda())
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    x, y = (t.cuda() for t in data.for_model(model, global_batch).tensors)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        models.loss_fn(model, net(x), y).backward()  # scatter x, replicate weights, gather outputs on GPU 0
        optimizer.step()
        optimizer.zero_grad()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"gpus": gpus, "step_ms": statistics.median(times[1:]) * 1e3}
