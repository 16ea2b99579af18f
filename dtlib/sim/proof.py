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

#: Steps measured on the live ranks, after the first; the one with the lowest peak is reported. A finished
#: collective's tensors are sometimes dropped last by gloo's own worker thread, a moment after the rank's code let
#: go of them, and on a busy machine that moment can fall after the next op: the peak then reads those bytes as
#: live, where fake ranks (no worker threads) and the step's own code have freed them. The lag can only add to a
#: peak, so the lower of two steps (alike in everything else) is the nearer to the step's own; two lagged steps in
#: a row remain possible (``docs/testing.md``, stop 68).
MEASURED_STEPS = 2


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
    measured = []
    for _ in range(MEASURED_STEPS):
        with PeakTracker(model, optimizer) as peak, traffic(groups_of(mesh)) as seen:
            run_step(step, model, optimizer, tokens, mesh)
        measured.append((peak.peak, peak.categories(), seen.rows()))
    _, memory, rows = min(measured, key=lambda one: one[0])  # the step gloo's lag raised least, if at all
    return memory, rows, "cuda" if device.type == "cuda" else "cpu"


def on_live_ranks(shape: Shape, dp: int = 1, tp: int = 1, seq_len: int = 64, micro_batch: int = 1,
                  checkpointing: bool = False, *, pp: int = 1, micro_batches: int = 1, sequence_parallel: bool = False,
                  loss_parallel: bool = False, parallelize: Callable[..., nn.Module] = parallelize,
                  step: Callable[..., Any] | None = None, timeout: float = 120.0) -> Simulated:
    """Rank 0's step on pp x dp x tp live ranks, as :func:`dtlib.sim.step.simulate` reports it (every layer run),
    with torch's own kernels: the result's ``kernels`` names the device's. Of the steps measured after the first,
    the one with the lowest peak (:data:`MEASURED_STEPS`)."""
    layout = check_layout(shape, dp, tp, seq_len, micro_batch, pp, micro_batches, sequence_parallel, loss_parallel)
    started = time.perf_counter()
    results = spawn(_rank, layout.world_size, args=(shape, layout, checkpointing, parallelize, step),
                    timeout=timeout, output="none")
    memory, rows, kernels = results[0]
    return Simulated(shape, layout, checkpointing, memory, rows, (shape.layers,), time.perf_counter() - started,
                     kernels)
