"""``python -m dtlib.bench checkpoint``: what a DCP save takes from a training step, blocking against async.

DDP trains a stack of ``layers`` Linear(1024, 1024) layers (8 by default: 8.4M parameters, 100 MB of weights
and AdamW's two moments) on each rank's device, times every step, and checkpoints every ``every`` steps into a
private temporary folder, once with ``dcp.save`` and once with ``dcp.async_save`` (one save in flight; the
checkpoint on a gloo process group of its own, as notebook 16 teaches). A row per kind: the median step that
saves, the median other step, their difference (the stall: what the save took from its step) and all steps'
sum. Both kinds run in every repeat, alternating, and the medians are over every repeat's steps, so that a
machine that slows down meanwhile slows both.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dtlib.bench import _table
from dtlib.bench._table import Column
from dtlib.launch.device import device_ids, rank_device
from dtlib.launch.spawn import spawn

KINDS = ("blocking", "async")


@dataclass(frozen=True)
class SaveTiming:
    """One kind of save: median step times in ms, the stall (saving step less other step) and the run's total."""

    kind: str
    saving_step_ms: float
    other_step_ms: float
    stall_ms: float
    total_s: float
    saves: int


def _train_and_save(rank: int, world_size: int, folder: str, kind: str, steps: int, every: int,
                    layers: int) -> list[float]:
    """Each step's seconds on this rank (a rank function: it runs under dtlib.spawn)."""
    import torch.distributed.checkpoint as dcp  # loaded only by a rank that saves
    from torch.distributed.checkpoint.state_dict import get_state_dict

    device = rank_device()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(layers)]).to(device),
                device_ids=device_ids(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    saving = dist.new_group(backend="gloo")
    seconds, pending = [], None
    for step in range(1, steps + 1):
        began = time.perf_counter()
        loss = model(torch.randn(64, 1024, device=device)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % every == 0:
            model_state, optim_state = get_state_dict(model, optimizer)
            state, where = {"model": model_state, "optim": optim_state}, f"{folder}/{kind}-{step}"
            if kind == "blocking":
                dcp.save(state, checkpoint_id=where, process_group=saving)
            else:
                if pending is not None:
                    pending.result()
                pending = dcp.async_save(state, checkpoint_id=where, process_group=saving)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - began)
    if pending is not None:
        pending.result()
    return seconds


def measure(world_size: int = 2, steps: int = 12, every: int = 4, layers: int = 8,
            repeats: int = 3) -> list[SaveTiming]:
    """Rank 0's step times under each kind of save, ``repeats`` runs of each, alternating (module docstring)."""
    if every > steps:
        raise ValueError(f"every ({every}) must be at most steps ({steps}): no step would save")
    times: dict[str, list[list[float]]] = {kind: [] for kind in KINDS}
    folder = tempfile.mkdtemp(prefix="dtlib-bench-checkpoint-")
    try:
        for repeat in range(repeats):
            for kind in KINDS:
                where = f"{folder}/{repeat}"
                times[kind].append(spawn(_train_and_save, world_size, args=(where, kind, steps, every, layers))[0])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    rows = []
    for kind in KINDS:
        saving = [run[i] for run in times[kind] for i in range(every - 1, steps, every)]
        other = [run[i] for run in times[kind] for i in range(steps) if (i + 1) % every]
        saving_ms, other_ms = statistics.median(saving) * 1e3, statistics.median(other) * 1e3
        rows.append(SaveTiming(kind, saving_ms, other_ms, saving_ms - other_ms,
                               statistics.median(sum(run) for run in times[kind]), len(saving)))
    return rows


COLUMNS = [
    Column("save", 8, lambda row: row.kind, align="<"),
    Column("saving step ms", 14, lambda row: row.saving_step_ms, ".1f"),
    Column("other step ms", 13, lambda row: row.other_step_ms, ".1f"),
    Column("stall ms", 8, lambda row: row.stall_ms, ".1f"),
    Column("all steps s", 11, lambda row: row.total_s, ".2f"),
    Column("saves", 5, lambda row: row.saves),
]


def format_table(rows: list[SaveTiming]) -> str:
    """The table ``python -m dtlib.bench checkpoint`` prints, with the two stalls' ratio last."""
    stall = {row.kind: row.stall_ms for row in rows}
    ratio = stall["async"] / stall["blocking"] if stall.get("blocking", 0) > 0 else None
    footer = f"# async's stall / blocking's: {ratio:.2f}" if ratio is not None else ""
    return _table.format_table(f"dtlib.bench checkpoint: torch {torch.__version__}, DCP save every few steps",
                               COLUMNS, rows, footer)


def as_records(rows: list[SaveTiming]) -> list[dict[str, object]]:
    """The rows for ``--json``."""
    return _table.as_records(rows)
