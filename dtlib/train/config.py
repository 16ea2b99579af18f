"""The runners' settings, typed wherever they travel: :class:`TrainConfig` (the DDP runner,
:mod:`dtlib.train.ddp`) and :class:`FSDPConfig` (the FSDP runner, :mod:`dtlib.train.fsdp`).

Each is a dataclass that goes whole to every rank; ``python -m dtlib.train`` makes a flag of each field, and
each runner's ``validate`` checks it before any process starts. Example::

    FSDPConfig(strategy="hybrid_shard", shard_group_size=2)
"""

from __future__ import annotations

from dataclasses import dataclass


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
class FSDPConfig:
    """One run's settings; the same object goes to every rank. FSDP1 names map onto FSDP2 (see README)."""

    api: str = "fsdp2"  # "fsdp2" (fully_shard), "fsdp1" (FullyShardedDataParallel) or "ddp"
    model: str = "transformer"  # a dtlib.train.models name with identical .blocks (the sharding units)
    strategy: str = "full_shard"  # FSDP1's ShardingStrategy, lower case; FSDP2 maps it (module docstring)
    reshard_after_forward: bool | int | None = None  # FSDP2 only: overrides what strategy implies
    # FSDP2: the root's reshard_after_forward. "blocks": the blocks' setting (so full_shard reshards the root
    # too); None: fully_shard's own default, which keeps the root gathered after forward (one all-gather less).
    root_reshard_after_forward: bool | int | None | str = "blocks"
    shard_group_size: int = 2  # hybrid_shard: ranks per shard group (the rest replicate)
    mixed_precision: bool = False  # bf16 parameters in compute, fp32 gradient reduction
    cpu_offload: bool = False
    auto_wrap: str = "transformer"  # FSDP1: "transformer" (one unit per Block) or "size"
    activation_checkpointing: bool = False  # recompute each block's activations in backward
    meta_init: bool = False  # FSDP2: build on the meta device; only rank 0 ever holds full weights
    # Explicit prefetch. FSDP1: forward_prefetch=True, backward_prefetch=BACKWARD_PRE; FSDP2: each block
    # set_modules_to_forward_prefetch([next block]) and set_modules_to_backward_prefetch([previous block]).
    prefetch: bool = False
    steps: int = 4
    global_batch: int = 16
    grad_accum: int = 1
    lr: float = 1e-2  # Adam
    num_samples: int = 256
    seed: int = 0
    threads: int = 1
    save_after_step: int | None = None
    resume: bool = False
    checkpoint_dir: str | None = None
    checkpoint_kind: str = "sharded"  # "sharded" (DCP, one file per rank) or "full" (one file from rank 0)
