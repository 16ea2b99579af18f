"""Checkpoints of FSDP2, FSDP1 and DDP models through ``torch.distributed.checkpoint`` (DCP).

Two kinds, one API for all three wrappers (``get_state_dict`` / ``set_state_dict``):

- ``"sharded"``: every rank writes its own shards with ``dcp.save`` (FSDP1's
  SHARDED_STATE_DICT); loading re-shards to whatever the new job uses.
- ``"full"``: the whole model and optimizer state gathered, written once by rank 0 with
  ``torch.save`` (FSDP1's FULL_STATE_DICT): the file to export or load without FSDP.

On GPUs the full state dict is gathered with ``cpu_offload=True``, the documented
route. On the CPU it must not be: FSDP1's offload path calls ``flat_param.to("cpu")``,
which for a tensor already on the CPU returns the same tensor, and then frees the
unsharded buffer it still uses ("setStorage ... out of bounds for storage of size 0"
in torch 2.13). There is nothing to offload on the CPU anyway, so dtlib skips it.

Example (inside a rank)::

    save(model, optimizer, step=4, directory="/tmp/ckpt", kind="sharded")
    step = load(model, optimizer, "/tmp/ckpt", "sharded")
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

FULL_FILE = "full.pt"
STEP_FILE = "step.json"


@contextlib.contextmanager
def _torch_internal_warnings(notes: list[str]) -> Iterator[None]:
    """Collect the warnings torch's own state-dict code raises (FSDP1's goes through the deprecated
    ShardedTensor in torch 2.13) into ``notes``, once each, instead of printing them on every rank."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for message in sorted({str(w.message).strip() for w in caught}):
        if message not in notes:
            notes.append(message)


def _full_options() -> StateDictOptions:
    on_gpu = dist.get_backend() == "nccl"
    return StateDictOptions(full_state_dict=True, cpu_offload=on_gpu)


def save(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, directory: str, kind: str,
         notes: list[str] | None = None) -> None:
    """Write a checkpoint of ``kind`` ("sharded" or "full") to ``directory``; every rank must call it.

    Warnings torch raises on the way are appended to ``notes`` instead of printed.
    """
    os.makedirs(directory, exist_ok=True)
    with _torch_internal_warnings([] if notes is None else notes):
        _save(model, optimizer, directory, kind)
    if dist.get_rank() == 0:
        with open(os.path.join(directory, STEP_FILE), "w") as f:
            json.dump({"step": step}, f)
    dist.barrier()  # nobody reads a checkpoint that is still being written


def _save(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str, kind: str) -> None:
    if kind == "sharded":
        model_state, optim_state = get_state_dict(model, optimizer)  # DTensors: each rank's shards
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory)
    else:
        model_state, optim_state = get_state_dict(model, optimizer, options=_full_options())
        if dist.get_rank() == 0:
            torch.save({"model": model_state, "optim": optim_state}, os.path.join(directory, FULL_FILE))


def _initialise_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Give the optimizer its state tensors with one zero-gradient step (Adam moves nothing then).

    DCP loads *into* the state dict it is given; a fresh optimizer has no state entries,
    and FSDP1's sharded load then silently loads none.
    """
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad()


def load(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str, kind: str,
         notes: list[str] | None = None) -> int:
    """Load a checkpoint written by :func:`save` into this rank's model and optimizer; return its step."""
    with open(os.path.join(directory, STEP_FILE)) as f:
        step = json.load(f)["step"]
    _initialise_optimizer_state(model, optimizer)
    with _torch_internal_warnings([] if notes is None else notes):
        _load(model, optimizer, directory, kind)
    return step


def _load(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str, kind: str) -> None:
    if kind == "sharded":
        model_state, optim_state = get_state_dict(model, optimizer)  # templates with this job's sharding
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=directory)  # fills the templates in place
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        full = torch.load(os.path.join(directory, FULL_FILE), map_location=device, weights_only=True)
        set_state_dict(model, optimizer, model_state_dict=full["model"], optim_state_dict=full["optim"],
                       options=StateDictOptions(full_state_dict=True))


def documented_fsdp1_full_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, object]:
    """FSDP1's documented full-state-dict route (``FullStateDictConfig(offload_to_cpu=True,
    rank0_only=True)``), kept to show why dtlib avoids it on the CPU: there it raises
    "setStorage ... out of bounds for storage of size 0" (see the module docstring).
    Use it on GPUs; ``FSDP.state_dict_type`` itself is deprecated in torch 2.13 in favour of
    ``get_state_dict``, which :func:`save` uses.
    """
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the deprecation is the docstring's point
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
                                  FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)):
            return {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optimizer)}
