"""dtlib.launch.host_tensors: NCCL's device rule on a machine without a GPU. A tensor a GPU machine would hold in
host memory (made without ``device=``, brought back with ``.cpu()``, or computed from such tensors alone) is
refused by a collective or a transfer under strict mode, as NCCL refuses it; what lives on the rank's device
passes. The oracle is NCCL's rule itself: only tensors on the rank's GPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dtlib
from dtlib.launch import host_tensors

pytestmark = pytest.mark.timeout(120)

#: How the tensor sent is made: a GPU machine holds the first four in host memory, the rest on the rank's GPU.
ON_THE_HOST = {
    "torch.tensor without device=": lambda x, rank: torch.tensor([float(rank)] * 3),
    ".cpu()": lambda x, rank: x.cpu(),
    "torch.zeros without device=": lambda x, rank: torch.zeros(3) + 1,  # computed from it: still on the host
    '.to("cpu")': lambda x, rank: (x * 2).to("cpu"),
}
ON_THE_DEVICE = {
    "zeros_like": lambda x, rank: torch.zeros_like(x),
    "device=": lambda x, rank: torch.zeros(3, device=dtlib.rank_device()),
    "moved with .to(device)": lambda x, rank: torch.zeros(3).to(dtlib.rank_device()),
    "new_tensor": lambda x, rank: x.new_tensor([1.0, 2.0, 3.0]),
    "computed from the input": lambda x, rank: x * 2 + 1,
    "a dtype change": lambda x, rank: x.to(torch.float64),
}


def _send_one_made(rank, world_size, how, kind):
    made = {**ON_THE_HOST, **ON_THE_DEVICE}[how]
    x = torch.ones(3, device=dtlib.rank_device())  # the rank's input, made outside: on its device
    with host_tensors.watching():
        t = made(x, rank)
        try:
            if kind == "all_reduce":
                dist.all_reduce(t)
            elif kind == "send":
                (dist.send(t, 1) if rank == 0 else dist.recv(t, 0))
            else:
                ops = [dist.P2POp(dist.isend if rank == 0 else dist.irecv, t, 1 - rank)]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
        except ValueError as error:
            return str(error)
    return None


@pytest.mark.parametrize("how", list(ON_THE_HOST))
@pytest.mark.parametrize("kind", ["all_reduce", "send", "batch_isend_irecv"])
def test_a_tensor_a_gpu_machine_holds_on_the_host_is_refused_naming_what_made_it(how, kind):
    said = dtlib.spawn(_send_one_made, 2, args=(how, kind), strict=True)
    for words in said:
        assert words is not None and f"was made by {how}" in words, said
        assert "NCCL" in words and "device=dtlib.rank_device()" in words, words


@pytest.mark.parametrize("how", list(ON_THE_DEVICE))
def test_what_lives_on_the_ranks_device_passes(how):
    assert dtlib.spawn(_send_one_made, 2, args=(how, "all_reduce"), strict=True) == [None, None]


def _outside_the_watch(rank, world_size):
    """Without watching(), and with strict mode off, nothing is marked or refused: gloo's own behaviour."""
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    with host_tensors.watching():
        marked = host_tensors.made_on_the_host(torch.zeros(1))
    return t.item(), marked


def test_only_a_watched_block_marks_and_only_strict_mode_refuses():
    assert dtlib.spawn(_outside_the_watch, 2, strict=True) == [(1.0, "torch.zeros without device="),
                                                              (1.0, "torch.zeros without device=")]
    assert dtlib.spawn(_send_one_made, 2, args=("torch.tensor without device=", "all_reduce"),
                       strict=False) == [None, None]


def test_cpu_copies_as_a_gpu_would_so_the_ranks_tensor_keeps_its_place():
    x = torch.ones(2)
    with host_tensors.watching():
        copy = x.cpu()
    assert copy is not x and host_tensors.made_on_the_host(copy) == ".cpu()"
    assert host_tensors.made_on_the_host(x) is None
    copy += 1
    assert x.tolist() == [1.0, 1.0]  # on a GPU, .cpu() never aliases the rank's tensor


def _cpu_copy_all_reduced(rank, world_size, x):
    copy = x.cpu()  # on a GPU machine: a copy in host memory
    dist.all_reduce(copy)
    return copy


def _rebuilt_from_a_list(rank, world_size, x):
    total = torch.tensor(x.tolist())  # no device=
    dist.all_reduce(total)
    return total


def _on_the_device(rank, world_size, x):
    total = x.clone()
    dist.all_reduce(total)
    return total


@pytest.mark.parametrize("answer, made", [(_cpu_copy_all_reduced, ".cpu()"),
                                          (_rebuilt_from_a_list, "torch.tensor without device=")])
def test_a_checker_refuses_an_answer_only_gloo_accepts_and_says_why(answer, made):
    """01's issue: a CPU copy all-reduced passed every checker on gloo, and fails on NCCL."""
    feedback = dtlib.checks.sum_of_ranks(answer)
    assert not feedback.ok and f"was made by {made}" in feedback.message, feedback.message
    assert dtlib.checks.sum_of_ranks(_on_the_device).ok


def _moved_but_sent_unmoved(rank, world_size):
    with host_tensors.watching():
        t = torch.zeros(3)
        moved = t.to(dtlib.rank_device())  # a copy on the device, as a GPU makes it; t stays in host memory
        try:
            dist.all_reduce(t)
        except ValueError as error:
            return str(error), host_tensors.made_on_the_host(moved)
    return None, host_tensors.made_on_the_host(moved)


def test_to_device_copies_a_host_tensor_so_the_host_one_is_still_refused():
    """On a CPU machine ``t.to(cpu_device)`` returns ``t`` itself; on a GPU machine it returns a copy on the GPU,
    and ``t`` stays in host memory. Sending ``t`` rather than the copy is refused, as NCCL refuses it; the copy
    is the rank's."""
    for said, moved in dtlib.spawn(_moved_but_sent_unmoved, 2, strict=True):
        assert said is not None and "was made by torch.zeros without device=" in said, said
        assert moved is None
