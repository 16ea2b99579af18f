"""FSDP side by side: each sharding strategy against DDP, and the usual comparison table.

Every function runs ranks through :func:`dtlib.train.fsdp.run` and returns plain rows::

    rows = dtlib.train.fsdp_compare.strategies(world_size=2)      # memory, traffic, time and loss per strategy
    dtlib.train.fsdp_compare.comparison_table(rows)
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any

from dtlib.measure import memory
from dtlib.ring.cost import BUS_FACTOR
from dtlib.train.common import slowest_median_step_s
from dtlib.train.fsdp import FSDPConfig, FSDPResult, run
from dtlib.train.guide import largest_model


def max_difference(first: list[float], second: list[float]) -> float:
    """The largest difference between two loss curves of equal length."""
    return max(abs(a - b) for a, b in zip(first, second, strict=True))


@dataclass
class StrategyRow:
    """One strategy measured on rank 0: model-state bytes, collectives per step, time and loss."""

    label: str
    world_size: int
    shard_group: int  # ranks that split the parameters among them (1 for DDP)
    at_rest: int  # bytes of parameters + gradients + optimizer state held between steps
    at_rest_parts: dict[str, int]  # the same, split as dtlib.measure.memory.measured splits it
    peak: int | None  # at rest plus the parameters gathered between forward and backward (None: FSDP1 hides them)
    estimate: float  # the formula for the same setting at its peak, fp32 Adam: DDP 16P, FSDP memory.fsdp_estimate
    comm: dict[str, dict[str, int]]  # {kind: {"calls", "bytes"}} in the last step
    step_ms: float
    final_loss: float
    notes: list[str]
    cuda_memory: dict[str, int] | None = None  # GPU ranks: CUDA's allocated, peak and reserved bytes on rank 0


SETTINGS: dict[str, dict[str, Any]] = {
    "DDP": {"api": "ddp"},
    "FSDP2 full shard": {"api": "fsdp2", "strategy": "full_shard"},
    "FSDP2 no reshard after forward": {"api": "fsdp2", "strategy": "shard_grad_op"},
    "FSDP2 HSDP (2 x 2 mesh)": {"api": "fsdp2", "strategy": "hybrid_shard"},
    "FSDP1 FULL_SHARD": {"api": "fsdp1", "strategy": "full_shard"},
    "FSDP1 SHARD_GRAD_OP": {"api": "fsdp1", "strategy": "shard_grad_op"},
}


def strategy_row(label: str, results: list[FSDPResult]) -> StrategyRow:
    """The row of :data:`SETTINGS`' ``label`` from its job's results (every rank's, from :func:`run`)."""
    first = results[0]
    at_rest = sum(first.memory_at_rest.values())
    after_forward = first.parameters_after_forward  # bytes of model.parameters() between forward and backward
    # DDP's parameters, and FSDP2's resharded ones, are the very tensors held at rest. FSDP2's gathered
    # parameters are a second copy: the fp32 shards stay beside them (dtlib.measure.memory.fsdp_breakdown).
    keeps_gathered = first.api != "ddp" and after_forward != first.memory_at_rest["parameters"]
    peak = None if after_forward is None else at_rest + (after_forward if keeps_gathered else 0)
    step_s = slowest_median_step_s(results)
    shard_group = 1 if first.api == "ddp" else 2 if "HSDP" in label else first.world_size
    if first.api == "ddp":
        estimate = memory.estimate(first.num_params, first.world_size, "ddp", **memory.FP32_ADAM)
    else:
        estimate = memory.fsdp_estimate(first.num_params, shard_group, compute_bytes=4,
                                        reshard_after_forward=SETTINGS[label]["strategy"] != "shard_grad_op")
    return StrategyRow(label, first.world_size, shard_group, at_rest, first.memory_at_rest, peak, estimate,
                       first.comm[-1], step_s * 1e3, first.losses[-1], first.notes, first.cuda_memory)


def settings_for(world_size: int) -> tuple[str, ...]:
    """The labels of :data:`SETTINGS` that run on ``world_size`` ranks: HSDP's 2 x 2 mesh only where
    ``world_size`` is a multiple of 4. Example: ``"FSDP2 HSDP (2 x 2 mesh)" not in settings_for(2)``."""
    return tuple(label for label in SETTINGS if "HSDP" not in label or world_size % 4 == 0)


def strategies(world_size: int = 2, labels: tuple[str, ...] | None = None, *, steps: int = 6,
               **spawn_options: Any) -> list[StrategyRow]:
    """The same model and data under each setting of :data:`SETTINGS` that fits (:func:`settings_for`):
    one job and one row each.

    Example: ``[(r.label, r.at_rest) for r in strategies(2)]``.
    """
    spawn_options = {"output": "none", **spawn_options}
    return [strategy_row(label, run(FSDPConfig(steps=steps, **SETTINGS[label]), world_size, **spawn_options))
            for label in labels or settings_for(world_size)]


def bytes_sent_per_rank(row: StrategyRow) -> float:
    """Bytes one rank sends per step if every collective is a ring (notebook 03): all-gather and
    reduce-scatter move (g-1)/g of their buffer over a group of g ranks, all-reduce 2(r-1)/r.

    DDP all-reduces S over all n ranks; FSDP all-gathers and reduce-scatters over the shard group
    g; HSDP also all-reduces each shard (S/g) over the r = n/g replicas.
    """
    g = row.shard_group
    r = row.world_size // g
    sent = 0.0
    for kind, totals in row.comm.items():
        if kind == "all_reduce":
            sent += totals["bytes"] * BUS_FACTOR["allreduce"](r)
        else:
            sent += totals["bytes"] * BUS_FACTOR["allgather"](g)  # a reduce-scatter's share is the same
    return sent


def comparison_table(rows: list[StrategyRow], gpu_memory_gb: float = 80, num_gpus: int = 8) -> list[str]:
    """The usual DDP-against-FSDP table as text lines, numeric rows measured (``rows`` from
    :func:`strategies`) or computed (largest model with mixed-precision AdamW, from
    ``dtlib.train.guide.largest_model``)."""

    choice = {"DDP": "DDP", "FSDP2 full shard": "FSDP full sharding", "FSDP1 FULL_SHARD": "FSDP full sharding",
              "FSDP2 no reshard after forward": "FSDP, no reshard after forward",
              "FSDP1 SHARD_GRAD_OP": "FSDP, no reshard after forward", "FSDP2 HSDP (2 x 2 mesh)": "HSDP"}
    ddp = next(r for r in rows if r.label == "DDP")

    cells = {
        "state per rank (kB)": [f"{r.at_rest / 1e3:.1f}" for r in rows],
        "peak, fwd to bwd (kB)": ["-" if r.peak is None else f"{r.peak / 1e3:.1f}" for r in rows],
        "communication": ["all-reduce" if r.label == "DDP" else
                          "AG + RS" + (" + AR" if "all_reduce" in r.comm else "") for r in rows],
        "sent per rank, step (kB)": [f"{bytes_sent_per_rank(r) / 1e3:.1f}" for r in rows],
        "traffic vs DDP": [f"{bytes_sent_per_rank(r) / bytes_sent_per_rank(ddp):.2f}x" for r in rows],
        f"largest, {num_gpus} x {gpu_memory_gb:g} GB GPUs": [  # HSDP: two shard groups ("nodes") of half the GPUs
            f"{largest_model(choice[r.label], gpu_memory_gb, num_gpus, nodes=2) / 1e9:.1f}B params" for r in rows],
        "step time here (ms)": [f"{r.step_ms:.1f}" for r in rows],
        "final loss": [f"{r.final_loss:.4f}" for r in rows],
        "set-up": ["DDP(model)" if r.label == "DDP" else "fully_shard/block" for r in rows],
        "checkpointing": ["torch.save, rank 0" if r.label == "DDP" else "DCP or full gather" for r in rows],
    }
    # Columns as narrow as their values; long strategy names wrap over several header lines, so the table
    # stays about 100 characters wide and keeps its columns in a notebook's output area.
    widths = [max(len(values[i]) for values in cells.values()) + 2 for i in range(len(rows))]
    aspect_width = max(map(len, cells))  # the first column's values bring their own gap
    headers = [textwrap.wrap(r.label, width - 2) for r, width in zip(rows, widths, strict=True)]
    depth = max(map(len, headers))
    headers = [[""] * (depth - len(h)) + h for h in headers]  # names end on the line above the first row
    lines = [" " * aspect_width + "".join(f"{h[line]:>{w}}" for h, w in zip(headers, widths, strict=True))
             for line in range(depth)]
    for aspect, values in cells.items():
        lines.append(f"{aspect:{aspect_width}}" + "".join(f"{v:>{w}}" for v, w in zip(values, widths, strict=True)))
    return lines
