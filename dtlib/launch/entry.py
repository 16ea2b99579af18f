"""``dtlib.run``: one entry point that works in a notebook and under torchrun.

The module is ``dtlib.launch.entry``; ``dtlib.run`` is the function, so that the name means one thing.

In a notebook or a plain ``python script.py`` it starts the ranks with
:func:`dtlib.spawn`. Started by ``torchrun`` (one process per rank already
exists), it runs ``fn`` in this process and gathers every rank's result, so
the same script scales from a laptop to ``torchrun --nnodes=...`` unchanged::

    python -m dtlib.examples.hello
    torchrun --standalone --nproc_per_node=2 -m dtlib.examples.hello
"""

from __future__ import annotations

import gc
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dtlib import compat
from dtlib.launch import joblog
from dtlib.launch.device import gpu_of
from dtlib.launch.spawn import resolve_backend, spawn, valid_call_arguments
from dtlib.launch.worker import dumps_result


def under_torchrun() -> bool:
    """True inside a process that torchrun (torch.distributed.run) started.

    Example: ``under_torchrun()`` is False in a notebook and in ranks of ``dtlib.spawn``.
    """
    return "TORCHELASTIC_RUN_ID" in os.environ and "DTLIB_SPAWN" not in os.environ


def run(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    **spawn_options: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; return all results by rank.

    Under torchrun, ``world_size`` is ignored (torchrun's ``WORLD_SIZE`` wins),
    the process group is created here and every rank gets the full list, each value as ``dtlib.spawn``
    returns it (tensors on the CPU, detached; a DTensor as that rank's shard).

    Example::

        results = dtlib.run(train, world_size=2)   # same line in a notebook or under torchrun
    """
    if not under_torchrun():
        return spawn(fn, world_size, args, kwargs, **spawn_options)
    args, kwargs = valid_call_arguments(args, kwargs)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    backend = resolve_backend(spawn_options.get("backend", "auto"), local_world)
    if rank == 0:  # one line per job, whose ranks may sit on several nodes
        joblog.record("torchrun", world, spawn_options.get("backend", "auto"), backend)
    if backend == "nccl":
        torch.cuda.set_device(gpu_of(int(os.environ["LOCAL_RANK"]), torch.cuda.device_count()))
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group(backend)
    gathered_all = False
    try:
        value = fn(rank, world, *args, **kwargs)
        if not dist.is_initialized():
            raise RuntimeError("fn destroyed the process group, which dtlib.run needs to gather every "
                               "rank's result: leave dist.destroy_process_group() to dtlib.run")
        # Each value travels as dtlib.spawn's results do (dumps_result): a CUDA tensor as a CPU one, detached, a
        # DTensor as this rank's shard. Pickled as it is, a CUDA tensor would unpickle on the sender's GPU index
        # in every rank: a CUDA context on each other GPU, and "invalid device ordinal" on a node with fewer.
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, dumps_result(value))
        gathered_all = True
        return [pickle.loads(data) for data in gathered]
    finally:
        if owns_group and dist.is_initialized():
            # Free what fn left behind (a DDP reducer, FSDP state) while the group still exists: freed
            # later, at interpreter exit, a C++ thread of theirs can outlive it ("terminate called
            # without an active exception", SIGABRT, about one torchrun job in six here).
            gc.collect()
            # Then wait for every rank to get here, as dtlib.spawn's ranks linger until all have finished:
            # a rank that closes its connections while a peer is still freeing its own can abort the peer.
            if gathered_all:  # after a failure the peers may never arrive
                dist.barrier()
            compat.destroy_process_group()
