"""A ring all-reduce written with send/recv: ``ring_all_reduce`` is the bandwidth-optimal algorithm of
``dtlib.ring`` on real processes: reduce-scatter then all-gather, each step a send to the right-hand neighbour and
a receive from the left-hand one, posted together. (Notebook 02's exercise writes its starting values in its own
cell: the lesson's code lives there.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

# -- a ring all-reduce from send and recv --------------------------------------------------

Phase = Callable[[list[torch.Tensor], int, int], None]


# GPU run must confirm: on NCCL, one GPU per rank, the ring equals dist.all_reduce (tests/ring/test_send_recv.py).
#: A look at each step before it runs, given ring_shift's own arguments; it may raise to refuse the step (notebook
#: 03's checker, :mod:`dtlib.checks.ring_phases`, sets it while the learner's phase runs). It sees every call of
#: ring_shift, however the caller reached the function (``from dtlib.ring.send_recv import ring_shift`` too).
step_observer: Callable[[torch.Tensor, torch.Tensor, int, int], None] | None = None


def ring_shift(send: torch.Tensor, receive_into: torch.Tensor, rank: int, world_size: int) -> None:
    """One ring step: send ``send`` to rank+1 while receiving ``receive_into`` from rank-1.

    The send and the receive are posted together, in one ``batch_isend_irecv``: with two ranks both go to the
    same peer, and NCCL documents two separate calls to one peer as a possible deadlock.
    Every rank must call it the same number of times, or the ring waits for ever.
    """
    if step_observer is not None:
        step_observer(send, receive_into, rank, world_size)
    transfers = dist.batch_isend_irecv([dist.P2POp(dist.isend, send.contiguous(), (rank + 1) % world_size),
                                        dist.P2POp(dist.irecv, receive_into, (rank - 1) % world_size)])
    for transfer in transfers:
        transfer.wait()  # on a GPU: the current stream waits, so what reads receive_into runs after it


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
