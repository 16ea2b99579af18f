"""A world of ranks in one process: torch's "fake" backend, in which this process is one rank of many and no
collective moves a byte, so a layout of 1,024 ranks can be built and stepped on a laptop.

Example::

    with fake_world(64):
        mesh = init_device_mesh("cpu", (8, 8), mesh_dim_names=("dp", "tp"))
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

from dtlib.arguments import whole


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """Be rank ``rank`` of ``world_size`` inside the block, on the "fake" backend; the group is destroyed after.

    Refused where a process group already runs here (a rank's own, or a kernel's), since the simulated
    one would replace it, and where this torch has no fake backend (it came with torch 2.11's registry).
    """
    world_size, rank = whole("world_size", world_size), int(rank)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank}")
    if dist.is_initialized():
        raise RuntimeError("A process group already runs in this process; the simulator builds its own world. "
                           "Run it in the notebook's kernel, not inside a rank or %%ranks.")
    if "fake" not in dist.Backend.backend_list:
        raise RuntimeError("This torch has no 'fake' process-group backend, which the simulator needs "
                           "(torch 2.11 and later register it).")
    dist.init_process_group("fake", rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
