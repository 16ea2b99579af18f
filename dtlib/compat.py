"""The one place that knows torch versions differ.

Everything else in dtlib calls these helpers instead of branching on versions.
The lowest torch dtlib supports is :data:`MIN_TORCH` (FSDP2's public
``torch.distributed.fsdp.fully_shard`` arrived in 2.6).
"""

from __future__ import annotations

import socket
import time
from typing import Any

import torch
import torch.distributed as dist

MIN_TORCH = (2, 6)


def torch_version() -> tuple[int, int]:
    """``(major, minor)`` of the installed torch, e.g. ``(2, 13)`` for ``2.13.0+cpu``."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def destroy_process_group(group: Any = None) -> None:
    """``dist.destroy_process_group(group)``, without the deadlock of torch 2.6 and 2.7.

    Before torch 2.8 (fixed by pytorch#154976), a gloo group's destructor waits for
    its worker threads while holding the GIL. A worker still releasing the tensors
    of a finished collective (``all_gather_object`` makes such temporaries) needs
    the GIL for that, so both wait for ever. Sleeping first hands the GIL to the
    workers. Measured on torch 2.6: init, ``all_gather_object``, destroy in a loop
    hung within 100 rounds without the pause and passed 600 rounds with it.
    """
    if torch_version() < (2, 8):
        time.sleep(0.05)  # releases the GIL so gloo's workers can drop their tensors
    dist.destroy_process_group(group)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op: Any = None,
                          group: Any = None, async_op: bool = False) -> Any:
    """Reduce-scatter one flat tensor: ``output`` gets this rank's reduced slice of ``input``.

    torch 2.13 renamed ``reduce_scatter_tensor`` to ``reduce_scatter_single`` and
    warns on the old name; older versions have only the old name.

    Example: with 2 ranks, ``input`` of 4 elements and ``output`` of 2, rank 1 gets
    the sum over ranks of ``input[2:4]``.
    """
    op = dist.ReduceOp.SUM if op is None else op
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=op, group=group, async_op=async_op)


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: Any = None,
                      async_op: bool = False) -> Any:
    """All-gather into one flat tensor (``all_gather_into_tensor`` before torch 2.13).

    Example: with 2 ranks each holding 2 elements, ``output`` (4 elements) ends as
    rank 0's elements followed by rank 1's.
    """
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def loopback_listener(backlog: int = 128) -> socket.socket:
    """A TCP socket listening on 127.0.0.1 only, on a free port: the rendezvous address.

    A TCPStore created the usual way listens on every interface. Binding the
    socket ourselves keeps it on loopback, and holding it from the start means no
    other process can take the port between choosing it and using it. Connections
    wait in the backlog until :func:`store_on` starts serving the socket.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(max(128, backlog))
    except BaseException:
        sock.close()
        raise
    return sock


def store_on(listener: socket.socket) -> dist.TCPStore:
    """Serve a rendezvous store on ``listener``, which the store owns from then on.

    The libuv store learned to serve a handed-over socket only in torch 2.8
    (pytorch#150215); before that, the older backend does it.
    """
    port = listener.getsockname()[1]
    return dist.TCPStore(
        "127.0.0.1",
        port,
        world_size=None,
        is_master=True,
        wait_for_workers=False,
        master_listen_fd=listener.detach(),  # closed by the store when it is deleted
        use_libuv=torch_version() >= (2, 8),
    )


def ddp_buffer_sync(enabled: bool) -> dict[str, bool]:
    """The DDP keyword that turns the buffer sync before each forward on or off.

    torch 2.13 deprecated ``broadcast_buffers`` (a FutureWarning) for
    ``forward_sync_buffers``; older versions have only ``broadcast_buffers``.

    Example: ``DistributedDataParallel(model, **ddp_buffer_sync(False))``.
    """
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": enabled}
    return {"broadcast_buffers": enabled}


#: FSDP2 on CPU tensors needs torch 2.7: 2.6's CPU Stream has no record_event (added by pytorch#145935).
FSDP2_ON_CPU = (2, 7)


def fsdp2_runs_on_cpu() -> bool:
    """True where ``fully_shard`` can train on the CPU with gloo (torch >= 2.7); GPUs need only 2.6."""
    return torch_version() >= FSDP2_ON_CPU


def gloo_has_avg() -> bool:
    """Whether the default group's backend accepts ``ReduceOp.AVG`` (gloo gained it after 2.7).

    A collective: every rank must call it. FSDP2's HSDP averages across replicas with AVG.
    """
    try:
        dist.all_reduce(torch.zeros(1), op=dist.ReduceOp.AVG)
        return True
    except (RuntimeError, ValueError) as err:
        if "AVG" not in str(err):
            raise
        return False
