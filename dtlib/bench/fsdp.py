"""DDP against FSDP strategies on one model: model-state bytes per rank measured against the ZeRO
formula, collectives per step, bytes each rank sends, step time. Run it::

    python -m dtlib.bench fsdp --world-size 4
"""

from __future__ import annotations

from typing import Any

import torch

from dtlib import arguments
from dtlib.bench._table import Column
from dtlib.bench._table import as_records as _as_records
from dtlib.bench._table import format_table as _format_table
from dtlib.train import fsdp_compare
from dtlib.train.fsdp import FSDPConfig
from dtlib.train.fsdp_compare import StrategyRow

GLOBAL_BATCH = FSDPConfig().global_batch  # samples per step, split evenly over the ranks


def measure(world_size: int = 2, steps: int = 6, **spawn_options: Any) -> list[StrategyRow]:
    """Every strategy of :data:`dtlib.train.fsdp_compare.SETTINGS` that fits ``world_size``.

    Refuses, before any rank starts, a ``world_size`` that does not divide :data:`GLOBAL_BATCH`.
    Example: ``[row.label for row in measure(2, steps=3)]``.
    """
    if world_size < 1 or GLOBAL_BATCH % world_size:
        divisors = [d for d in range(1, GLOBAL_BATCH + 1) if GLOBAL_BATCH % d == 0]
        raise ValueError(f"world_size={world_size} cannot split the comparison's global batch of {GLOBAL_BATCH} "
                         f"samples evenly: use {', '.join(map(str, divisors[:-1]))} or {divisors[-1]} ranks")
    steps = arguments.count("steps", steps, 1)
    return fsdp_compare.strategies(world_size, steps=steps, **spawn_options)


def as_records(rows: list[StrategyRow]) -> list[dict[str, Any]]:
    """The rows' fields, and the bytes each rank sends in a ring (``fsdp_compare.bytes_sent_per_rank``)."""
    return _as_records(rows, bytes_sent_per_rank=fsdp_compare.bytes_sent_per_rank)


def _comm(kind: str, what: str) -> Column:
    """A column of one kind of collective's calls or bytes per step (rank 0)."""
    header = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR"}[kind]
    return Column(f"{header} {what}", 8 if what == "calls" else 9, lambda r: r.comm.get(kind, {}).get(what, 0))


def format_table(rows: list[StrategyRow]) -> str:
    """Bytes per rank (rank 0): at rest, at the peak between forward and backward, and the formula.

    FSDP1 keeps gathered weights in internal buffers its parameters do not show: its peak is "-". On GPU
    ranks a last column gives CUDA's ``max_memory_allocated`` in the first step: model state plus activations
    and communication buffers.
    """
    ddp = next((r for r in rows if r.label == "DDP"), rows[0])
    ddp_sent = fsdp_compare.bytes_sent_per_rank(ddp) or 1.0
    cuda = [Column("CUDA peak", 9, lambda r: r.cuda_memory["peak"] if r.cuda_memory else None)] \
        if any(r.cuda_memory for r in rows) else []
    return _format_table(
        f"dtlib.bench fsdp: tiny transformer, fp32 + Adam, world_size={rows[0].world_size}, "
        f"torch {torch.__version__}; bytes per rank, ring traffic",
        [Column("setting", 31, lambda r: r.label, align="<"), Column("at rest", 8, lambda r: r.at_rest),
         Column("peak", 8, lambda r: r.peak), Column("formula", 8, lambda r: r.estimate, ".0f"),
         Column("meas/f", 6, lambda r: None if r.peak is None else r.peak / r.estimate, ".3f"),
         _comm("all_gather", "calls"), _comm("all_gather", "bytes"), _comm("reduce_scatter", "bytes"),
         _comm("all_reduce", "bytes"),
         Column("sent/rank", 9, fsdp_compare.bytes_sent_per_rank, ".0f"),
         Column("vs DDP", 6, lambda r: fsdp_compare.bytes_sent_per_rank(r) / ddp_sent, ".2f", "x"),
         Column("step ms", 8, lambda r: r.step_ms, ".2f"), *cuda],
        rows)
