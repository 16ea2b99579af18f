"""The DDP runner: train a toy model on N ranks and return what every rank saw.

One function, :func:`train`, runs inside each rank (under ``dtlib.spawn`` or torchrun);
:func:`run` starts it from a notebook; :func:`train_single` is the one-process
reference with the whole global batch. Settings live in :class:`TrainConfig`::

    results = dtlib.train.ddp.run(dtlib.train.ddp.TrainConfig(model="mlp", steps=8), world_size=2)
    results[0].losses             # rank 0's loss per step
    results[0].comm_calls         # all-reduce calls per step

From a shell, or under torchrun: ``torchrun --standalone --nproc_per_node=2 -m dtlib.train ddp --steps 8``.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from dtlib import compat
from dtlib.arguments import finite
from dtlib.launch import entry
from dtlib.launch.device import device_ids, rank_device
from dtlib.measure.commlog import CommLog, hidden_share
from dtlib.train import data, models
from dtlib.train.checkpoint import load_file, save_file
from dtlib.train.common import validate_checkpointing, validate_counts
from dtlib.train.config import TrainConfig
from dtlib.train.ddp_scratch import BucketedDDP, NaiveDDP

WRAPPERS = ("ddp", "naive", "bucketed", "none")
COUNTS = ("steps", "global_batch", "grad_accum", "num_samples", "seed", "threads", "save_after_step")  # ints


@dataclass
class RankResult:
    """What one rank measured. Times in seconds, sizes in bytes; lists have one entry per step."""

    rank: int
    world_size: int
    backend: str
    first_step: int
    losses: list[float] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)  # training only: the runner's bookkeeping left out
    comm_calls: list[int] = field(default_factory=list)
    comm_bytes: list[int] = field(default_factory=list)
    comm_sizes: list[list[int]] = field(default_factory=list)  # bytes of each all-reduce, per step
    hidden_share: list[float] = field(default_factory=list)  # of the time with an all-reduce in flight
    timeline: dict[str, Any] = field(default_factory=dict)  # the last step: compute span, each all-reduce
    params: torch.Tensor | None = None  # all parameters, flattened, after the last step
    grads: torch.Tensor | None = None  # all gradients, flattened, of the last step
    buffers: torch.Tensor | None = None  # all buffers (BatchNorm statistics), flattened


def validate(config: TrainConfig, world_size: int) -> None:
    """Refuse settings that cannot work, saying what to change.

    Counts must be whole numbers: ``steps=2.5`` or ``global_batch=32.0`` are refused. Other integral
    types (numpy's) are accepted and stored back into ``config`` as ``int``, which torch's samplers need.
    """
    if config.model not in models.MODELS:
        raise ValueError(f"unknown model {config.model!r}; choose one of {', '.join(models.MODELS)}")
    if config.wrapper not in WRAPPERS:
        raise ValueError(f"wrapper must be one of {WRAPPERS}, got {config.wrapper!r}")
    validate_counts(config, world_size, COUNTS)  # 2.5 or 32.0 would fail later inside every rank
    if world_size < 1 or config.steps < 1 or config.grad_accum < 1 or config.global_batch < 1:
        raise ValueError(f"world_size, steps, grad_accum and global_batch must all be >= 1, got {world_size}, "
                         f"{config.steps}, {config.grad_accum} and {config.global_batch}")
    if world_size > config.num_samples:
        raise ValueError(f"world_size={world_size} is larger than the data set ({config.num_samples} samples): "
                         "some ranks would get no data; use fewer ranks or a larger num_samples")
    unit = world_size * config.grad_accum
    if config.global_batch % unit:
        raise ValueError(f"global_batch={config.global_batch} must divide evenly into world_size={world_size} "
                         f"ranks x grad_accum={config.grad_accum} micro-batches; try global_batch="
                         f"{max(1, config.global_batch // unit) * unit}")
    if config.global_batch > config.num_samples:
        raise ValueError(f"global_batch={config.global_batch} exceeds the {config.num_samples} samples")
    if config.bucket_cap_mb is not None:
        config.bucket_cap_mb = finite("bucket_cap_mb", config.bucket_cap_mb)
    config.straggler_ms = finite("straggler_ms", config.straggler_ms)  # a delay: 0 or more
    validate_checkpointing(config, "checkpoint_path")


def _wrap(model: nn.Module, config: TrainConfig, device: torch.device) -> nn.Module:
    if config.wrapper == "none":
        return model
    if config.wrapper == "naive":
        return NaiveDDP(model)
    if config.wrapper == "bucketed":
        return BucketedDDP(model, config.bucket_cap_mb or 25.0)
    options: dict[str, Any] = {"find_unused_parameters": config.find_unused_parameters,
                               "gradient_as_bucket_view": config.gradient_as_bucket_view,
                               "static_graph": config.static_graph, **compat.ddp_buffer_sync(config.sync_buffers)}
    if config.bucket_cap_mb is not None:
        options["bucket_cap_mb"] = config.bucket_cap_mb
    ddp = DistributedDataParallel(model, device_ids=device_ids(device), **options)
    # torch's allreduce_hook is what DDP does in C++, written in Python: every all-reduce then goes through
    # Python, where CommLog times it. (Compression hooks are notebook 04's, in a cell.)
    ddp.register_comm_hook(None, allreduce_hook)
    return ddp


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors]) if tensors else torch.zeros(0)


def train(rank: int, world_size: int, config: TrainConfig) -> RankResult:
    """Train on this rank (the process group exists unless world_size is 1 with ``wrapper="none"``)."""
    validate(config, world_size)
    torch.set_num_threads(config.threads)
    device = rank_device()
    base = models.build(config.model, seed=config.seed).to(device)
    log = CommLog()
    model = _wrap(base, config, device)
    optimizer = torch.optim.SGD(base.parameters(), lr=config.lr, momentum=config.momentum)
    start = 0
    if config.resume:  # every rank reads the file; map_location puts tensors on this rank's device
        checkpoint = load_file(config.checkpoint_path, device)
        base.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        start = checkpoint["step"]
    micro_batch = config.global_batch // world_size // config.grad_accum
    batches = data.batches(data.for_model(config.model, config.num_samples, seed=config.seed), world_size, rank,
                           micro_batch * config.grad_accum, seed=config.seed, first_step=start,
                           set_epoch=config.set_epoch)
    result = RankResult(rank, world_size, dist.get_backend() if dist.is_initialized() else "none", start)
    steps = range(start, config.steps)
    with log.recording():
        for step in steps:
            log.step = step
            x, y = next(batches)
            step_start = log.now()
            if config.straggler_ms and rank == world_size - 1:  # a slower GPU, a busier host, a larger batch
                time.sleep(config.straggler_ms / 1e3)
            loss_value = 0.0
            for micro, (xs, ys) in enumerate(zip(x.split(micro_batch), y.split(micro_batch), strict=True)):
                last = micro == config.grad_accum - 1
                skip_sync = not last and config.no_sync and config.wrapper != "none"
                context = model.no_sync() if skip_sync else contextlib.nullcontext()
                with context:
                    loss = models.loss_fn(config.model, model(xs.to(device)), ys.to(device)) / config.grad_accum
                    loss.backward()
                loss_value += loss.item()
            if hasattr(model, "finish_gradient_sync"):
                model.finish_gradient_sync()
            optimizer.step()
            kept_s = 0.0  # the runner's own bookkeeping inside the step, left out of its time
            if step == config.steps - 1:
                kept_s = log.now()
                result.grads = _flat([p.grad for p in base.parameters() if p.grad is not None])
                kept_s = log.now() - kept_s
            optimizer.zero_grad(set_to_none=not config.gradient_as_bucket_view)
            if device.type == "cuda":
                torch.cuda.synchronize()
            _record_step(result, log, step, step_start, log.now() - step_start - kept_s, loss_value)
            if config.save_after_step == step + 1:
                _save(base, optimizer, step + 1, config.checkpoint_path, rank)
    result.params = _flat(list(base.parameters()))
    result.buffers = _flat(list(base.buffers()))
    return result


def _record_step(result: RankResult, log: CommLog, step: int, step_start: float, step_s: float,
                 loss_value: float) -> None:
    """Keep one step's numbers; ``step_s`` is its time, measured before this bookkeeping began."""
    log.resolve()  # every finish known: CPU stamps waited for, CUDA collectives read from their events
    events = log.in_step(step)
    compute_end = max((e.launched_s for e in events), default=log.now())
    result.losses.append(loss_value)
    result.step_times_s.append(step_s)
    result.comm_calls.append(len(events))
    result.comm_bytes.append(sum(e.nbytes for e in events))
    result.comm_sizes.append([e.nbytes for e in events])
    result.hidden_share.append(hidden_share(events, compute_end))
    result.timeline = {"step": step, "start_s": step_start, "compute_end_s": compute_end,
                       "end_s": log.now(), "comm": [(e.launched_s, e.done_s, e.nbytes) for e in events],
                       "origin_s": log.origin}  # perf_counter at this rank's zero: add it to compare ranks


def _save(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, path: str, rank: int) -> None:
    """Rank 0 writes, everyone waits: no rank reads a half-written file, and only one copy is written.

    :func:`dtlib.train.checkpoint.save_file` writes it whole or not at all (a save that fails, a full disk,
    raises ``OSError`` and leaves the previous checkpoint whole) and records its SHA-256, which
    :func:`dtlib.train.checkpoint.load_file` checks: a changed or truncated file is refused by name."""
    if rank == 0:
        save_file(path, {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step})
    if dist.is_initialized():
        dist.barrier()


def run(config: TrainConfig, world_size: int = 2, **spawn_options: Any) -> list[RankResult]:
    """Train on ``world_size`` ranks through ``dtlib.run``; the results indexed by rank.

    Bad settings are refused here, before any process starts.
    Example: ``run(TrainConfig(steps=4), world_size=2)[0].losses``.
    """
    validate(config, world_size)

    return entry.run(train, world_size, args=(config,), **spawn_options)


def train_single(config: TrainConfig, world_size: int = 1) -> RankResult:
    """The reference: one process, no process group, the whole global batch per step.

    ``world_size`` only checks that the config would also be valid on that many ranks.
    Example: ``train_single(TrainConfig(steps=4)).losses``.
    """
    validate(config, world_size)
    return train(0, 1, replace(config, wrapper="none", grad_accum=1, save_after_step=None, resume=False))
