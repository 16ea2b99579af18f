"""Tests of ``dtlib.run`` and ``dtlib.under_torchrun``: the same script in a notebook, as a script, under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import cloudpickle
import pytest
import torch
import torch.distributed as dist

import dtlib
from dtlib.launch.processes import free_port

cloudpickle.register_pickle_by_value(sys.modules[__name__])

REPO = Path(__file__).resolve().parents[2]


def rank_summary(rank, world_size, base, scale=1):
    value = torch.tensor([10.0**rank], dtype=torch.float64)
    dist.all_reduce(value)
    return {"rank": rank, "world_size": world_size, "value": (base + rank) * scale, "sum": value.item()}


def pid_and_world(rank, world_size):
    return {"rank": rank, "world_size": world_size, "pid": os.getpid(), "initialized": dist.is_initialized()}


def under_torchrun_in_rank(rank, world_size):
    return dtlib.under_torchrun()


def without_torchrun_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TORCHELASTIC_RUN_ID", "DTLIB_SPAWN"):
        monkeypatch.delenv(name, raising=False)




@pytest.mark.timeout(30)
def test_run_outside_torchrun_equals_spawn(monkeypatch):
    """Outside torchrun, dtlib.run(fn, ...) starts the ranks like dtlib.spawn and returns the same results."""
    without_torchrun_variables(monkeypatch)
    expected = [
        {"rank": 0, "world_size": 2, "value": 15, "sum": 11.0},
        {"rank": 1, "world_size": 2, "value": 18, "sum": 11.0},
    ]
    assert dtlib.spawn(rank_summary, 2, (5,), {"scale": 3}) == expected
    assert dtlib.run(rank_summary, 2, (5,), {"scale": 3}) == expected


@pytest.mark.timeout(30)
def test_run_passes_spawn_options_on(monkeypatch, capsys):
    """Outside torchrun, keyword options of dtlib.run reach dtlib.spawn (here output='none')."""
    without_torchrun_variables(monkeypatch)
    results = dtlib.run(lambda rank, world_size: print("hello") or rank, world_size=2, output="none")
    assert results == [0, 1]
    assert capsys.readouterr() == ("", "")


@pytest.mark.timeout(60)
def test_run_under_torchrun_runs_fn_in_this_process(monkeypatch):
    """Under torchrun, dtlib.run runs fn here, with torchrun's WORLD_SIZE, and cleans up its process group."""
    variables = {"TORCHELASTIC_RUN_ID": "test", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                 "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("DTLIB_SPAWN", raising=False)
    assert not dist.is_initialized()
    results = dtlib.run(pid_and_world, world_size=4)
    assert results == [{"rank": 0, "world_size": 1, "pid": os.getpid(), "initialized": True}]
    assert not dist.is_initialized()


def destroy_the_group(rank, world_size):
    dist.destroy_process_group()
    return rank


def torchrun_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    variables = {"TORCHELASTIC_RUN_ID": "test", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                 "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("DTLIB_SPAWN", raising=False)


@pytest.mark.timeout(60)
def test_run_under_torchrun_says_when_fn_destroyed_the_group(monkeypatch):
    """Under torchrun, fn that destroys the process group gets a RuntimeError saying so, not a gather failure."""
    torchrun_variables(monkeypatch)
    with pytest.raises(RuntimeError, match="fn destroyed the process group"):
        dtlib.run(destroy_the_group, world_size=1)
    assert not dist.is_initialized()


def test_run_under_torchrun_names_bad_args(monkeypatch):
    """Under torchrun too, args=5 is a TypeError naming args, before any process group exists."""
    torchrun_variables(monkeypatch)
    with pytest.raises(TypeError, match="^args must be a tuple or list"):
        dtlib.run(pid_and_world, world_size=1, args=5)
    assert not dist.is_initialized()


@pytest.mark.timeout(120)
def test_hello_under_torchrun(tmp_path):
    """torchrun --standalone --nproc_per_node=2 -m dtlib.examples.hello prints both ranks' all-reduced sum (its
    logs in the test's folder: left to itself, torchrun leaves a torchelastic_* folder in /tmp)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               f"--log-dir={tmp_path}", "-m", "dtlib.examples.hello"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "rank 0 of 2: sum of ranks = 1" in lines
    assert "rank 1 of 2: sum of ranks = 1" in lines


@pytest.mark.timeout(120)
def test_hello_as_a_script_with_three_ranks():
    """python -m dtlib.examples.hello --world-size 3 starts three ranks and prints each one's sum 0+1+2."""
    command = [sys.executable, "-m", "dtlib.examples.hello", "--world-size", "3"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"rank {rank} of 3: sum of ranks = 3" for rank in range(3)]


def test_under_torchrun_false_normally(monkeypatch):
    """Without torchrun's variables, under_torchrun() is False."""
    without_torchrun_variables(monkeypatch)
    assert dtlib.under_torchrun() is False


def test_under_torchrun_true_with_torchrun_variables(monkeypatch):
    """With TORCHELASTIC_RUN_ID set (and no DTLIB_SPAWN), under_torchrun() is True."""
    without_torchrun_variables(monkeypatch)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    assert dtlib.under_torchrun() is True


@pytest.mark.timeout(30)
def test_ranks_of_spawn_are_not_under_torchrun_even_if_parent_is(monkeypatch):
    """Ranks started by dtlib.spawn never count as torchrun ranks, even when the parent's env says torchrun."""
    without_torchrun_variables(monkeypatch)
    assert dtlib.spawn(under_torchrun_in_rank, world_size=2) == [False, False]
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "outer-job")
    assert dtlib.spawn(under_torchrun_in_rank, world_size=2) == [False, False]


def _devices_of_ddp(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel

    from dtlib.launch.device import device_ids

    device = dtlib.rank_device()
    model = DistributedDataParallel(torch.nn.Linear(2, 2).to(device), device_ids=device_ids(device))
    return str(device), model.device_ids


@pytest.mark.timeout(60)
def test_device_ids_is_what_ddp_accepts_on_the_ranks_device(monkeypatch):
    """Oracle: torch's DDP takes it (a list on a GPU, None on the CPU) and keeps the device it names."""
    from dtlib.launch.device import device_ids

    assert device_ids(torch.device("cpu")) is None
    assert device_ids(torch.device("cuda", 1)) == [1]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert device_ids(torch.device("cuda")) == [3]
    for device, ids in dtlib.spawn(_devices_of_ddp, 2, timeout=45):
        assert ids == (None if device == "cpu" else [int(device.split(":")[1])])


def tensors_and_a_dtensor(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    weight = torch.ones(2, requires_grad=True)
    mesh = init_device_mesh("cpu", (world_size,))
    return {"loss": (weight * 3).sum(), "sharded": distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])}


@pytest.mark.timeout(60)
def test_run_under_torchrun_returns_values_as_spawn_does(monkeypatch):
    """Under torchrun, every rank's value is gathered as dtlib.spawn's results travel: a tensor detached (and on
    the CPU; a CUDA one would otherwise unpickle on the sender's GPU in every rank), a DTensor as its shard."""
    from dtlib.launch.shards import LocalShard

    torchrun_variables(monkeypatch)
    [value] = dtlib.run(tensors_and_a_dtensor, world_size=1)
    assert value["loss"].item() == 6.0 and value["loss"].grad_fn is None and value["loss"].device.type == "cpu"
    assert isinstance(value["sharded"], LocalShard)
    [spawned] = dtlib.spawn(tensors_and_a_dtensor, 1, output="none")
    assert type(spawned["sharded"]) is type(value["sharded"]) and spawned["loss"].grad_fn is None
