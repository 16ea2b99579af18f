"""dtlib.compat: the version-proof collectives match their definitions and never warn."""

from __future__ import annotations

import gc
import time
import warnings

import psutil
import pytest
import torch
import torch.distributed as dist

import dtlib
from dtlib import compat


def test_torch_version_parses_local_builds(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu126")
    assert compat.torch_version() == (2, 11)


def test_installed_torch_is_supported():
    assert compat.torch_version() >= compat.MIN_TORCH


def _collectives_without_warnings(rank, world_size):
    chunk = 3
    full = torch.arange(world_size * chunk, dtype=torch.float32) * (rank + 1)  # (world_size * chunk,)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a FutureWarning from a renamed API fails the test
        reduced = torch.empty(chunk)
        compat.reduce_scatter_single(reduced, full)
        gathered = torch.empty(world_size * chunk)
        compat.all_gather_single(gathered, torch.full((chunk,), float(rank)))
    return reduced, gathered


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
def test_reduce_scatter_and_all_gather_match_their_definitions(world_size):
    chunk = 3
    results = dtlib.spawn(_collectives_without_warnings, world_size)
    scale = sum(r + 1 for r in range(world_size))  # every rank contributed (rank + 1) * arange
    expected_full = torch.arange(world_size * chunk, dtype=torch.float32) * scale
    expected_gathered = torch.arange(world_size, dtype=torch.float32).repeat_interleave(chunk)
    for rank, (reduced, gathered) in enumerate(results):
        torch.testing.assert_close(reduced, expected_full[rank * chunk:(rank + 1) * chunk])
        torch.testing.assert_close(gathered, expected_gathered)


def _listeners(port: int) -> list[str]:
    return [c.laddr.ip for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port]


@pytest.mark.parametrize("version", [(2, 6), None], ids=["torch-2.6-store", "installed-store"])
def test_the_rendezvous_store_listens_on_loopback_only_and_frees_its_port(monkeypatch, version):
    if version is not None:  # before 2.8 the libuv store cannot take over a socket: the older one is used
        monkeypatch.setattr(compat, "torch_version", lambda: version)
    store = compat.store_on(compat.loopback_listener(2))  # what dtlib.spawn opens
    assert store.libuvBackend == (compat.torch_version() >= (2, 8))
    port = store.port
    client = dist.TCPStore("127.0.0.1", port, is_master=False)
    client.set("key", "value")
    assert store.get("key") == b"value"
    assert _listeners(port) == ["127.0.0.1"]
    del client, store
    gc.collect()
    deadline = time.monotonic() + 5
    while _listeners(port) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _listeners(port) == []


def _gather_and_destroy_in_a_loop(rank, world_size, folder, rounds):
    for i in range(rounds):
        store = dist.FileStore(f"{folder}/store_{i}", world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        gathered = [None] * world_size
        dist.all_gather_object(gathered, {"rank": rank, "round": i})  # leaves temporaries to gloo's workers
        compat.destroy_process_group()
    return rounds


@pytest.mark.timeout(120)
def test_destroy_process_group_never_deadlocks(tmp_path):
    """Torch 2.6 hung within 100 such rounds with plain destroy_process_group (see compat)."""
    rounds = 60
    assert dtlib.spawn(
        _gather_and_destroy_in_a_loop, 2, args=(str(tmp_path), rounds), init_process_group=False, timeout=100
    ) == [rounds, rounds]


@pytest.mark.parametrize(("version", "pauses"), [("2.6.0", True), ("2.7.1", True), ("2.8.0", False), ("2.13.0", False)])
def test_destroy_pauses_only_where_torch_needs_it(monkeypatch, version, pauses):
    calls = []
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(compat.time, "sleep", lambda s: calls.append(("sleep", s)))
    monkeypatch.setattr(compat.dist, "destroy_process_group", lambda group=None: calls.append(("destroy", group)))
    compat.destroy_process_group()
    assert calls == ([("sleep", 0.05)] if pauses else []) + [("destroy", None)]


def _gloo_has_avg(rank, world_size):
    return compat.gloo_has_avg()


@pytest.mark.timeout(60)
def test_gloo_avg_probe_matches_the_torch_version():
    # Measured: gloo refuses ReduceOp.AVG in torch 2.6 and 2.7.1 and accepts it in 2.13; between, unmeasured.
    import dtlib

    answers = dtlib.spawn(_gloo_has_avg, 2, output="none")
    assert answers[0] == answers[1] and isinstance(answers[0], bool)
    if compat.torch_version() <= (2, 7):
        assert answers == [False, False]
    if compat.torch_version() >= (2, 13):
        assert answers == [True, True]


def test_fsdp2_on_the_cpu_is_refused_where_torch_cannot_run_it(monkeypatch):
    from dtlib.train import fsdp

    monkeypatch.setattr(compat, "fsdp2_runs_on_cpu", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match="FSDP2 on the CPU needs torch >= 2.7"):
        fsdp.validate(fsdp.FSDPConfig(api="fsdp2"), 2)
    fsdp.validate(fsdp.FSDPConfig(api="fsdp1"), 2)  # FSDP1 runs on the CPU from 2.6


@pytest.mark.parametrize(("version", "refused"), [((2, 10), "older"), ((2, 11), None), ((2, 13), None),
                                                  ((2, 15), None), ((2, 16), "newer"), ((3, 0), "newer")])
def test_the_supported_range_is_2_11_to_2_15(version, refused):
    why = compat.supported(version)
    assert (why is None) == (refused is None), why
    if refused:
        assert refused in why and "2.11 to 2.15" in why


def test_set_up_refuses_a_torch_outside_the_range_with_the_same_words():
    """scripts/setup.sh reads compat.py as a file (dtlib is not installed yet): that must work alone."""
    import runpy
    from pathlib import Path

    namespace = runpy.run_path(str(Path(compat.__file__)))
    assert namespace["supported"]((2, 9)) == compat.supported((2, 9))


def test_old_spellings_are_counted_under_the_names_the_course_teaches():
    assert compat.current_name("all_gather_into_tensor") == "all_gather_single"
    assert compat.current_name("reduce_scatter_tensor") == "reduce_scatter_single"
    assert compat.current_name("all_reduce") == "all_reduce"
    # the functional collectives' functions, which the stepper names as the frame that issued a DTensor's gather
    assert compat.current_name("all_gather_tensor") == "all_gather_single"
    assert compat.current_name("reduce_scatter_tensor_autograd") == "reduce_scatter_single_autograd"
    from torch.distributed import _functional_collectives as functional
    assert all(hasattr(functional, name) for name in compat.RENAMED_FUNCTIONAL) == (compat.torch_version() >= (2, 13))


def test_install_gives_the_course_its_names_once():
    assert compat.install() == compat.install()  # idempotent
    for new in compat.RENAMED_COLLECTIVES:
        assert callable(getattr(dist, new))
    if compat.torch_version() >= (2, 13):
        assert compat.shims() == []  # nothing to add
    else:
        assert any("all_gather_single" in line for line in compat.shims())


def _forward_sync_buffers_on_a_ddp_without_it(rank, world_size):
    """DDP as torch < 2.13 has it (no forward_sync_buffers), then compat's keyword on top."""
    from torch.nn.parallel import DistributedDataParallel

    modern = DistributedDataParallel.__init__

    def legacy(self, module, broadcast_buffers=True, process_group=None, init_sync=True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # 2.13 deprecates broadcast_buffers
            modern(self, module, broadcast_buffers=broadcast_buffers, process_group=process_group, init_sync=init_sync)

    DistributedDataParallel.__init__ = legacy
    try:
        assert compat._give_ddp_forward_sync_buffers()
        torch.manual_seed(rank)  # different weights and running statistics on each rank
        norm = torch.nn.BatchNorm1d(3)
        norm.running_mean.fill_(float(rank + 1))
        model = DistributedDataParallel(norm, forward_sync_buffers=False)
        at_construction = model.module.running_mean.clone()  # synced from rank 0, as 2.13 does
        model(torch.randn(8, 3) + rank * 10)  # each rank's own statistics, never synced in forward
        return at_construction, model.module.running_mean.clone()
    finally:
        DistributedDataParallel.__init__ = modern


@pytest.mark.timeout(60)
def test_forward_sync_buffers_on_an_older_ddp_still_syncs_buffers_at_construction():
    (built0, after0), (built1, after1) = dtlib.spawn(_forward_sync_buffers_on_a_ddp_without_it, 2)
    torch.testing.assert_close(built1, built0)  # rank 1's buffers were overwritten by rank 0's
    torch.testing.assert_close(built0, torch.ones(3))
    assert not torch.allclose(after0, after1)  # forward_sync_buffers=False: not synced before forward


def _ddp_step_under_detail(rank, world_size, guarded):
    from torch._C._distributed_c10d import Logger
    from torch.nn.parallel import DistributedDataParallel

    if not guarded:  # torch's own method, as it was before dtlib guarded it
        Logger.set_construction_data_and_log = Logger.set_construction_data_and_log.__closure__[0].cell_contents
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    model(torch.full((3, 4), float(rank + 1))).sum().backward()
    return model.module.weight.grad.tolist()


@pytest.mark.timeout(60)
def test_ddp_under_detail_mode_on_gloo_trains_instead_of_crashing(monkeypatch):
    """torch's DETAIL mode (live ranks' collective check) wraps the group, and DDP's construction log then
    SIGSEGVs on gloo; with the log skipped, the gradients are the mean over ranks, as without DETAIL."""
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    grads = dtlib.spawn(_ddp_step_under_detail, 2, args=(True,), output="none")
    assert grads[0] == grads[1] == [[4.5] * 4] * 2  # d(sum)/dW: the mean over ranks of 3 rows of 1s and of 2s
    with pytest.raises(dtlib.WorkerError, match="SIGSEGV"):
        dtlib.spawn(_ddp_step_under_detail, 2, args=(False,), output="none")


def _dtensor_under_detail(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    try:
        return distribute_tensor(torch.arange(4.0), mesh, [Shard(0)]).full_tensor().tolist()
    except RuntimeError as err:
        return str(err)


@pytest.mark.timeout(60)
def test_the_collective_check_is_on_by_default_exactly_where_it_runs_a_dtensor(monkeypatch):
    """Live ranks turn DETAIL on by default only where this torch's check runs a DTensor's all-gather on gloo."""
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    seen = dtlib.spawn(_dtensor_under_detail, 2, output="none")[0]
    assert (seen == [0.0, 1.0, 2.0, 3.0]) == compat.collective_check_works(), seen
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG")  # unchecked live ranks keep the kernel's setting
    with dtlib.LiveRanks(2, backend="gloo") as live:
        assert live.check_collectives == compat.collective_check_works()
        assert (live.run("import os\nos.environ.get('TORCH_DISTRIBUTED_DEBUG')")[0] == "DETAIL") == \
            live.check_collectives
