"""dtlib.launch.device: where a rank computes, and NCCL's opt-in for several ranks on one GPU (NCCL 2.30+).

No GPU here: the machine (its GPU count, its NCCL) is stood in by monkeypatching torch's own answers, and the
oracle is NCCL's documented rule (a GPU per rank, unless NCCL_MULTI_RANK_GPU_ENABLE=1 on NCCL 2.30 or later).
What a GPU run must confirm: that NCCL 2.30's ranks on one GPU all-reduce (docs/gpu_status.md).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dtlib.launch import device
from dtlib.launch.spawn import resolve_backend


@pytest.mark.parametrize(("local_rank", "gpus", "gpu"), [(0, 1, 0), (1, 1, 0), (3, 2, 1), (1, 4, 1), (0, 0, 0),
                                                         (7, 8, 7)])
def test_ranks_get_their_own_gpu_and_share_them_in_turn_only_when_there_are_fewer(local_rank, gpus, gpu):
    assert device.gpu_of(local_rank, gpus) == gpu


@pytest.mark.parametrize(("reported", "version"), [((2, 30, 1), (2, 30, 1)), ((2, 28, 9, "a"), (2, 28, 9)),
                                                   (22809, (2, 28, 9))])
def test_the_nccl_version_is_read_as_a_tuple_whatever_torch_returns(monkeypatch, reported, version):
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: reported)
    assert device.nccl_version() == version


def test_a_cpu_build_has_no_nccl_version(monkeypatch):
    def missing() -> None:
        raise AttributeError("module 'torch._C' has no attribute '_nccl_version'")
    monkeypatch.setattr(torch.cuda.nccl, "version", missing)
    assert device.nccl_version() is None


def _one_gpu_machine(monkeypatch, nccl: tuple[int, int, int], opted_in: bool) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: nccl)
    monkeypatch.delenv("DTLIB_BACKEND", raising=False)
    if opted_in:
        monkeypatch.setenv(device.MULTI_RANK_GPU, "1")
    else:
        monkeypatch.delenv(device.MULTI_RANK_GPU, raising=False)


def test_two_nccl_ranks_on_one_gpu_run_when_opted_in_on_nccl_2_30(monkeypatch):
    _one_gpu_machine(monkeypatch, (2, 30, 0), opted_in=True)
    assert resolve_backend("nccl", 2) == "nccl"
    assert resolve_backend("auto", 2) == "gloo"  # auto never shares: it takes NCCL with a GPU per rank only


@pytest.mark.parametrize(("nccl", "opted_in", "said"), [
    ((2, 30, 0), False, "if you set os.environ['NCCL_MULTI_RANK_GPU_ENABLE'] = '1' before starting them "
                        "(experimental)."),
    ((2, 28, 9), False, "(experimental); this torch has NCCL 2.28.9."),
    ((2, 28, 9), True, "NCCL_MULTI_RANK_GPU_ENABLE=1 asks NCCL to share a GPU among ranks, which needs NCCL 2.30 "
                       "or later; this torch has NCCL 2.28.9."),
])
def test_otherwise_more_nccl_ranks_than_gpus_are_refused_with_the_way_to_share(monkeypatch, nccl, opted_in, said):
    _one_gpu_machine(monkeypatch, nccl, opted_in)
    with pytest.raises(ValueError, match="needs one CUDA GPU per rank: world_size=2, but this machine has 1") as err:
        resolve_backend("nccl", 2)
    assert str(err.value).endswith(said), str(err.value)
    assert resolve_backend("nccl", 1) == "nccl"  # a GPU per rank needs no opt-in


def test_without_a_gpu_nccl_is_refused_without_talk_of_sharing(monkeypatch):
    _one_gpu_machine(monkeypatch, (2, 30, 0), opted_in=True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError) as err:
        resolve_backend("nccl", 2)
    assert "share" not in str(err.value) and str(err.value).endswith("Use backend='gloo' (CPU) or backend='auto'.")
