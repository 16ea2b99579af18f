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
from torch.nn.parallel import DistributedDataParallel

from dtlib import compat
from dtlib.arguments import finite
from dtlib.launch.entry import device_ids, rank_device
from dtlib.launch.entry import run as run_everywhere
from dtlib.launch.files import write_atomically, write_digest
from dtlib.measure.commlog import CommLog, hidden_share
from dtlib.train import data, models
from dtlib.train.common import load_file, validate_checkpointing, validate_counts
from dtlib.train.ddp_scratch import BucketedDDP, NaiveDDP

WRAPPERS = ("ddp", "naive", "bucketed", "none")
COUNTS = ("steps", "global_batch", "grad_accum", "num_samples", "seed", "threads", "save_after_step")  # ints
COMM_HOOKS = (None, "fp16", "bf16", "powersgd")


@dataclass
class TrainConfig:
    """Everything one training run needs; the same object goes to every rank."""

    model: str = "mlp"  # a name from dtlib.train.models.MODELS
    steps: int = 8
    global_batch: int = 32  # summed over ranks: each rank takes global_batch / world_size
    grad_accum: int = 1  # micro-batches per step
    no_sync: bool = True  # accumulate under no_sync(): one all-reduce per step instead of one per micro-batch
    lr: float = 0.05
    momentum: float = 0.9
    num_samples: int = 512
    seed: int = 0
    wrapper: str = "ddp"  # "ddp" (torch), "naive" or "bucketed" (dtlib.train.ddp_scratch), "none"
    bucket_cap_mb: float | None = None  # None: DDP's default, 25
    comm_hook: str | None = None  # None (plain all-reduce), "fp16", "bf16", "powersgd"
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    sync_buffers: bool = True  # DDP's buffer sync before forward (forward_sync_buffers / broadcast_buffers)
    set_epoch: bool = True
    threads: int = 1  # torch threads per rank on the CPU
    straggler_ms: float = 0.0  # the last rank idles this long at the start of each step: a slow rank
    save_after_step: int | None = None  # save a checkpoint to checkpoint_path after this many steps
    resume: bool = False  # start from the checkpoint at checkpoint_path
    checkpoint_path: str | None = None


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
    if config.comm_hook not in COMM_HOOKS:
        raise ValueError(f"comm_hook must be one of {COMM_HOOKS}, got {config.comm_hook!r}")
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
    if config.comm_hook == "powersgd" and dist.get_backend() == "gloo":
        grad_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        if (config.bucket_cap_mb or 25.0) < grad_mb:
            raise ValueError(f"PowerSGD on gloo needs every gradient in one bucket: set bucket_cap_mb >= "
                             f"{grad_mb:.1f}. Its callbacks start all-reduces from gloo's threads, and with "
                             "several buckets the ranks can issue them in different orders (a collective mismatch)")
    ddp = DistributedDataParallel(model, device_ids=device_ids(device), **options)
    state, inner = _comm_hook(config.comm_hook)

    def hook(hook_state, bucket):  # noqa: ANN001 - DDP rejects string annotations (from __future__)
        return inner(hook_state, bucket)

    # Every all-reduce then goes through Python, where CommLog times it. Under its own name: DDP refuses a hook
    # named bf16_compress_hook without CUDA and NCCL, though gloo reduces bf16 tensors on the CPU.
    ddp.register_comm_hook(state, hook)
    return ddp


def _comm_hook(name: str | None) -> tuple[Any, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name is None:
        return None, default_hooks.allreduce_hook  # what DDP does in C++, written in Python
    if name == "fp16":
        return None, default_hooks.fp16_compress_hook
    if name == "bf16":
        return None, default_hooks.bf16_compress_hook
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                        min_compression_rate=1)
    return state, powerSGD_hook.powerSGD_hook


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
    log.resolve()  # CUDA collectives: their GPU start and finish, read from CUDA events (a no-op on CPU ranks)
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

    The file is written beside ``path`` and renamed onto it: a save that fails (a full disk) raises
    ``OSError`` and leaves the previous checkpoint whole. Its SHA-256 goes beside it (``path.sha256``), which
    :func:`dtlib.train.common.load_file` checks: a changed or truncated file is refused by name."""
    if rank == 0:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
        write_atomically(path, lambda file: torch.save(state, file))
        write_digest(path)
    if dist.is_initialized():
        dist.barrier()


def run(config: TrainConfig, world_size: int = 2, **spawn_options: Any) -> list[RankResult]:
    """Train on ``world_size`` ranks through ``dtlib.run``; the results indexed by rank.

    Bad settings are refused here, before any process starts.
    Example: ``run(TrainConfig(steps=4), world_size=2)[0].losses``.
    """
    validate(config, world_size)

    return run_everywhere(train, world_size, args=(config,), **spawn_options)


def train_single(config: TrainConfig, world_size: int = 1) -> RankResult:
    """The reference: one process, no process group, the whole global batch per step.

    ``world_size`` only checks that the config would also be valid on that many ranks.
    Example: ``train_single(TrainConfig(steps=4)).losses``.
    """
    validate(config, world_size)
    return train(0, 1, replace(config, wrapper="none", grad_accum=1, save_after_step=None, resume=False))
