"""DDP measured: one rank with the global batch against N ranks with a share each, all-reduce calls
with and without buckets, and how much communication hides behind backward.

Every rank uses ``threads`` torch threads (1 by default), so N ranks use N cores. Run it::

    python -m dtlib.bench ddp --world-size 2
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from dtlib import ddp


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
    step_s = max(statistics.median(r.step_times_s[1:]) for r in results)
    first = results[0]
    mean_loss = sum(r.losses[-1] for r in results) / len(results)
    return Row(setting, first.world_size, config.global_batch // first.world_size, step_s * 1e3,
               first.comm_calls[-1], first.comm_bytes[-1] / 2**20, statistics.mean(first.hidden_share[1:]),
               mean_loss)


def measure(world_size: int = 2, *, model: str = "wide_mlp", global_batch: int = 2048, steps: int = 12,
            threads: int = 1, **spawn_options: Any) -> list[Row]:
    """The table's rows. Example: ``measure(2)[0].step_ms``."""
    if steps < 3:
        raise ValueError(f"steps must be >= 3 (step 0 builds buckets and is not timed), got {steps}")
    config = ddp.TrainConfig(model=model, steps=steps, global_batch=global_batch, threads=threads,
                             num_samples=max(1024, global_batch * 4))
    spawn_options.setdefault("output", "none")
    rows = [_row("1 rank, whole global batch", ddp.run(replace(config, wrapper="none"), 1, **spawn_options), config)]
    for setting, wrapper, cap in (("torch DDP, buckets (default 25 MB)", "ddp", None),
                                  ("dtlib BucketedDDP, 1 MB buckets", "bucketed", 1.0),
                                  ("dtlib NaiveDDP, one all-reduce per parameter", "naive", None)):
        results = ddp.run(replace(config, wrapper=wrapper, bucket_cap_mb=cap), world_size, **spawn_options)
        rows.append(_row(setting, results, config))
    return rows


def as_records(rows: list[Row]) -> list[dict[str, Any]]:
    return [asdict(row) for row in rows]


def format_table(rows: list[Row]) -> str:
    """A table with the speed-up of each N-rank setting over one rank."""
    single = rows[0].step_ms
    lines = [f"# dtlib.bench ddp: torch {torch.__version__}, global batch split over ranks, median step "
             f"(slowest rank, step 0 skipped)",
             f"# {'setting':<46} {'ranks':>5} {'batch/rank':>10} {'step ms':>8} {'speed-up':>8} "
             f"{'calls/step':>10} {'MiB/step':>8} {'hidden':>6} {'loss':>7}"]
    for r in rows:
        lines.append(f"  {r.setting:<46} {r.world_size:>5} {r.per_rank_batch:>10} {r.step_ms:>8.2f} "
                     f"{single / r.step_ms:>7.2f}x {r.allreduce_calls_per_step:>10} {r.allreduce_mb_per_step:>8.2f} "
                     f"{r.hidden_share:>6.0%} {r.final_loss:>7.4f}")
    return "\n".join(lines)
