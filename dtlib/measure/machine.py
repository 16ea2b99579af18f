"""What this machine offers for distributed training, and what that means for the course.

Example::

    info = dtlib.measure.machine.machine_info()
    print(info.summary())
    for line in dtlib.measure.machine.implications(info):
        print("-", line)
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dtlib import compat
from dtlib.launch.spawn import resolve_backend, resolve_start_method


@dataclass(frozen=True)
class MachineInfo:
    """Facts about this machine, read without initialising CUDA."""

    python: str
    torch: str
    cuda_build: str | None  # CUDA version torch was built with; None for a CPU build
    gpu_count: int
    gpu_names: list[str] = field(default_factory=list)
    backends: dict[str, bool] = field(default_factory=dict)  # gloo, nccl, mpi -> available
    cpu_count: int = 1  # logical CPUs on the machine
    usable_cpus: int = 1  # CPUs this process may run on (containers and taskset limit it)
    start_methods: list[str] = field(default_factory=list)
    platform: str = ""

    def summary(self) -> str:
        """A few lines for a notebook cell."""
        gpus = f"{self.gpu_count} ({', '.join(self.gpu_names)})" if self.gpu_count else "0"
        backends = ", ".join(f"{name}: {'yes' if ok else 'no'}" for name, ok in self.backends.items())
        return "\n".join([
            f"Python {self.python} on {self.platform}",
            f"torch {self.torch} ({'CUDA ' + self.cuda_build if self.cuda_build else 'CPU-only build'})",
            f"GPUs: {gpus}",
            f"CPUs: {self.usable_cpus} usable of {self.cpu_count}",
            f"torch.distributed backends: {backends}",
            f"process start methods: {', '.join(self.start_methods)}",
        ])


def gpu_names(count: int) -> list[str]:
    """The GPUs' names, asked in a child Python: ``torch.cuda.get_device_name`` would initialise CUDA in this
    process, after which ``fork`` (dtlib.spawn's fastest start method) is no longer safe. ``"?"`` for each
    GPU if the child fails. Example: ``gpu_names(1) == ["NVIDIA H100 80GB HBM3"]``."""
    ask = ("import torch\n"
           f"print('\\n'.join(torch.cuda.get_device_name(i) for i in range({int(count)})))")
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        found = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True, timeout=120, check=True)
        names = found.stdout.splitlines()
        if len(names) == count:
            return names
    return ["?"] * count


def machine_info() -> MachineInfo:
    """Read the machine: torch build, GPUs, backends, CPUs. Never initialises CUDA.

    Example: ``machine_info().backends["gloo"]`` is True on every supported platform.
    """
    gpu_count = torch.cuda.device_count()  # NVML where it can: no CUDA context in this process
    names = gpu_names(gpu_count) if gpu_count else []
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity API
        usable = os.cpu_count() or 1
    return MachineInfo(
        python=platform.python_version(),
        torch=torch.__version__,
        cuda_build=torch.version.cuda,
        gpu_count=gpu_count,
        gpu_names=names,
        backends={
            "gloo": dist.is_gloo_available(),
            "nccl": dist.is_nccl_available(),
            "mpi": dist.is_mpi_available(),
        },
        cpu_count=os.cpu_count() or 1,
        usable_cpus=usable,
        start_methods=mp.get_all_start_methods(),
        platform=f"{platform.system()} {platform.machine()}",
    )


def implications(info: MachineInfo, world_size: int = 2) -> list[str]:
    """What ``info`` means for the notebooks, one sentence each.

    Example: on a laptop without GPUs the first line says every job runs on gloo.
    """
    lines = []
    backend = resolve_backend("auto", world_size)
    if backend == "nccl":
        lines.append(f"dtlib.spawn(..., world_size={world_size}) uses NCCL, one GPU per rank (cuda:LOCAL_RANK).")
    else:
        lines.append(f"dtlib.spawn(..., world_size={world_size}) uses gloo on the CPU: every notebook runs here.")
    if 0 < info.gpu_count < world_size:
        lines.append(f"{info.gpu_count} GPU(s): NCCL jobs need one GPU per rank, so larger jobs fall back to gloo.")
    if info.gpu_count == 0:
        lines.append("No GPU: GPU-only parts (NCCL, CUDA memory numbers) are explained and skipped.")
    if info.usable_cpus < 2 * world_size:
        lines.append(
            f"{info.usable_cpus} usable CPU(s): ranks share cores, so timings are noisy; compare ratios from one run."
        )
    why = compat.supported()
    lines.append(f"torch {torch.__version__}: {why}; expect cells to fail." if why else
                 f"torch {torch.__version__} is in the course's range "
                 f"({'.'.join(map(str, compat.MIN_TORCH))} to {'.'.join(map(str, compat.MAX_TORCH))}).")
    lines += [f"{line}." for line in compat.shims()]  # the 2.13 names an older torch gets from dtlib
    method = resolve_start_method("auto")  # what a launch costs is measured, not promised: see section 4 of 00
    lines.append(f"Ranks start with '{method}'" + (
        ": the first launch also starts a server that imports torch once; later ones fork from it."
        if method == "forkserver" else ": every launch starts fresh interpreters that import torch again."))
    return lines
