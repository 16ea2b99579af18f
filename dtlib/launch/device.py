"""Where a rank computes: ``dtlib.rank_device`` (its GPU under NCCL, else the CPU) and what DDP wants of it.

Every rank function of the course takes its device from here and puts every tensor and module on it, so that the
same cell runs on gloo's CPU ranks and on NCCL's GPU ranks::

    device = dtlib.rank_device()
    model = DistributedDataParallel(model.to(device), device_ids=device_ids(device))
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

#: NCCL's switch for several ranks on one GPU, which its release 2.30 brought (experimental): set to "1" in the
#: notebook's environment (``os.environ``) before the ranks start. The only way a one-GPU machine runs NCCL on
#: more than one rank.
MULTI_RANK_GPU = "NCCL_MULTI_RANK_GPU_ENABLE"
MULTI_RANK_NCCL = (2, 30)  # the first NCCL that shares a GPU among ranks


def nccl_version() -> tuple[int, ...] | None:
    """The NCCL this torch was built with, as ``(major, minor, patch)``, or None (a CPU build has none)."""
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    if isinstance(version, int):  # older torch: NCCL_VERSION_CODE, major * 10000 + minor * 100 + patch
        return version // 10000, version // 100 % 100, version % 100
    return tuple(int(part) for part in version[:3])


def why_gpus_cannot_be_shared() -> str | None:
    """None where NCCL may put several ranks on one GPU here: the learner opted in (``NCCL_MULTI_RANK_GPU_ENABLE=1``)
    and this torch's NCCL is 2.30 or later. Otherwise the reason, as the sentence a refusal ends with."""
    version = nccl_version()
    said = "no NCCL" if version is None else "NCCL " + ".".join(map(str, version))
    recent = version is not None and version >= MULTI_RANK_NCCL
    if os.environ.get(MULTI_RANK_GPU) != "1":
        return (f"NCCL 2.30 and later can share a GPU among ranks if you set os.environ['{MULTI_RANK_GPU}'] = '1' "
                f"before starting them (experimental){'' if recent else f'; this torch has {said}'}.")
    if not recent:
        return (f"{MULTI_RANK_GPU}=1 asks NCCL to share a GPU among ranks, which needs NCCL 2.30 or later; this "
                f"torch has {said}.")
    return None


def gpu_of(local_rank: int, gpus: int) -> int:
    """The GPU a rank of this machine computes on: its own (``LOCAL_RANK``) where there is a GPU per rank; where
    ranks share GPUs (:func:`why_gpus_cannot_be_shared` said yes), the GPUs dealt out in turn.
    Example: ``gpu_of(3, 2)`` is 1."""
    return local_rank % gpus if 0 < gpus <= local_rank else local_rank


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
