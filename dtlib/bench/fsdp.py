"""DDP against FSDP strategies on one model: model-state bytes per rank measured against the ZeRO
formula, collectives per step, bytes each rank sends, step time. Run it::

    python -m dtlib.bench fsdp --world-size 4
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch

from dtlib import fsdp_compare
from dtlib.fsdp import FSDPConfig
from dtlib.fsdp_compare import StrategyRow

GLOBAL_BATCH = FSDPConfig().global_batch  # samples per step, split evenly over the ranks


def measure(world_size: int = 2, steps: int = 6, **spawn_options: Any) -> list[StrategyRow]:
    """Every strategy of :data:`dtlib.fsdp_compare.SETTINGS` that fits ``world_size``.

    Refuses, before any rank starts, a ``world_size`` that does not divide :data:`GLOBAL_BATCH`.
    Example: ``[row.label for row in measure(2, steps=3)]``.
    """
    if world_size < 1 or GLOBAL_BATCH % world_size:
        divisors = [d for d in range(1, GLOBAL_BATCH + 1) if GLOBAL_BATCH % d == 0]
        raise ValueError(f"world_size={world_size} cannot split the comparison's global batch of {GLOBAL_BATCH} "
                         f"samples evenly: use {', '.join(map(str, divisors[:-1]))} or {divisors[-1]} ranks")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    return fsdp_compare.strategies(world_size, steps=steps, **spawn_options)


def as_records(rows: list[StrategyRow]) -> list[dict[str, Any]]:
    return [{**asdict(row), "bytes_sent_per_rank": fsdp_compare.bytes_sent_per_rank(row)} for row in rows]


def format_table(rows: list[StrategyRow]) -> str:
    """Bytes per rank (rank 0): at rest, at the peak between forward and backward, and the formula.

    FSDP1 keeps gathered weights in internal buffers its parameters do not show: its peak is "-".
    """
    ddp = next((r for r in rows if r.label == "DDP"), rows[0])
    ddp_sent = fsdp_compare.bytes_sent_per_rank(ddp) or 1.0
    lines = [f"# dtlib.bench fsdp: tiny transformer, fp32 + Adam, world_size={rows[0].world_size}, "
             f"torch {torch.__version__}; bytes per rank, ring traffic",
             f"# {'setting':<31} {'at rest':>8} {'peak':>8} {'formula':>8} {'meas/f':>6} {'AG calls':>8} "
             f"{'AG bytes':>9} {'RS bytes':>9} {'AR bytes':>9} {'sent/rank':>9} {'vs DDP':>6} {'step ms':>8}"]
    for r in rows:
        sent = fsdp_compare.bytes_sent_per_rank(r)
        ag, rs, ar = (r.comm.get(kind, {"calls": 0, "bytes": 0}) for kind in ("all_gather", "reduce_scatter",
                                                                              "all_reduce"))
        peak, ratio = ("-", "-") if r.peak is None else (r.peak, f"{r.peak / r.estimate:.3f}")
        lines.append(f"  {r.label:<31} {r.at_rest:>8} {peak:>8} {r.estimate:>8.0f} {ratio:>6} "
                     f"{ag['calls']:>8} {ag['bytes']:>9} {rs['bytes']:>9} {ar['bytes']:>9} {sent:>9.0f} "
                     f"{sent / ddp_sent:>5.2f}x {r.step_ms:>8.2f}")
    return "\n".join(lines)
