"""Real ``torch.distributed`` collectives, shown before and after, and a ring all-reduce
written with send/recv.

Every rank starts with a small tensor whose values say where they came from:
rank r holds ``10 r + i`` at position i (rank 2 of 4: ``[20, 21, 22, 23]``), so
after a collective each number shows which rank and slot it came from::

    result = dtlib.collectives.demo("all_reduce_sum", world_size=4)
    result.after[0]        # [60.0, 64.0, 68.0, 72.0] on every rank

``ring_all_reduce`` is the bandwidth-optimal algorithm of ``dtlib.ring`` on real
processes: reduce-scatter then all-gather, each step a send to the right-hand
neighbour and a receive from the left-hand one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dtlib import compat
from dtlib.launch import spawn

#: What each demo does, in one line (the notebook prints this beside the picture).
COLLECTIVES = {
    "all_reduce_sum": "every rank ends with the elementwise sum of all ranks' tensors",
    "all_reduce_avg": "every rank ends with the elementwise mean (ReduceOp.AVG where the backend has it)",
    "all_reduce_max": "every rank ends with the elementwise maximum",
    "broadcast": "every rank ends with rank 0's tensor",
    "reduce": "rank 0 ends with the sum; the other ranks' buffers are scratch space",
    "all_gather": "every rank ends with every rank's tensor, as a list",
    "all_gather_single": "every rank ends with every rank's tensor, concatenated into one flat tensor",
    "gather": "rank 0 ends with every rank's tensor; the others get nothing",
    "scatter": "rank r ends with the r-th piece of rank 0's tensor",
    "reduce_scatter": "rank r ends with the r-th slice of the sum",
    "all_to_all": "rank r sends its i-th slot to rank i: a transpose across ranks",
    "barrier": "nobody leaves until everybody has arrived; the data is untouched",
    "send_recv": "each rank sends its tensor to the right-hand neighbour (blocking send and recv)",
    "isend_irecv": "the same ring shift with non-blocking isend/irecv",
}


@dataclass
class CollectiveResult:
    """One collective on every rank: the tensors before and after, and what to know about it."""

    name: str
    backend: str
    before: list[list[float]]  # [rank][slot]
    after: list[list[float]]  # [rank][slot]; empty where a rank receives nothing
    note: str = ""


def starting_values(rank: int, world_size: int) -> torch.Tensor:
    """``10 * rank + i`` for i in 0..world_size-1, as float32: rank 1 of 3 holds [10, 11, 12]."""
    return torch.arange(world_size, dtype=torch.float32) + 10 * rank  # (world_size,)


def _run(rank: int, world_size: int, name: str) -> dict[str, Any]:
    x = starting_values(rank, world_size)
    before = x.tolist()
    note = ""
    if name == "all_reduce_sum":
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    elif name == "all_reduce_avg":
        note = compat.all_reduce_mean(x)
    elif name == "all_reduce_max":
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
    elif name == "broadcast":
        dist.broadcast(x, src=0)
    elif name == "reduce":
        dist.reduce(x, dst=0)
    elif name == "all_gather":
        pieces = [torch.empty_like(x) for _ in range(world_size)]
        dist.all_gather(pieces, x)
        x = torch.cat(pieces)
    elif name == "all_gather_single":  # all_gather_into_tensor before torch 2.13
        out = torch.empty(world_size * x.numel())  # (world_size * world_size,)
        compat.all_gather_single(out, x)
        x = out
    elif name == "gather":
        pieces = [torch.empty_like(x) for _ in range(world_size)] if rank == 0 else None
        dist.gather(x, pieces, dst=0)
        x = torch.cat(pieces) if rank == 0 else torch.empty(0)
    elif name == "scatter":
        out = torch.empty(1)
        dist.scatter(out, list(x.chunk(world_size)) if rank == 0 else None, src=0)
        x = out
    elif name == "reduce_scatter":  # reduce_scatter_single (reduce_scatter_tensor before torch 2.13)
        out = torch.empty(1)
        compat.reduce_scatter_single(out, x)
        x = out
    elif name == "all_to_all":
        pieces = [torch.empty(1) for _ in range(world_size)]
        note = compat.all_to_all(pieces, list(x.chunk(world_size)))
        x = torch.cat(pieces)
    elif name == "barrier":
        dist.barrier()
    elif name in ("send_recv", "isend_irecv"):
        received = torch.empty_like(x)
        right, left = (rank + 1) % world_size, (rank - 1) % world_size
        if name == "send_recv":  # even ranks send first, odd ranks receive first: no deadlock
            if rank % 2 == 0:
                dist.send(x, right)
                dist.recv(received, left)
            else:
                dist.recv(received, left)
                dist.send(x, right)
        else:
            requests = [dist.isend(x, right), dist.irecv(received, left)]
            for request in requests:
                request.wait()
        x = received
    else:
        raise ValueError(f"unknown collective {name!r}; choose one of {', '.join(COLLECTIVES)}")
    return {"before": before, "after": x.tolist(), "note": note, "backend": dist.get_backend()}


def demo(name: str, world_size: int = 4, **spawn_options: Any) -> CollectiveResult:
    """Run collective ``name`` (a key of :data:`COLLECTIVES`) on ``world_size`` ranks.

    Example: ``demo("broadcast", 3).after == [[0.0, 1.0, 2.0]] * 3``.
    """
    if name not in COLLECTIVES:
        raise ValueError(f"unknown collective {name!r}; choose one of {', '.join(COLLECTIVES)}")
    if name == "send_recv" and world_size % 2 == 1 and world_size > 1:
        raise ValueError("the blocking send/recv ring pairs even and odd ranks: use an even world_size")
    reports = spawn(_run, world_size, args=(name,), **spawn_options)
    notes = {r["note"] for r in reports if r["note"]}
    return CollectiveResult(name, reports[0]["backend"], [r["before"] for r in reports],
                            [r["after"] for r in reports], "; ".join(sorted(notes)))


# -- a ring all-reduce from send and recv --------------------------------------------------

Phase = Callable[[list[torch.Tensor], int, int], None]


def ring_shift(send: torch.Tensor, receive_into: torch.Tensor, rank: int, world_size: int) -> None:
    """One ring step: send ``send`` to rank+1 while receiving ``receive_into`` from rank-1.

    Every rank must call it the same number of times, or the ring waits for ever.
    """
    request = dist.isend(send.contiguous(), (rank + 1) % world_size)
    dist.recv(receive_into, (rank - 1) % world_size)
    request.wait()


def ring_reduce_scatter_phase(chunks: list[torch.Tensor], rank: int, world_size: int) -> None:
    """N-1 steps; afterwards ``chunks[rank]`` holds the sum over all ranks (in place)."""
    for step in range(world_size - 1):
        send, receive = (rank - 1 - step) % world_size, (rank - 2 - step) % world_size
        incoming = torch.empty_like(chunks[receive])
        ring_shift(chunks[send], incoming, rank, world_size)
        chunks[receive] += incoming


def ring_all_gather_phase(chunks: list[torch.Tensor], rank: int, world_size: int) -> None:
    """N-1 steps; rank r starts owning ``chunks[r]`` and ends with every chunk (in place)."""
    for step in range(world_size - 1):
        send, receive = (rank - step) % world_size, (rank - 1 - step) % world_size
        incoming = torch.empty_like(chunks[receive])
        ring_shift(chunks[send], incoming, rank, world_size)
        chunks[receive].copy_(incoming)


def ring_all_reduce(tensor: torch.Tensor, *, reduce_scatter: Phase = ring_reduce_scatter_phase,
                    all_gather: Phase = ring_all_gather_phase) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place with 2(N-1) send/recv steps; returns it.

    The chunks are ``tensor.flatten().tensor_split(N)``, the same cut as ``dtlib.ring``.
    Either phase can be swapped for your own (the exercise in notebook 03 does).

    Example (inside ``dtlib.spawn``, 2 ranks): ``ring_all_reduce(torch.ones(5))`` holds 2.0 everywhere.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1)
    chunks = list(flat.tensor_split(world_size))  # views: updates land in ``flat``
    reduce_scatter(chunks, rank, world_size)
    all_gather(chunks, rank, world_size)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor
