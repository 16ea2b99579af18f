"""Notebook 02's collectives on CUDA tensors: NCCL with one GPU per rank, and gloo with several ranks on one GPU.

Each rank gets its own integer-valued input (exact in float32, so every sum is exact in any order); an oracle in
this process computes every rank's answer from all the inputs. The live ranks of 02's ``%%ranks`` cells run
on NCCL too.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dtlib
from dtlib import compat

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GPUS = torch.cuda.device_count()  # NVML: this process does not initialise CUDA
NCCL_WORLD = max(1, min(4, GPUS))  # a GPU per rank: NCCL before 2.30 refuses two ranks on one GPU
PER_RANK = 3  # elements each rank contributes to a flat gather, receives from a reduce-scatter
NCCL_OPS = ("all_reduce", "broadcast", "all_gather", "all_gather_single", "reduce_scatter_single",
            "all_to_all_single")
GLOO_CUDA_OPS = ("all_reduce", "broadcast", "all_gather")  # gloo's CUDA paths: copies through pinned host memory


def rank_input(rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s input: world_size x PER_RANK whole numbers (float32), different on every rank."""
    generator = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(-50, 50, (world_size * PER_RANK,), generator=generator).float()


def _collectives(rank: int, world_size: int, ops: tuple[str, ...]) -> dict[str, object]:
    """Each of ``ops`` on this rank's input, on a CUDA device: the rank's own GPU (NCCL), or a shared one (gloo)."""
    if dist.get_backend() == "nccl":
        device = dtlib.rank_device()  # cuda:LOCAL_RANK, set by the launcher
    else:
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    x = rank_input(rank, world_size).to(device)  # (world_size * PER_RANK,)
    out: dict[str, torch.Tensor] = {}
    if "all_reduce" in ops:
        out["all_reduce"] = x.clone()
        dist.all_reduce(out["all_reduce"], op=dist.ReduceOp.SUM)
    if "broadcast" in ops:
        out["broadcast"] = x.clone()
        dist.broadcast(out["broadcast"], src=world_size - 1)
    if "all_gather" in ops:
        pieces = [torch.empty_like(x) for _ in range(world_size)]
        dist.all_gather(pieces, x)
        out["all_gather"] = torch.cat(pieces)
    if "all_gather_single" in ops:
        out["all_gather_single"] = torch.empty(world_size * x.numel(), device=device)
        compat.all_gather_single(out["all_gather_single"], x)
    if "reduce_scatter_single" in ops:
        out["reduce_scatter_single"] = torch.empty(PER_RANK, device=device)
        compat.reduce_scatter_single(out["reduce_scatter_single"], x)
    if "all_to_all_single" in ops:
        out["all_to_all_single"] = torch.empty_like(x)
        dist.all_to_all_single(out["all_to_all_single"], x)
    torch.cuda.synchronize(device)
    devices = {name: tensor.device.type for name, tensor in out.items()}
    return {"backend": dist.get_backend(), "devices": devices, **{name: t.cpu() for name, t in out.items()}}


def oracle(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """What each collective must leave on ``rank``, computed in one process from every rank's input."""
    inputs = [rank_input(r, world_size) for r in range(world_size)]
    total = torch.stack(inputs).sum(0)
    return {"all_reduce": total, "broadcast": inputs[world_size - 1], "all_gather": torch.cat(inputs),
            "all_gather_single": torch.cat(inputs), "reduce_scatter_single": total.chunk(world_size)[rank],
            "all_to_all_single": torch.cat([inputs[source].chunk(world_size)[rank] for source in range(world_size)])}


def _assert_every_rank_matches(reports: list[dict[str, object]], ops: tuple[str, ...], backend: str) -> None:
    world_size = len(reports)
    for rank, report in enumerate(reports):
        assert report["backend"] == backend
        assert report["devices"] == dict.fromkeys(ops, "cuda"), f"rank {rank} ran on {report['devices']}"
        expected = oracle(rank, world_size)
        for op in ops:
            assert torch.equal(report[op], expected[op]), f"{op} on rank {rank} of {world_size} ({backend})"


@pytest.mark.timeout(120)
def test_nccl_collectives_match_the_oracle_with_a_gpu_per_rank():
    reports = dtlib.spawn(_collectives, NCCL_WORLD, args=(NCCL_OPS,), backend="nccl", output="none", timeout=90)
    _assert_every_rank_matches(reports, NCCL_OPS, "nccl")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_gloo_collectives_on_cuda_tensors_match_the_oracle_with_ranks_sharing_a_gpu(world_size):
    reports = dtlib.spawn(_collectives, world_size, args=(GLOO_CUDA_OPS,), backend="gloo", output="none",
                          timeout=90)
    _assert_every_rank_matches(reports, GLOO_CUDA_OPS, "gloo")


def test_auto_means_nccl_where_there_is_a_gpu_per_rank():
    """The GPU tests get the machine's own backend: tests/conftest.py lifts the CPU suite's DTLIB_BACKEND=gloo."""
    from dtlib.launch.spawn import resolve_backend

    assert resolve_backend("auto", NCCL_WORLD) == "nccl"
    assert resolve_backend("auto", GPUS + 1) == "gloo"


@pytest.mark.timeout(120)
def test_live_ranks_run_02s_cells_on_their_gpus():
    """The ``%%ranks`` path: each live rank's ``device`` is its GPU, and a cell's all-reduce runs there."""
    cell = ("x = torch.arange(world_size, dtype=torch.float32, device=device) + 10 * rank\n"
            "dist.all_reduce(x, op=dist.ReduceOp.SUM)\n"
            "(x.device.type, x.tolist())")
    with dtlib.LiveRanks(world_size=NCCL_WORLD, backend="nccl", timeout=60) as ranks:
        results = ranks.run(cell)
    expected = (torch.arange(NCCL_WORLD, dtype=torch.float32) * NCCL_WORLD + 10 * sum(range(NCCL_WORLD))).tolist()
    assert results == [("cuda", expected)] * NCCL_WORLD


@pytest.mark.timeout(180)
def test_stepping_sees_nccl_collectives_and_ddps_bucket_from_the_autograd_device_thread():
    """What only a GPU run can confirm of the stepper (docs/live.md): NCCL collectives on CUDA tensors pause like
    gloo's, and DDP's bucket all-reduce, which the autograd engine's device thread issues on CUDA, reaches the
    dispatch mode installed on the main thread."""
    with dtlib.LiveRanks(world_size=NCCL_WORLD, backend="nccl", timeout=60) as ranks:
        view = ranks.run("x = torch.ones(4, device=device)\ndist.all_reduce(x)\nx.sum().item()", step=True)
        assert set(view.states().values()) == {"paused before all_reduce #1 (SUM, float32[4])"}
        assert ranks.resume() == [4.0 * NCCL_WORLD] * NCCL_WORLD
        ranks.run("torch.manual_seed(0)\nddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 2).to(device))")
        trace = ranks.trace("ddp(torch.randn(3, 4, device=device)).sum().backward()")
        assert [call.op for call in trace.calls[0]] == ["all_reduce"], trace
