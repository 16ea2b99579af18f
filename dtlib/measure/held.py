"""What a model holds inside a rank, measured: the bytes autograd saves for backward, the parameter bytes at
the peak of forward, the gradient bytes, and (for the FSDP runner) the blocks' forward calls and one shard.

Example (inside a rank)::

    with parameter_peak(model) as peak:
        model(x)
    peak.nbytes    # 4 bytes x every parameter if the root is the only unit
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dtlib import compat
from dtlib.measure import memory


@dataclass
class Measured:
    """Bytes that :func:`saved_for_backward` or :func:`parameter_peak` measured in its block."""

    nbytes: int = 0


def _storage(tensor: torch.Tensor) -> Any:
    return (tensor.to_local() if hasattr(tensor, "to_local") else tensor).untyped_storage()


@contextlib.contextmanager
def saved_for_backward(model: nn.Module) -> Iterator[Measured]:
    """Measure the bytes of the tensors autograd saves for backward inside the block: activations and the
    inputs backward needs, each storage once, ``model``'s parameters left out. Activation checkpointing
    cuts it: a checkpointed block keeps only its input. Example (inside a rank)::

        with saved_for_backward(model) as saved:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        saved.nbytes
    """
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        parameters = {_storage(p).data_ptr() for p in model.parameters()}  # FSDP swaps them: ask each time
        storage = _storage(tensor)
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    measured = Measured()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield measured
    measured.nbytes = sum(storages.values())


@contextlib.contextmanager
def parameter_peak(model: nn.Module) -> Iterator[Measured]:
    """Measure the most parameter bytes ``model`` holds (``dtlib.measure.memory.measured``) as any of its layers
    finishes its forward inside the block: under FSDP, every shard plus the units gathered at that moment.
    Example (inside a rank)::

        with parameter_peak(model) as peak:
            model(x)
        peak.nbytes    # 4 bytes x every parameter if the root is the only unit
    """
    measured = Measured()

    def record(module: nn.Module, inputs: Any, output: Any) -> None:
        measured.nbytes = max(measured.nbytes, memory.measured(model)["parameters"])

    handles = [module.register_forward_hook(record) for module in model.modules()]
    try:
        yield measured
    finally:
        for handle in handles:
            handle.remove()


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of gradient this rank holds for ``model`` now: each parameter's ``.grad`` (a DTensor's local
    shard) plus the whole, unsharded gradients FSDP2 keeps between micro-batches while
    ``set_requires_gradient_sync(False)`` holds back the reduce-scatter (read from its state:
    :func:`dtlib.compat.fsdp_params`).
    Example (inside a rank, fp32, P parameters on N ranks): ``4 * P / N`` after a synced step, ``4 * P``
    after a micro-batch without sync."""
    held = [p.grad for p in model.parameters() if p.grad is not None]
    for fsdp_param in compat.fsdp_params(model):
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        for grad in (getattr(unsharded, "grad", None), getattr(fsdp_param, "unsharded_accumulated_grad", None)):
            if grad is not None:
                held.append(grad)
    return memory.nbytes(held)


def instrument_blocks(model: nn.Module, checkpointing: bool) -> list[int]:
    """Count the blocks' forward calls in a one-element list; with ``checkpointing``, each block's
    forward runs under ``torch.utils.checkpoint`` and so runs again in backward (the count doubles)."""
    calls = [0]
    for block in model.blocks:
        original = block.forward

        def counted(*args: Any, _original: Any = original) -> Any:
            calls[0] += 1
            return _original(*args)

        block.forward = functools.partial(checkpoint, counted, use_reentrant=False) if checkpointing else counted
    return calls


def shard_example(model: nn.Module) -> dict[str, Any]:
    """The first parameter's name, full and local shapes, and placements (a DTensor's, or FSDP1's flat parameter)."""
    name, param = next(iter(model.named_parameters()))
    local = param.to_local() if hasattr(param, "to_local") else param
    return {"name": name, "full_shape": tuple(param.shape), "local_shape": tuple(local.shape),
            "placements": str(getattr(param, "placements", "flat parameter" if local.dim() == 1 else "replicated"))}
