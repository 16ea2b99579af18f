"""The simulated training step: a Llama-shaped model laid out as dp x tp (FSDP2 over "dp", tensor parallelism
inside each block over "tp", notebook 11's 2-D layout), stepped on fake tensors as rank 0 of the world, its
memory at the peak by category and its collectives by mesh dimension measured as on live ranks.

A deep model is simulated shallow and scaled: every block is alike, so each memory category and each
collective row grows by the same amount per block. :func:`simulate` runs the model at two depths and extends
the line to the real depth (``tests/sim`` checks the rule against a full-depth run).

Example::

    result = simulate(LLAMA["7B"], dp=64, seq_len=4096)
    result.memory["activations"] / 2**30     # GiB per rank at the peak
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from dtlib.arguments import whole
from dtlib.measure.peak import CATEGORIES, PeakTracker
from dtlib.measure.traffic import Row, sent_by_group, traffic
from dtlib.sim.llama import Llama, Shape
from dtlib.sim.world import fake_world

#: Notebook 09's plan for a Llama block: q, k, v, gate and up split by columns, o and down by rows.
TP_PLAN = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel(),
           "gate": ColwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}


def parallelize(model: nn.Module, mesh: DeviceMesh, checkpointing: bool = False) -> nn.Module:
    """Tensor parallelism inside each block over ``mesh["tp"]``, then each block and the root sharded with
    FSDP2 over ``mesh["dp"]``, in bf16 with fp32 gradient reduction; ``checkpointing`` recomputes each block."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        block.checkpointing = checkpointing
        if mesh["tp"].size() > 1:
            parallelize_module(block, mesh["tp"], TP_PLAN)
        fully_shard(block, mesh=mesh["dp"], mp_policy=policy)
    return fully_shard(model, mesh=mesh["dp"], mp_policy=policy)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> None:
    """One step of next-token training (the targets are the tokens themselves: the simulator needs shapes)."""
    logits = model(tokens)
    F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()


@dataclass
class Simulated:
    """Rank 0's step: bytes at the peak by category (:data:`dtlib.measure.peak.CATEGORIES`), the collectives
    by mesh dimension, and how it was obtained."""

    shape: Shape
    dp: int
    tp: int
    seq_len: int
    micro_batch: int
    checkpointing: bool
    memory: dict[str, int]
    traffic: list[Row]
    depths: tuple[int, ...] = ()  # the depths simulated: two, scaled to shape.layers, or the real one
    seconds: float = 0.0  # how long the simulation took here

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    @property
    def peak(self) -> int:
        return sum(self.memory.values())

    def model_state(self) -> int:
        return self.memory["weights"] + self.memory["gradients"] + self.memory["optimizer"]

    def sent(self) -> dict[str, int]:
        """Bytes rank 0 sends per step along each mesh dimension ("dp", "tp")."""
        return sent_by_group(self.traffic)


def check_layout(shape: Shape, dp: int, tp: int, seq_len: int, micro_batch: int) -> tuple[int, int, int, int]:
    dp, tp = whole("dp", dp), whole("tp", tp)
    seq_len, micro_batch = whole("seq_len", seq_len), whole("micro_batch", micro_batch)
    if shape.heads % tp or shape.kv_heads % tp or shape.ffn % tp:
        raise ValueError(f"tp={tp} must divide the heads ({shape.heads}), the key/value heads ({shape.kv_heads}) "
                         f"and the MLP width ({shape.ffn}): each rank holds whole heads")
    return dp, tp, seq_len, micro_batch


def step_on_fake_ranks(shape: Shape, dp: int, tp: int, seq_len: int, micro_batch: int = 1,
                       checkpointing: bool = False, parallelize: Callable[..., Any] = parallelize,
                       step: Callable[..., Any] = train_step) -> tuple[dict[str, int], list[Row]]:
    """Rank 0 of dp x tp fake ranks: lay the model out with ``parallelize(model, mesh, checkpointing)``, then
    run ``step(model, optimizer, tokens)`` twice (the first creates Adam's state) and measure the second."""
    dp, tp, seq_len, micro_batch = check_layout(shape, dp, tp, seq_len, micro_batch)
    with fake_world(dp * tp):
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))  # fails inside FakeTensorMode
        with torch.device("meta"):
            model = Llama(shape)
        model = parallelize(model, mesh, checkpointing)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            tokens = torch.randint(0, shape.vocab, (micro_batch, seq_len))
            step(model, optimizer, tokens)
            groups = {"dp": mesh["dp"].get_group(), "tp": mesh["tp"].get_group()}
            with PeakTracker(model, optimizer) as peak, traffic(groups) as seen:
                step(model, optimizer, tokens)
        return peak.categories(), seen.rows()


def _extend(low: float, high: float, low_depth: int, high_depth: int, depth: int) -> int:
    """The line through (low_depth, low) and (high_depth, high), read at ``depth``."""
    return round(low + (high - low) * (depth - low_depth) / (high_depth - low_depth))


def simulate(shape: Shape, dp: int = 1, tp: int = 1, seq_len: int = 4096, micro_batch: int = 1,
             checkpointing: bool = False, *, depths: tuple[int, int] | None = (3, 4),
             parallelize: Callable[..., Any] = parallelize, step: Callable[..., Any] = train_step) -> Simulated:
    """Rank 0's memory and traffic for one training step of ``shape`` on dp x tp ranks.

    ``depths``: the two depths simulated and scaled to ``shape.layers`` (a few seconds whatever the depth);
    None simulates every layer (about a second per layer here). ``parallelize`` and ``step`` are the layout and
    the step, notebook 11's by default; pass your own to simulate them.
    """
    started = time.perf_counter()
    if depths is None or shape.layers <= max(depths):
        memory, rows = step_on_fake_ranks(shape, dp, tp, seq_len, micro_batch, checkpointing, parallelize, step)
        used = (shape.layers,)
    else:
        low_depth, high_depth = depths
        low = step_on_fake_ranks(shape.with_layers(low_depth), dp, tp, seq_len, micro_batch, checkpointing,
                                 parallelize, step)
        high = step_on_fake_ranks(shape.with_layers(high_depth), dp, tp, seq_len, micro_batch, checkpointing,
                                  parallelize, step)
        memory = {name: _extend(low[0][name], high[0][name], low_depth, high_depth, shape.layers)
                  for name in CATEGORIES}
        lows = {(row.group, row.call): row for row in low[1]}
        rows = [Row(row.group, row.call,
                    *(_extend(getattr(lows[(row.group, row.call)], name), getattr(row, name), low_depth,
                              high_depth, shape.layers) if (row.group, row.call) in lows else getattr(row, name)
                      for name in ("calls", "payload", "sent")))
                for row in high[1]]
        used = (low_depth, high_depth)
    return Simulated(shape, dp, tp, seq_len, micro_batch, checkpointing, memory, rows, used,
                     time.perf_counter() - started)
