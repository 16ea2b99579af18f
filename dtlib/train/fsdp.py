"""The FSDP runner: the same tiny transformer under FSDP2 (``fully_shard``), FSDP1 or DDP.

:func:`train` runs inside each rank (``dtlib.spawn`` or torchrun); :func:`run` starts it.
It returns, per rank, the losses, the collectives issued per step (kind, calls, bytes),
the model-state bytes this rank holds, and the ZeRO formula's estimate beside them::

    results = dtlib.train.fsdp.run(dtlib.train.fsdp.FSDPConfig(api="fsdp2", strategy="full_shard"), world_size=2)
    results[0].memory_at_rest        # {"parameters": ..., "gradients": ..., "optimizer_state": ...}

:func:`run_many` trains several configs one after another in the same ranks (one launch, not one each).
FSDP2 maps FSDP1's strategies: ``full_shard`` reshards after forward, ``shard_grad_op`` does not, and
``hybrid_shard`` / ``hybrid_shard_zero2`` do the same on a 2-D (replicate, shard) mesh.

From a shell, or under torchrun: ``torchrun --standalone --nproc_per_node=2 -m dtlib.train fsdp --api fsdp2``.
Wrapping lives in :mod:`dtlib.train.fsdp_wrap`, the in-rank measurements in :mod:`dtlib.measure.held`.
"""

from __future__ import annotations

import contextlib
import numbers
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtlib import compat
from dtlib.launch import entry
from dtlib.launch.device import rank_device
from dtlib.measure import memory
from dtlib.measure.commlog import LOGGED, CommLog
from dtlib.measure.held import instrument_blocks, saved_for_backward, shard_example
from dtlib.train import data, fsdp_checkpoint, models
from dtlib.train.common import validate_checkpointing, validate_counts
from dtlib.train.config import FSDPConfig
from dtlib.train.fsdp_wrap import HYBRID, build

__all__ = ["APIS", "STRATEGIES", "FSDPConfig", "FSDPResult", "run", "run_many", "train", "validate"]

APIS = ("fsdp2", "fsdp1", "ddp")
# FSDP1's ShardingStrategy names, lower case; "hybrid_shard_zero2" is its _HYBRID_SHARD_ZERO2.
STRATEGIES = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2")


@dataclass
class FSDPResult:
    """What one rank measured. Bytes are this rank's; comm has one dict per step."""

    rank: int
    world_size: int
    api: str
    num_params: int
    first_step: int = 0
    losses: list[float] = field(default_factory=list)  # mean over all ranks, per step
    step_times_s: list[float] = field(default_factory=list)  # training only: the runner's bookkeeping left out
    comm: list[dict[str, dict[str, int]]] = field(default_factory=list)  # {kind: {"calls", "bytes"}} per step
    memory_at_rest: dict[str, int] = field(default_factory=dict)  # after optimizer.step(), before zero_grad
    # Parameter bytes the module holds between forward and backward (FSDP2 and DDP; FSDP1 keeps the
    # gathered weights in internal buffers that its parameters do not show, so None there).
    parameters_after_forward: int | None = None
    estimate: dict[str, float] = field(default_factory=dict)  # dtlib.measure.memory.breakdown for this setting
    shard_example: dict[str, Any] = field(default_factory=dict)
    block_forward_calls: int = 0  # per step; twice the blocks with activation checkpointing
    # The last step's all-gathers in launch order, each as the size of its process group: FSDP2 full shard
    # on 4 ranks is [4, 4, 4, 4, 4, 4]; reshard_after_forward=2 gathers over pairs in backward: [4, 4, 4, 2, 2, 2].
    all_gather_group_sizes: list[int] = field(default_factory=list)
    # Bytes of the tensors autograd saved for backward in the last forward (activations and inputs, not the
    # parameters), each storage once: what activation checkpointing cuts.
    saved_for_backward_bytes: int = 0
    # On a GPU, CUDA's allocator after the first step (dtlib.measure.memory.allocator): its peak is model state
    # plus activations and communication buffers; None on CPU ranks.
    cuda_memory: dict[str, int] | None = None
    notes: list[str] = field(default_factory=list)


def validate(config: FSDPConfig, world_size: int) -> None:
    """Refuse settings that cannot work, before any process starts, saying what to change.

    Counts must be whole numbers: ``steps=2.5`` or ``global_batch=32.0`` are refused. Other integral
    types (numpy's) are accepted and stored back into ``config`` as ``int``, which torch's samplers need.
    """
    validate_counts(config, world_size, ("steps", "global_batch", "grad_accum", "num_samples", "seed",
                                             "threads", "shard_group_size", "save_after_step"))
    if config.api not in APIS:
        raise ValueError(f"api must be one of {APIS}, got {config.api!r}")
    if config.model != "transformer":
        raise ValueError(f"FSDP shards the transformer's blocks: model must be 'transformer', got {config.model!r}")
    if config.strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {config.strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if config.api == "fsdp2" and torch.cuda.device_count() < world_size and not compat.fsdp2_runs_on_cpu():
        raise ValueError(f"FSDP2 on the CPU needs torch >= {compat.FSDP2_ON_CPU[0]}.{compat.FSDP2_ON_CPU[1]} (its CPU "
                         f"streams lack record_event before that); this is torch {torch.__version__}. Use "
                         "api='fsdp1', one GPU per rank, or a newer torch")
    if config.api == "fsdp2" and config.strategy == "no_shard":
        raise ValueError("FSDP2 has no no_shard: replicating everything is DDP (api='ddp')")
    if config.strategy in HYBRID and config.api != "ddp":
        group = config.shard_group_size
        if group < 1 or world_size % group:
            raise ValueError(f"{config.strategy} needs world_size divisible by shard_group_size: {world_size} ranks "
                             f"cannot form groups of {group}; try shard_group_size=2 with an even world_size")
    root = config.root_reshard_after_forward
    if root != "blocks" and config.api != "fsdp2":
        raise ValueError("root_reshard_after_forward is FSDP2's (fully_shard on the root); leave it at 'blocks'")
    if isinstance(root, str) and root != "blocks":
        raise ValueError(f"root_reshard_after_forward must be 'blocks', None, True, False or an int, got {root!r}")
    if config.prefetch and config.api == "ddp":
        raise ValueError("prefetch is FSDP's (it all-gathers a unit early); DDP gathers nothing")
    gpus = torch.cuda.device_count()  # asks NVML: no CUDA context in this process
    if config.cpu_offload and config.api == "fsdp1" and gpus < world_size:
        raise ValueError("FSDP1's CPUOffload needs an accelerator: it moves each parameter between pinned host "
                         f"memory and the rank's GPU, and with {gpus} GPU(s) for {world_size} ranks the ranks "
                         "compute on the CPU (dtlib gives each rank a GPU only when there is one for each)")
    if config.auto_wrap not in ("transformer", "size"):
        raise ValueError(f"auto_wrap must be 'transformer' or 'size', got {config.auto_wrap!r}")
    if config.checkpoint_kind not in ("sharded", "full"):
        raise ValueError(f"checkpoint_kind must be 'sharded' or 'full', got {config.checkpoint_kind!r}")
    if (config.meta_init or config.activation_checkpointing) and config.api != "fsdp2":
        raise ValueError("meta_init and activation_checkpointing are shown with FSDP2 only (api='fsdp2')")
    if config.steps < 1 or config.grad_accum < 1:
        raise ValueError(f"steps and grad_accum must be >= 1, got {config.steps} and {config.grad_accum}")
    if config.global_batch < 1 or config.global_batch % (world_size * config.grad_accum):
        raise ValueError(f"global_batch={config.global_batch} must be a positive multiple of world_size x "
                         f"grad_accum = {world_size * config.grad_accum}")
    if config.global_batch > config.num_samples:
        raise ValueError(f"global_batch={config.global_batch} exceeds the {config.num_samples} samples")
    validate_checkpointing(config, "checkpoint_dir",
                        ", e.g. dtlib.train.fsdp_checkpoint.default_directory() (private to you)")
    reshard = config.reshard_after_forward
    if reshard is not None and config.api != "fsdp2":
        raise ValueError("reshard_after_forward is FSDP2's; for FSDP1 choose strategy='full_shard' or 'shard_grad_op'")
    if reshard is not None and not isinstance(reshard, bool | numbers.Integral):
        raise ValueError(f"reshard_after_forward must be True, False, None or an int, got {reshard!r}")
    if isinstance(reshard, numbers.Integral) and not isinstance(reshard, bool):
        config.reshard_after_forward = reshard = int(reshard)  # fully_shard wants an int
        group = config.shard_group_size if config.strategy in HYBRID else world_size
        if reshard < 1 or group % reshard:
            raise ValueError(f"reshard_after_forward={reshard}: an integer must divide the {group} ranks that shard "
                             f"each parameter, e.g. {[d for d in range(1, group + 1) if group % d == 0]}")


def _gradient_sync(model: nn.Module, config: FSDPConfig, enabled: bool) -> Any:
    """FSDP2: set_requires_gradient_sync; FSDP1 and DDP: the no_sync() context."""
    if config.api == "fsdp2":
        model.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()
    return contextlib.nullcontext() if enabled else model.no_sync()


def train(rank: int, world_size: int, config: FSDPConfig) -> FSDPResult:
    """Train on this rank inside an initialised process group."""
    validate(config, world_size)
    torch.set_num_threads(config.threads)
    device = rank_device()
    hsdp_on_gloo = config.api == "fsdp2" and config.strategy in HYBRID and device.type == "cpu"
    if hsdp_on_gloo and not compat.gloo_has_avg():
        raise ValueError(f"FSDP2's HSDP averages gradients across replicas with ReduceOp.AVG, which gloo in torch "
                         f"{torch.__version__} lacks; use a newer torch, GPUs (NCCL), or api='fsdp1'")
    notes: list[str] = []
    num_params = sum(p.numel() for p in models.build(config.model, seed=config.seed).parameters())
    model = build(config, world_size, device, notes)
    # After fully_shard: FSDP2's hooks on each block stay outside the recomputed part.
    calls = instrument_blocks(model, config.activation_checkpointing) if config.api == "fsdp2" else [0]
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    start = fsdp_checkpoint.load(model, optimizer, config.checkpoint_dir, config.checkpoint_kind, notes) \
        if config.resume else 0
    result = FSDPResult(rank, world_size, config.api, num_params, first_step=start, shard_example=shard_example(model),
                        notes=notes)
    micro = config.global_batch // world_size // config.grad_accum
    batches = data.batches(data.for_model(config.model, config.num_samples, seed=config.seed), world_size, rank,
                           micro * config.grad_accum, seed=config.seed, first_step=start)
    log = CommLog()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # the peak of this run's first step, not of building the model
    with log.recording(LOGGED):
        for step in range(start, config.steps):
            log.step, calls[0] = step, 0
            # Memory is measured in the first step only: its hooks and walks over every tensor are the runner's
            # bookkeeping, and the step times' median leaves the first step out (it also allocates FSDP's buffers).
            measure = step == start
            began = time.perf_counter()
            x, y = next(batches)
            loss_sum = torch.zeros((), device=device)
            for index, (xs, ys) in enumerate(zip(x.split(micro), y.split(micro), strict=True)):
                last = index == config.grad_accum - 1
                with _gradient_sync(model, config, last):
                    with saved_for_backward(model) if measure else contextlib.nullcontext() as saved:
                        output = model(xs.to(device))
                        if measure and last and config.api != "fsdp1":
                            result.parameters_after_forward = memory.measured(model)["parameters"]
                        loss = models.loss_fn(config.model, output, ys.to(device)) / config.grad_accum
                    loss.backward()
                if saved is not None:
                    result.saved_for_backward_bytes = saved.nbytes
                loss_sum += loss.detach()
            optimizer.step()
            if measure:
                result.memory_at_rest = memory.measured(model, optimizer)
                result.cuda_memory = memory.allocator(device)
            optimizer.zero_grad()
            if device.type == "cuda":
                torch.cuda.synchronize()  # GPU work is asynchronous: the step ends when it has run
            result.step_times_s.append(time.perf_counter() - began)
            result.comm.append(log.totals(step))
            result.all_gather_group_sizes = [e.group_size for e in log.in_step(step) if e.kind == "all_gather"]
            result.block_forward_calls = calls[0]
            log.step = -1  # the loss all-reduce below is bookkeeping, not training traffic
            dist.all_reduce(loss_sum)
            result.losses.append(loss_sum.item() / world_size)
            if config.save_after_step == step + 1:
                fsdp_checkpoint.save(model, optimizer, step + 1, config.checkpoint_dir, config.checkpoint_kind,
                                     notes)
    result.estimate = _estimate(config, world_size, num_params)
    return result


def _estimate(config: FSDPConfig, world_size: int, num_params: int) -> dict[str, float]:
    """The ZeRO formula for this run: fp32 parameters and gradients (FSDP keeps its shards in fp32 even
    with mixed precision), Adam's two fp32 moments."""
    stage = "ddp" if config.api == "ddp" else "zero2" if config.strategy == "hybrid_shard_zero2" else config.strategy
    ranks = config.shard_group_size if config.strategy in HYBRID else world_size
    return memory.breakdown(num_params, ranks, stage, **memory.FP32_ADAM)


def run(config: FSDPConfig, world_size: int = 2, **spawn_options: Any) -> list[FSDPResult]:
    """Train on ``world_size`` ranks (``dtlib.run``: a notebook, a script or torchrun); results by rank.

    Example: ``run(FSDPConfig(api="fsdp1", strategy="shard_grad_op"), 2)[0].losses``.
    """
    validate(config, world_size)
    return entry.run(train, world_size, args=(config,), **spawn_options)


def _train_each(rank: int, world_size: int, configs: list[FSDPConfig]) -> list[FSDPResult]:
    results = []
    for config in configs:
        results.append(train(rank, world_size, config))
        dist.barrier()  # a checkpoint written by one config is complete before the next one reads it
    return results


def run_many(configs: list[FSDPConfig], world_size: int = 2, **spawn_options: Any) -> list[list[FSDPResult]]:
    """Train each config in turn in one launch of ``world_size`` ranks; ``results[i][rank]`` is config i's.

    Each config builds its own model and optimizer, so its results are those of :func:`run`; sharing the
    ranks saves each later config the start-up that a new launch pays. A config that
    resumes (``resume=True``) may follow the one that saved its checkpoint.
    Example: ``run_many([FSDPConfig(api="fsdp1"), FSDPConfig(api="fsdp2")], 2)[1][0].losses``.
    """
    configs = list(configs)
    for config in configs:
        validate(config, world_size)
    by_rank = entry.run(_train_each, world_size, args=(configs,), **spawn_options)
    return [[results[index] for results in by_rank] for index in range(len(configs))]
