"""dtlib.launch.sysinfo: the machine report agrees with torch and never initialises CUDA."""

from __future__ import annotations

import os
import re

import torch
import torch.distributed as dist

from dtlib.launch import sysinfo


def test_machine_info_agrees_with_torch():
    info = sysinfo.machine_info()
    assert info.torch == torch.__version__
    assert info.cuda_build == torch.version.cuda
    assert info.gpu_count == torch.cuda.device_count() == len(info.gpu_names)
    assert info.backends == {
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available(),
        "mpi": dist.is_mpi_available(),
    }
    assert info.cpu_count == os.cpu_count()
    assert 1 <= info.usable_cpus <= info.cpu_count
    assert "spawn" in info.start_methods


def test_machine_info_leaves_cuda_uninitialised():
    sysinfo.machine_info()
    assert not torch.cuda.is_initialized()


def test_summary_names_every_backend_and_the_gpu_count():
    info = sysinfo.machine_info()
    text = info.summary()
    for name in ("gloo", "nccl", "mpi", f"GPUs: {info.gpu_count}", torch.__version__):
        assert name in text


def test_implications_name_the_backend_auto_picks():
    info = sysinfo.machine_info()
    lines = sysinfo.implications(info, world_size=2)
    expected = "NCCL" if info.gpu_count >= 2 and info.backends["nccl"] else "gloo"
    assert expected in lines[0]
    if info.gpu_count == 0:
        assert any("No GPU" in line for line in lines)


def test_implications_promise_no_timing():
    """How long a launch takes depends on the machine; notebook 00 measures it instead of quoting it."""
    for line in sysinfo.implications(sysinfo.machine_info(), world_size=2):
        assert not re.search(r"\d+\s*(ms|s)\b|second|hundredth", line), line
