"""dtlib.measure.machine: the machine report agrees with torch and never initialises CUDA."""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch
import torch.distributed as dist

from dtlib.measure import machine


def test_machine_info_agrees_with_torch():
    info = machine.machine_info()
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
    machine.machine_info()
    assert not torch.cuda.is_initialized()


def test_summary_names_every_backend_and_the_gpu_count():
    info = machine.machine_info()
    text = info.summary()
    for name in ("gloo", "nccl", "mpi", f"GPUs: {info.gpu_count}", torch.__version__):
        assert name in text


def test_implications_name_the_backend_auto_picks():
    info = machine.machine_info()
    lines = machine.implications(info, world_size=2)
    expected = "NCCL" if info.gpu_count >= 2 and info.backends["nccl"] else "gloo"
    assert expected in lines[0]
    if info.gpu_count == 0:
        assert any("No GPU" in line for line in lines)


def test_implications_promise_no_timing():
    """How long a launch takes depends on the machine; notebook 00 measures it instead of quoting it."""
    for line in machine.implications(machine.machine_info(), world_size=2):
        assert not re.search(r"\d+\s*(ms|s)\b|second|hundredth", line), line


def test_gpu_names_are_asked_in_a_child_so_this_process_never_initialises_cuda(monkeypatch):
    """torch.cuda.get_device_name initialises CUDA, after which fork is unsafe (notebook 00's promise)."""
    import subprocess

    asked = []

    def child(command, **kwargs):
        asked.append(command)
        return subprocess.CompletedProcess(command, 0, stdout="GPU A\nGPU B\n", stderr="")

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: pytest.fail("CUDA touched in this process"))
    monkeypatch.setattr(machine.subprocess, "run", child)
    info = machine.machine_info()
    assert info.gpu_count == 2 and info.gpu_names == ["GPU A", "GPU B"]
    assert asked and asked[0][0] == sys.executable and "get_device_name" in asked[0][-1]
    assert not torch.cuda.is_initialized()


def test_gpu_names_that_cannot_be_read_are_question_marks():
    assert machine.gpu_names(0) == []
    if not torch.cuda.is_available():
        assert machine.gpu_names(1) == ["?"]  # the child fails: no GPU to name


def test_implications_say_whether_this_torch_is_in_the_range_and_what_dtlib_adds_to_it(monkeypatch):
    from dtlib import compat

    lines = machine.implications(machine.machine_info(), world_size=2)
    assert any("in the course's range (2.11 to 2.15)" in line for line in lines)
    monkeypatch.setattr(compat, "supported", lambda: "torch 2.9 is older than 2.11, the oldest ...")
    monkeypatch.setattr(compat, "shims", lambda: ["torch 2.11 has no dist.all_gather_single (new in 2.13): ..."])
    lines = machine.implications(machine.machine_info(), world_size=2)
    assert any("older than 2.11" in line and "expect cells to fail" in line for line in lines)
    assert any(line.startswith("torch 2.11 has no dist.all_gather_single") for line in lines)
