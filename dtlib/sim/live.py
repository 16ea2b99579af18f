"""The simulator's proof: the same layout and step on live ranks (gloo on CPUs, NCCL on GPUs), measured with
the same trackers, so that a cell can put rank 0's simulated tables beside real ones.

Example::

    real = on_live_ranks(LLAMA["tiny"], dp=2, tp=2, seq_len=64)
    fake = simulate(LLAMA["tiny"], dp=2, tp=2, seq_len=64, depths=None)
    real.traffic == fake.traffic     # True: the same collectives, the same bytes
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from dtlib.launch.entry import rank_device
from dtlib.launch.spawn import spawn
from dtlib.measure.peak import PeakTracker
from dtlib.measure.traffic import Row, traffic
from dtlib.sim.llama import Llama, Shape
from dtlib.sim.step import Simulated, check_layout, parallelize, train_step


def _rank(rank: int, world_size: int, shape: Shape, dp: int, tp: int, seq_len: int, micro_batch: int,
          checkpointing: bool, parallelize: Callable[..., Any], step: Callable[..., Any]
          ) -> tuple[dict[str, int], list[Row]]:
    device = rank_device()
    mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = Llama(shape)
    model = parallelize(model, mesh, checkpointing)
    model.to_empty(device=device)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.02) if parameter.dim() > 1 else parameter.fill_(1.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(0)  # every rank the same tokens: tp ranks must see one batch
    tokens = torch.randint(0, shape.vocab, (micro_batch, seq_len), generator=generator).to(device)
    step(model, optimizer, tokens)
    groups = {"dp": mesh["dp"].get_group(), "tp": mesh["tp"].get_group()}
    with PeakTracker(model, optimizer) as peak, traffic(groups) as seen:
        step(model, optimizer, tokens)
    return peak.categories(), seen.rows()


def on_live_ranks(shape: Shape, dp: int = 1, tp: int = 1, seq_len: int = 64, micro_batch: int = 1,
                  checkpointing: bool = False, *, parallelize: Callable[..., nn.Module] = parallelize,
                  step: Callable[..., Any] = train_step, timeout: float = 120.0) -> Simulated:
    """Rank 0's step on dp x tp live ranks, as :func:`dtlib.sim.simulate` reports it (every layer run)."""
    dp, tp, seq_len, micro_batch = check_layout(shape, dp, tp, seq_len, micro_batch)
    started = time.perf_counter()
    results = spawn(_rank, dp * tp, args=(shape, dp, tp, seq_len, micro_batch, checkpointing, parallelize, step),
                    timeout=timeout, output="none")
    memory, rows = results[0]
    return Simulated(shape, dp, tp, seq_len, micro_batch, checkpointing, memory, rows, (shape.layers,),
                     time.perf_counter() - started)
