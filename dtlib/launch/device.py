"""Where a rank computes: ``dtlib.rank_device`` (its GPU under NCCL, else the CPU) and what DDP wants of it.

Every rank function of the course takes its device from here and puts every tensor and module on it, so that the
same cell runs on gloo's CPU ranks and on NCCL's GPU ranks::

    device = dtlib.rank_device()
    model = DistributedDataParallel(model.to(device), device_ids=device_ids(device))
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def rank_device() -> torch.device:
    """The device this rank computes on: its own GPU (``cuda:LOCAL_RANK``, set by the launcher) under
    NCCL, else the CPU; the CPU too outside a process group (a one-process reference run).

    Example: ``model.to(dtlib.rank_device())`` inside a rank.
    """
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def device_ids(device: torch.device) -> list[int] | None:
    """What ``DistributedDataParallel(model, device_ids=...)`` wants for a module on ``device``: the one GPU
    it lives on, or None on the CPU (where a list is refused). Example (inside a rank)::

        device = rank_device()
        DistributedDataParallel(model.to(device), device_ids=device_ids(device))
    """
    return [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" \
        else None
