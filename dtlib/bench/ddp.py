"""DDP measured: one rank with the global batch against N ranks with a share each, all-reduce calls
with and without buckets, and how much communication hides behind backward.

Every rank uses ``threads`` torch threads (1 by default), so N ranks use N cores. Run it::

    python -m dtlib.bench ddp --world-size 2
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from typing import Any

import torch

from dtlib.bench._table import Column
from dtlib.bench._table import as_records as as_records
from dtlib.bench._table import format_table as _format_table
from dtlib.launch.spawn import resolve_backend
from dtlib.measure.timing import slowest_median
from dtlib.train import ddp


@dataclass
class Row:
    """One setting: its median step time (slowest rank, step 0 skipped) and its communication."""

    setting: str
    world_size: int
    per_rank_batch: int
    step_ms: float
    allreduce_calls_per_step: int
    allreduce_mb_per_step: float  # MiB of all-reduce payload per step
    hidden_share: float  # mean over steps after the first: communication hidden behind compute
    final_loss: float


def _row(setting: str, results: list[ddp.RankResult], config: ddp.TrainConfig) -> Row:
    step_s = slowest_median((r.step_times_s for r in results), skip=1)  # step 0 builds the buckets
    first = results[0]
    mean_loss = sum(r.losses[-1] for r in results) / len(results)
    return Row(setting, first.world_size, config.global_batch // first.world_size, step_s * 1e3,
               first.comm_calls[-1], first.comm_bytes[-1] / 2**20, statistics.mean(first.hidden_share[1:]),
               mean_loss)


def measure(world_size: int = 2, *, model: str = "wide_mlp", global_batch: int = 2048, steps: int = 12,
            threads: int = 1, **spawn_options: Any) -> list[Row]:
    """The table's rows. Example: ``measure(2)[0].step_ms``.

    The one-rank baseline runs on the backend, so on the device kind, of the ``world_size``-rank rows: on a
    machine with fewer GPUs than ranks those fall back to gloo on the CPU, and a baseline on the one GPU
    beside them would compare a GPU with CPUs.
    """
    if steps < 3:
        raise ValueError(f"steps must be >= 3 (step 0 builds buckets and is not timed), got {steps}")
    config = ddp.TrainConfig(model=model, steps=steps, global_batch=global_batch, threads=threads,
                             num_samples=max(1024, global_batch * 4))
    spawn_options.setdefault("output", "none")
    spawn_options["backend"] = resolve_backend(spawn_options.get("backend", "auto"), world_size)  # every row's
    rows = [_row("1 rank, whole global batch", ddp.run(replace(config, wrapper="none"), 1, **spawn_options), config)]
    for setting, wrapper, cap in (("torch DDP, buckets (default 25 MB)", "ddp", None),
                                  ("dtlib BucketedDDP, 1 MB buckets", "bucketed", 1.0),
                                  ("dtlib NaiveDDP, one all-reduce per parameter", "naive", None)):
        results = ddp.run(replace(config, wrapper=wrapper, bucket_cap_mb=cap), world_size, **spawn_options)
        rows.append(_row(setting, results, config))
    return rows


def format_table(rows: list[Row]) -> str:
    """A table with the speed-up of each N-rank setting over one rank."""
    single = rows[0].step_ms
    return _format_table(
        f"dtlib.bench ddp: torch {torch.__version__}, global batch split over ranks, median step "
        "(slowest rank, step 0 skipped)",
        [Column("setting", 46, lambda r: r.setting, align="<"), Column("ranks", 5, lambda r: r.world_size),
         Column("batch/rank", 10, lambda r: r.per_rank_batch), Column("step ms", 8, lambda r: r.step_ms, ".2f"),
         Column("speed-up", 8, lambda r: single / r.step_ms, ".2f", "x"),
         Column("calls/step", 10, lambda r: r.allreduce_calls_per_step),
         Column("MiB/step", 8, lambda r: r.allreduce_mb_per_step, ".2f"),
         Column("hidden", 6, lambda r: None if math.isnan(r.hidden_share) else r.hidden_share, ".0%"),
         Column("loss", 7, lambda r: r.final_loss, ".4f")],
        rows)
