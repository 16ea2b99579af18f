"""Model-state memory per rank: the ZeRO formulas, and the bytes a rank really holds.

Model state is parameters, gradients and optimizer state; activations, temporary
buffers and the allocator's fragmentation come on top and are *not* in the formulas.
With mixed-precision Adam (the ZeRO paper's case) each parameter costs 2 bytes (bf16
or fp16 weights) + 2 (gradients) + 12 (fp32 master weights, momentum and variance)::

    dtlib.memory.estimate(7.5e9, 64, "zero3") / 1e9    # 1.875 GB per rank (the paper: 1.9 GB)

GB here is 1e9 bytes, GiB 2**30.
"""

from __future__ import annotations

from typing import Any

import torch

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
ALIASES = {"no_shard": "ddp", "zero0": "ddp", "shard_grad_op": "zero2", "full_shard": "zero3",
           "hybrid_shard": "zero3"}


def canonical(strategy: str) -> str:
    """``"full_shard"`` -> ``"zero3"``; unknown names get a clear error."""
    name = ALIASES.get(strategy.lower(), strategy.lower())
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES + tuple(ALIASES))}")
    return name


def breakdown(num_params: float, world_size: int, strategy: str, *, param_bytes: float = 2, grad_bytes: float = 2,
              optim_bytes_per_param: float = 12) -> dict[str, float]:
    """Bytes per rank of parameters, gradients and optimizer state under ``strategy``.

    ZeRO-1 shards the optimizer state over the ``world_size`` ranks, ZeRO-2 also the
    gradients, ZeRO-3 also the parameters. ``"hybrid_shard"`` counts as ZeRO-3 within
    one shard group: pass the shard group's size as ``world_size``.
    Example: ``breakdown(1e9, 8, "zero2")["gradients"] == 2e9 / 8``.
    """
    if num_params < 0:
        raise ValueError(f"num_params must be >= 0, got {num_params}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    level = STRATEGIES.index(canonical(strategy))  # 0 = DDP ... 3 = ZeRO-3
    share = 1 / world_size
    return {
        "parameters": num_params * param_bytes * (share if level >= 3 else 1),
        "gradients": num_params * grad_bytes * (share if level >= 2 else 1),
        "optimizer_state": num_params * optim_bytes_per_param * (share if level >= 1 else 1),
    }


def estimate(num_params: float, world_size: int, strategy: str, *, param_bytes: float = 2, grad_bytes: float = 2,
             optim_bytes_per_param: float = 12) -> float:
    """Bytes of model state per rank: 16P (DDP), 4P + 12P/N (ZeRO-1), 2P + 14P/N (ZeRO-2), 16P/N (ZeRO-3)
    with the defaults (mixed-precision Adam).

    Example: ``round(estimate(7.5e9, 64, "zero1") / 1e9, 1) == 31.4`` (the ZeRO paper's figure).
    """
    return sum(breakdown(num_params, world_size, strategy, param_bytes=param_bytes, grad_bytes=grad_bytes,
                         optim_bytes_per_param=optim_bytes_per_param).values())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank stores: a DTensor's local shard, else the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _nbytes(tensors: Any) -> int:
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        local = _local(tensor)
        if local.device.type == "meta":
            continue
        key = local.untyped_storage().data_ptr()
        if key in seen and key != 0:
            continue  # views of one storage (FSDP1's flat parameter) count once
        seen.add(key)
        total += local.untyped_storage().nbytes()
    return total


def measured(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds for ``model``'s parameters and gradients and ``optimizer``'s state.

    Counts the storage behind each tensor (a DTensor's local shard, FSDP1's flat
    parameter with its padding), each storage once.
    Example: ``measured(model, optimizer)["parameters"]``.
    """
    params = list(model.parameters())
    out = {"parameters": _nbytes(params), "gradients": _nbytes(p.grad for p in params if p.grad is not None)}
    states = [] if optimizer is None else [v for s in optimizer.state.values() for v in s.values()
                                           if isinstance(v, torch.Tensor)]
    out["optimizer_state"] = _nbytes(states)
    return out
