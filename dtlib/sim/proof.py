"""The simulator's proof: the same layout and step on live ranks (gloo on CPUs, NCCL on GPUs), measured with
the same trackers, so that a cell can put rank 0's simulated tables beside real ones.

The live ranks run torch's own kernels, those of their device: their result's ``kernels`` says which ("cpu" on
gloo's CPU ranks, "cuda" on GPUs), and the simulation to compare with is asked for the same.

Example::

    real = on_live_ranks(LLAMA["tiny"], dp=2, tp=2, seq_len=64)
    fake = simulate(LLAMA["tiny"], dp=2, tp=2, seq_len=64, depths=None, kernels=real.kernels)
    real.traffic == fake.traffic     # True: the same collectives, the same bytes
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtlib.launch.device import rank_device
from dtlib.launch.spawn import spawn
from dtlib.measure.peak import PeakTracker
from dtlib.measure.traffic import Row, traffic
from dtlib.sim.llama import Llama, Shape
from dtlib.sim.step import (
    Layout,
    Simulated,
    check_layout,
    groups_of,
    lay_out,
    mesh_of,
    parallelize,
    run_step,
    tokens_for,
)

#: The most steps measured on the live ranks after the first, in search of one whose peak is exactly the step's own.
#: A finished collective's tensors are sometimes dropped last by gloo's own worker thread, a moment after the rank's
#: code let go of them, and on a busy machine that moment can fall after the next op: a peak noted then counts those
#: bytes, where fake ranks (no worker threads) and the step's own code have freed them. The tracker names the bytes
#: at its peak that another thread freed (:meth:`~dtlib.measure.peak.PeakTracker.freed_elsewhere`); a step with none
#: is exact. Beside two busy loops, about one rank's step in fifty was not (``docs/testing.md``, stop 69).
MOST_STEPS = 6

Measured = tuple[PeakTracker, dict[str, int], list[Row]]


def first_exact(measure: Callable[[], Measured], agree: Callable[[bool], bool], most: int = MOST_STEPS) -> Measured:
    """Measure steps (``measure()``: the tracker, its categories and the collectives) until one is exact on every
    rank's say (``agree``: rank 0's verdict, the one reported, told to all, so that every rank runs as many steps):
    no byte at its peak freed by a thread other than the rank's own. A step's verdict is taken once the next step
    has run: by then gloo's worker has long dropped whatever it still held of it. Refuses after ``most`` steps,
    none exact."""
    measured = [measure()]
    for _ in range(most):
        measured.append(measure())
        if agree(measured[-2][0].freed_elsewhere() == 0):
            return measured[-2]
    raise RuntimeError(f"each of the {most} steps measured on live ranks held at its peak tensors that another thread "
                       "freed later (gloo's worker dropping a finished collective's tensors after the rank's code let "
                       "go of them): their peaks may count bytes the step no longer held. Is the machine very busy? "
                       "Run it again when it is quieter.")


def _rank(rank: int, world_size: int, shape: Shape, layout: Layout, checkpointing: bool,
          parallelize: Callable[..., Any], step: Callable[..., Any] | None
          ) -> tuple[dict[str, int], list[Row], str]:
    device = rank_device()
    mesh = mesh_of(layout, device.type)
    with torch.device("meta"):
        model = Llama(shape, stage=mesh["pp"].get_local_rank(), stages=layout.pp)
    model = lay_out(parallelize, model, mesh, layout, checkpointing)
    model.to_empty(device=device)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.02) if parameter.dim() > 1 else parameter.fill_(1.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)  # the device's default: what adamw() simulates
    generator = torch.Generator().manual_seed(0)  # every rank the same tokens: tp ranks must see one batch
    tokens = tokens_for(shape, layout, generator).to(device)
    run_step(step, model, optimizer, tokens, mesh)  # a whole first step (the simulator's runs one micro-batch)

    def measure() -> Measured:
        with PeakTracker(model, optimizer) as peak, traffic(groups_of(mesh)) as seen:
            run_step(step, model, optimizer, tokens, mesh)
        return peak, peak.categories(), seen.rows()

    def agree(exact: bool) -> bool:
        verdict = torch.tensor([float(exact)], device=device)
        dist.broadcast(verdict, src=0)
        return bool(verdict.item())

    _, memory, rows = first_exact(measure, agree)
    return memory, rows, "cuda" if device.type == "cuda" else "cpu"


def on_live_ranks(shape: Shape, dp: int = 1, tp: int = 1, seq_len: int = 64, micro_batch: int = 1,
                  checkpointing: bool = False, *, pp: int = 1, micro_batches: int = 1, sequence_parallel: bool = False,
                  loss_parallel: bool = False, parallelize: Callable[..., nn.Module] = parallelize,
                  step: Callable[..., Any] | None = None, timeout: float = 120.0) -> Simulated:
    """Rank 0's step on pp x dp x tp live ranks, as :func:`dtlib.sim.step.simulate` reports it (every layer run),
    with torch's own kernels: the result's ``kernels`` names the device's. The first step measured after the first
    whose peak is exact (:func:`first_exact`)."""
    layout = check_layout(shape, dp, tp, seq_len, micro_batch, pp, micro_batches, sequence_parallel, loss_parallel)
    started = time.perf_counter()
    results = spawn(_rank, layout.world_size, args=(shape, layout, checkpointing, parallelize, step),
                    timeout=timeout, output="none")
    memory, rows, kernels = results[0]
    return Simulated(shape, layout, checkpointing, memory, rows, (shape.layers,), time.perf_counter() - started,
                     kernels)
