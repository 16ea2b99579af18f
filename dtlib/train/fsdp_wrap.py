"""How the FSDP runner wraps its model: FSDP2's ``fully_shard`` per block then the root, FSDP1's
``FullyShardedDataParallel`` with an auto-wrap policy, or DDP; optionally built on the meta device.

``config`` is a :class:`dtlib.train.fsdp.FSDPConfig` (this module does not import it: no cycle).
Example (inside a rank)::

    model = build(FSDPConfig(api="fsdp2"), world_size, dtlib.rank_device(), notes=[])
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from dtlib.launch.device import device_ids
from dtlib.train import models
from dtlib.train.config import FSDPConfig

HYBRID = ("hybrid_shard", "hybrid_shard_zero2")  # FSDP1's hybrid strategies: a 2-D (replicate, shard) mesh


def _mesh(config: FSDPConfig, world_size: int, device: torch.device) -> Any:
    """The rank's mesh on ``device``'s type: 2-D (replicate, shard) for hybrid sharding, else 1-D over every rank.

    Always named, never left to ``fully_shard``: its default mesh is on the machine's accelerator whatever the
    module's device, and builds it by setting GPU ``LOCAL_RANK``, which a one-GPU machine lacks for rank 1.
    """
    if config.strategy not in HYBRID:
        return init_device_mesh(device.type, (world_size,))
    shape = (world_size // config.shard_group_size, config.shard_group_size)
    return init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))


def wrap_fsdp2(model: nn.Module, config: FSDPConfig, world_size: int, device: torch.device,
                notes: list[str]) -> nn.Module:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    reshard = config.reshard_after_forward
    if reshard is None:
        reshard = config.strategy not in ("shard_grad_op", "hybrid_shard_zero2")
    options: dict[str, Any] = {"reshard_after_forward": reshard, "mesh": _mesh(config, world_size, device)}
    if config.mixed_precision:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if config.cpu_offload:
        pin = device.type == "cuda"  # pinned host memory is for copies to a GPU: only if the rank computes on one
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=pin)
        if pin:  # GPU ranks note this: confirmed on one H100 (tests/gpu/test_gpu_training.py)
            notes.append(f"CPUOffloadPolicy(pin_memory=True): the parameter shards, their gradients and the optimizer "
                         f"state live in pinned host memory, where the optimizer step runs; each unit's shards are "
                         f"copied to {device} before its all-gather, its gradient shards back to the host in backward")
        else:
            notes.append("CPUOffloadPolicy(pin_memory=False): with ranks that compute on the CPU the parameters "
                         "already live in host memory, so offloading changes nothing here")
    for block in model.blocks:
        fully_shard(block, **options)
    if config.mixed_precision:  # the root hands fp32 logits to the loss; blocks must not (their LayerNorm is bf16)
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                    output_dtype=torch.float32)
    if config.root_reshard_after_forward != "blocks":
        options["reshard_after_forward"] = config.root_reshard_after_forward
    model = fully_shard(model, **options)
    if config.prefetch:  # all-gather the next block while this one computes (forward), the previous one (backward)
        blocks = list(model.blocks)
        for block, following in zip(blocks, blocks[1:], strict=False):
            block.set_modules_to_forward_prefetch([following])
            following.set_modules_to_backward_prefetch([block])
    return model


def wrap_fsdp1(model: nn.Module, config: FSDPConfig, world_size: int, device: torch.device,
                notes: list[str]) -> nn.Module:
    from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    if config.auto_wrap == "transformer":
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={models.Block})
    else:
        policy = functools.partial(size_based_auto_wrap_policy, min_num_params=5_000)
    strategy = "_HYBRID_SHARD_ZERO2" if config.strategy == "hybrid_shard_zero2" else config.strategy.upper()
    # device_id: where FSDP1 puts this rank's shards (it moves a CPU-built module there); without it, a
    # CPU-only torch refuses ("FSDP needs a non-CPU accelerator device"). FSDP2 follows its mesh's device.
    options: dict[str, Any] = {"sharding_strategy": ShardingStrategy[strategy], "auto_wrap_policy": policy,
                               "device_id": device}
    if config.strategy in HYBRID:  # without a mesh FSDP1 sizes the shard group by local GPUs (0 here)
        options["device_mesh"] = _mesh(config, world_size, device)
    if config.prefetch:
        options.update(forward_prefetch=True, backward_prefetch=BackwardPrefetch.BACKWARD_PRE)
    if config.mixed_precision:
        options["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                    buffer_dtype=torch.float32)
    if config.cpu_offload:
        options["cpu_offload"] = CPUOffload(offload_params=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FutureWarning)
        wrapped = FSDP(model, **options)
    said = {f"torch {torch.__version__} says: {w.message}" for w in caught if w.category is FutureWarning}
    notes.extend(sorted(said))  # one line per message, not one per FSDP unit
    return wrapped


def wrap(model: nn.Module, config: FSDPConfig, world_size: int, device: torch.device, notes: list[str]) -> nn.Module:
    """``model`` wrapped as ``config.api`` says: FSDP2, FSDP1 or DDP."""
    if config.api == "fsdp2":
        return wrap_fsdp2(model, config, world_size, device, notes)
    if config.api == "fsdp1":
        return wrap_fsdp1(model, config, world_size, device, notes)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    wrapped = DistributedDataParallel(model, device_ids=device_ids(device))
    wrapped.register_comm_hook(None, default_hooks.allreduce_hook)  # DDP's all-reduce in Python: CommLog sees it
    return wrapped


def build(config: FSDPConfig, world_size: int, device: torch.device, notes: list[str]) -> nn.Module:
    """The wrapped model on this rank; with ``config.meta_init``, built on the meta device, sharded, then
    filled from rank 0's weights. Remarks and torch's warnings go to ``notes``."""
    if not config.meta_init:
        return wrap(models.build(config.model, seed=config.seed).to(device), config, world_size, device, notes)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    with torch.device("meta"):  # shapes only: no rank allocates the full model here
        model = models.build(config.model, seed=config.seed)
    model = wrap(model, config, world_size, device, notes)
    model.to_empty(device=device)  # allocates this rank's shards only
    # Rank 0 stands for "the checkpoint on disk": it alone materialises full weights and sends each rank its
    # shard. (reset_parameters on a CPU mesh would give every rank the same random shard.)
    full = models.build(config.model, seed=config.seed).state_dict() if dist.get_rank() == 0 else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    notes.append("meta init: the model was built on the meta device, sharded, then filled from rank 0's weights")
    return model
