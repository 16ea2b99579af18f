"""A line per job started, where ``DTLIB_JOB_LOG`` names a file: how many ranks, which backend was asked for and
which one they got, and how many GPUs the machine had. ``make gpu-check`` sets it for each part, and its report
(:mod:`dtlib.bench.gpu_report`) says from these lines what ran at each world size, and on what: NCCL, or gloo
for lack of GPUs. Unset (always, outside that check), nothing is written and nothing is read.

Example (a notebook's 4-rank cell on a machine with 2 GPUs)::

    {"launcher": "spawn", "world_size": 4, "asked": "auto", "backend": "gloo", "gpus": 2}
"""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path

import torch

JOB_LOG = "DTLIB_JOB_LOG"
LAUNCHERS = ("spawn", "live", "torchrun")


def record(launcher: str, world_size: int, asked: str, backend: str) -> None:
    """Append one job's line to the file ``DTLIB_JOB_LOG`` names, if it names one. Each line is written with one
    ``write`` on a file opened for appending, so jobs started at once in several processes never interleave."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}")
    path = os.environ.get(JOB_LOG, "")
    if not path:
        return
    line = json.dumps({"launcher": launcher, "world_size": world_size, "asked": asked, "backend": backend,
                       "gpus": torch.cuda.device_count()}) + "\n"  # NVML's count: starts no CUDA context
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(descriptor, line.encode())
    finally:
        os.close(descriptor)


def read(path: Path) -> list[dict[str, object]]:
    """The jobs a log holds, in order; a line cut short (a process killed as it wrote) is left out."""
    jobs = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            job = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(job, dict) and {"world_size", "asked", "backend", "gpus"} <= job.keys():
            jobs.append(job)
    return jobs


def why(job: dict[str, object]) -> str:
    """The column a job counts in: ``nccl``, ``gloo: fewer GPUs than ranks`` (asked for ``auto`` or ``nccl``
    where the machine had too few) or ``gloo: asked for`` (a checker's ranks, a test of gloo)."""
    if job["backend"] != "gloo":
        return str(job["backend"])
    if job["asked"] != "gloo" and int(job["gpus"]) < int(job["world_size"]):  # type: ignore[call-overload]
        return "gloo: fewer GPUs than ranks"
    return "gloo: asked for"


def by_world_size(jobs: Iterable[dict[str, object]]) -> dict[int, Counter[str]]:
    """For each world size, how many jobs counted in each of :func:`why`'s columns."""
    sizes: dict[int, Counter[str]] = defaultdict(Counter)
    for job in jobs:
        sizes[int(job["world_size"])][why(job)] += 1  # type: ignore[call-overload]
    return dict(sorted(sizes.items()))
