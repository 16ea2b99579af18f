"""What notebook 04 measures about DDP's options: bucket layouts, gradient copies, graph searches, buffer drift.

Every function starts ranks through :func:`dtlib.train.ddp.run` (or ``dtlib.spawn``) and returns
plain numbers; ``dtlib.plots`` draws them. The options themselves are passed to the learner's own
``train_ddp`` in the notebook; these count what the documentation does not say. Example::

    dtlib.train.ddp_options.bucket_layout([1, 25])    # all-reduce calls per step for two bucket caps
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dtlib.launch.entry import device_ids, rank_device
from dtlib.launch.spawn import spawn
from dtlib.train import data, models
from dtlib.train.ddp import TrainConfig, run


def bucket_layout(bucket_caps_mb: Sequence[float | None] = (None, 0.5, 2, 25), model: str = "wide_mlp",
                  world_size: int = 2, *, steps: int = 3, find_unused_parameters: bool = False,
                  static_graph: bool = False) -> list[dict[str, Any]]:
    """For each ``bucket_cap_mb`` (None: DDP's default, 25): the all-reduce calls and the bucket
    sizes (bytes) of every step.

    In torch 2.13, DDP puts every gradient in one bucket for the first step, then rebuilds
    the buckets in the order gradients arrived; with the default cap, the first rebuilt
    bucket is capped at 1 MiB (``dist._DEFAULT_FIRST_BUCKET_BYTES``) so that communication
    starts early. With ``find_unused_parameters=True`` (and no ``static_graph``) it assigns
    the buckets at construction, in the order of ``model.parameters()``, and never rebuilds
    them; with ``static_graph=True`` it keeps one bucket for steps 0 and 1 and rebuilds after.
    A bucket closes once it holds at least the cap, and a gradient is never split.
    Example: ``bucket_layout([25])[0]["calls"]``.
    """
    rows = []
    for cap in bucket_caps_mb:
        config = TrainConfig(model=model, steps=steps, bucket_cap_mb=cap, find_unused_parameters=find_unused_parameters,
                             static_graph=static_graph)
        first = run(config, world_size, output="none")[0]
        rows.append({"bucket_cap_mb": cap, "find_unused_parameters": find_unused_parameters,
                     "static_graph": static_graph, "calls": first.comm_calls, "bucket_bytes": first.comm_sizes,
                     "bytes_per_step": first.comm_bytes[-1]})
    return rows


#: The profiler event of DDP's search for parameters that will get no gradient (torch 2.13's name).
SEARCH_EVENT = "torch.distributed.ddp.reducer::search_unused_parameters"


def _search_per_step(rank: int, world_size: int, model: str, steps: int) -> dict[str, dict[str, Any]]:
    device = rank_device()
    out = {}
    for option in ("find_unused_parameters", "static_graph"):
        base = models.build(model, seed=0).to(device)
        net = DistributedDataParallel(base, device_ids=device_ids(device),
                                      **{option: True})
        optimizer = torch.optim.SGD(base.parameters(), lr=0.05, momentum=0.9)
        batches = data.batches(data.for_model(model, 512), world_size, rank, 16)
        searches, losses = [], []
        for _ in range(steps):
            x, y = next(batches)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
                loss = models.loss_fn(model, net(x.to(device)), y.to(device))
                loss.backward()
            searches.append(sum(event.name == SEARCH_EVENT for event in profiler.events()))
            losses.append(loss.item())
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)  # keep .grad: None then means "never got a gradient"
        unused = sum(p.numel() * p.element_size() for p in base.parameters() if p.grad is None)
        out[f"{option}=True"] = {"searches": searches, "unused_bytes": unused, "losses": losses}
    return out


def unused_parameter_search(world_size: int = 2, steps: int = 4, model: str = "branchy") -> dict[str, dict[str, Any]]:
    """What ``find_unused_parameters=True`` and ``static_graph=True`` each do, counted, on a model
    whose second head is never used (rank 0's numbers): ``searches``, how many times per step DDP
    searched the autograd graph for parameters that will get no gradient (the profiler's
    ``SEARCH_EVENT``); ``unused_bytes``, the bytes of parameters that never got a gradient; ``losses``.

    With ``find_unused_parameters`` the search runs after every forward; with ``static_graph`` DDP
    learns the unused parameters during the first step and never searches.
    Example: ``unused_parameter_search()["find_unused_parameters=True"]["searches"]``.
    """
    return spawn(_search_per_step, world_size, args=(model, steps), output="none")[0]


def _gradient_storage(rank: int, world_size: int, settings: list[tuple[bool, bool]], model: str,
                      steps: int) -> dict[str, dict[str, Any]]:
    device = rank_device()
    out = {}
    for as_view, set_to_none in settings:
        base = models.build(model, seed=0).to(device)
        net = DistributedDataParallel(base, device_ids=device_ids(device),
                                      gradient_as_bucket_view=as_view)
        optimizer = torch.optim.SGD(base.parameters(), lr=0.05)
        arrived_apart: list[bool] = []  # per gradient, when autograd has just written it: its own tensor?
        for param in base.parameters():
            param.register_post_accumulate_grad_hook(lambda p, log=arrived_apart: log.append(not p.grad._is_view()))
        batches = data.batches(data.for_model(model, 512), world_size, rank, 16)
        copied, losses = [], []
        for _ in range(steps):
            arrived_apart.clear()
            x, y = next(batches)
            loss = models.loss_fn(model, net(x.to(device)), y.to(device))
            loss.backward()  # DDP copies every gradient that arrived apart into its bucket
            copied.append(sum(arrived_apart))
            apart = sum(p.grad.numel() * p.grad.element_size() for p in base.parameters() if not p.grad._is_view())
            losses.append(loss.item())
            optimizer.step()
            optimizer.zero_grad(set_to_none=set_to_none)
        out[f"gradient_as_bucket_view={as_view}, set_to_none={set_to_none}"] = {
            "copied_per_step": copied, "grad_bytes_apart": apart, "losses": losses}
    return out


def gradient_views(world_size: int = 2, model: str = "wide_mlp", steps: int = 3) -> dict[str, dict[str, Any]]:
    """``gradient_as_bucket_view`` off and on, and on with ``zero_grad(set_to_none=True)``; rank 0's counts.

    For each setting: ``copied_per_step``, the gradients that autograd wrote into a tensor of their
    own (DDP then copies each into its bucket), per step; ``grad_bytes_apart``, the bytes of ``.grad``
    not inside a bucket after the last backward; and the losses. With the flag, ``.grad`` is a view
    into the bucket from step 1 on, so nothing is copied; ``set_to_none=True`` makes autograd write a
    new tensor every step, which DDP copies into the bucket and then replaces by the bucket's view.
    Example: ``gradient_views()["gradient_as_bucket_view=True, set_to_none=False"]["copied_per_step"]``.
    """
    settings = [(False, True), (True, False), (True, True)]
    return spawn(_gradient_storage, world_size, args=(settings, model, steps), output="none")[0]


def buffer_sync(world_size: int = 2, steps: int = 6) -> dict[str, float]:
    """BatchNorm's running mean: the largest difference between ranks after training, with DDP's
    buffer sync on and off (each rank sees different samples, so their statistics drift apart)."""
    out = {}
    for flag in (True, False):
        results = run(TrainConfig(model="batchnorm", steps=steps, sync_buffers=flag), world_size, output="none")
        out[f"sync_buffers={flag}"] = max((r.buffers - results[0].buffers).abs().max().item() for r in results)
    return out


def sampler_coverage(dataset_len: int, world_size: int, *, drop_last: bool = False) -> dict[str, Any]:
    """What one epoch of ``DistributedSampler`` gives: indices per rank, repeats (padding), dropped ones."""
    per_rank = data.sampler_indices(dataset_len, world_size, drop_last=drop_last)[0]
    seen = [i for indices in per_rank for i in indices]
    return {"per_rank": per_rank, "samples_per_rank": len(per_rank[0]),
            "repeated": sorted({i for i in seen if seen.count(i) > 1}),
            "dropped": sorted(set(range(dataset_len)) - set(seen))}


def _data_parallel_steps(rank: int, world_size: int, steps: int, model: str, global_batch: int) -> dict[str, Any]:
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


def data_parallel(steps: int = 5, model: str = "wide_mlp", global_batch: int = 512) -> dict[str, Any]:
    """``nn.DataParallel`` (one process, one thread per GPU) for a few steps, where there are 2+ GPUs.

    Returns the GPU count and, with 2 or more, the median step time in ms; otherwise a note.
    DataParallel has no CPU mode: it exists to drive several GPUs from one process. That process is a
    child (``dtlib.spawn`` with one rank and no process group), so the caller, a notebook's kernel, never
    initialises CUDA, and ``fork`` stays safe there. Example: ``data_parallel()["gpus"]``.
    """
    # GPU run must confirm: with 2+ GPUs the child drives them all (dtlib.spawn sets no CUDA_VISIBLE_DEVICES).
    return spawn(_data_parallel_steps, 1, args=(steps, model, global_batch), init_process_group=False,
                 output="none")[0]
