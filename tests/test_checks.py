"""dtlib.checks: each checker accepts the right answer and says precisely what is wrong."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from dtlib import checks
from dtlib.launch import resolve_backend


def test_feedback_shows_a_mark_and_is_truthy_only_when_ok():
    assert repr(checks.Feedback(True, "fine")) == "✓ fine"
    assert repr(checks.Feedback(False, "nope")) == "✗ nope"
    assert checks.Feedback(True, "") and not checks.Feedback(False, "")


def test_backend_choice_accepts_what_auto_picks():
    expected = resolve_backend("auto", 2)
    assert checks.backend_choice(expected, world_size=2).ok
    assert checks.backend_choice(expected.upper(), world_size=2).ok


@pytest.mark.parametrize(
    ("answer", "fragment"),
    [(None, "No answer yet"), (42, "not a backend name"), ("tcp", "not a backend name"), ("mpi", "never picks MPI")],
)
def test_backend_choice_explains_bad_answers(answer, fragment):
    feedback = checks.backend_choice(answer, world_size=2)
    assert not feedback.ok
    assert fragment in feedback.message


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="needs a machine with fewer than 2 GPUs")
def test_backend_choice_says_why_nccl_is_wrong_without_gpus():
    feedback = checks.backend_choice("nccl", world_size=2)
    assert not feedback.ok and "one CUDA GPU per rank" in feedback.message


def _correct(rank, world_size):
    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    return value


def _double_counted(rank, world_size):
    value = torch.tensor([float(world_size * (world_size - 1) // 2)])
    dist.all_reduce(value)
    return value


def _hangs(rank, world_size):
    if rank == 0:
        dist.barrier()
    return 0


def _raises(rank, world_size):
    raise KeyError("missing")


def _sum_by_arithmetic(rank, world_size):
    return torch.tensor([float(world_size * (world_size - 1) // 2)])  # right number, no collective


def _sum_hard_coded_after_all_reduce(rank, world_size):
    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    return torch.tensor([3.0])  # the answer for 3 ranks only


def _every_call(rank, world_size):
    from dtlib import collectives

    value = torch.ones(2)
    dist.all_reduce(value)
    dist.all_reduce(value)
    dist.broadcast(value, src=0)
    dist.all_gather([torch.empty(2) for _ in range(world_size)], value)
    collectives.ring_shift(value, torch.empty(2), rank, world_size)
    dist.barrier()
    return rank


@pytest.mark.timeout(60)
def test_sum_of_ranks_accepts_a_correct_function():
    feedback = checks.sum_of_ranks(_correct, world_size=3)
    assert feedback.ok, feedback.message


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("fn", "fragment"),
    [
        (lambda rank, world_size: torch.tensor([float(rank)]), "each rank returned its own rank"),
        (lambda rank, world_size: None, "returned None"),
        (_double_counted, "world_size times too big"),
        (lambda rank, world_size: "three", "it returned 'three'"),
        (_raises, "raised KeyError"),
        ("not a function", "Pass your function itself"),
        (lambda rank, world_size: torch.tensor([3.0]), "no collective was called"),
        (_sum_by_arithmetic, "no collective was called"),
        (_sum_by_arithmetic, "use dist.all_reduce"),
        (_sum_hard_coded_after_all_reduce, "With 4 ranks, rank 0 should return 6"),
        (_sum_hard_coded_after_all_reduce, "the answer for 3 ranks"),
    ],
)
def test_sum_of_ranks_says_what_is_wrong(fn, fragment):
    feedback = checks.sum_of_ranks(fn, world_size=3)
    assert not feedback.ok
    assert fragment in feedback.message, feedback.message


@pytest.mark.timeout(60)
def test_the_counter_sees_each_collective_send_recv_and_barrier_a_rank_makes():
    values, calls = checks.spawn_counting(_every_call, 2)
    assert values == [0, 1]
    expected = {"all_reduce": 2, "broadcast": 1, "all_gather": 1, "send": 1, "recv": 1, "barrier": 1}
    assert calls == [expected, expected]
    values, calls = checks.spawn_counting(_sum_by_arithmetic, 2)
    assert calls == [{}, {}] and checks.rank_without_communication(calls) == 0


def test_a_barrier_alone_moves_no_data():
    assert checks.rank_without_communication([{"all_reduce": 1}, {"barrier": 1}]) == 1
    assert checks.rank_without_communication([{"all_reduce": 1}, {"send": 2, "recv": 2}]) is None


@pytest.mark.timeout(60)
def test_sum_of_ranks_reports_a_hang_instead_of_hanging():
    feedback = checks.sum_of_ranks(_hangs, world_size=2, timeout=3)
    assert not feedback.ok and "hung" in feedback.message and "barrier" in feedback.message


# -- notebook 03: one phase of the ring -------------------------------------------------------


def _gather_by_adding(chunks, rank, world_size):
    import torch

    from dtlib import collectives

    for step in range(world_size - 1):
        send, receive = (rank - step) % world_size, (rank - 1 - step) % world_size
        incoming = torch.empty_like(chunks[receive])
        collectives.ring_shift(chunks[send], incoming, rank, world_size)
        chunks[receive] += incoming  # wrong: the all-gather phase copies


def _gather_nothing(chunks, rank, world_size):
    pass


def _gather_wrong_chunks(chunks, rank, world_size):
    import torch

    from dtlib import collectives

    for step in range(world_size - 1):
        send, receive = (rank + step) % world_size, (rank - 1 - step) % world_size  # wrong: sends rank + step
        incoming = torch.empty_like(chunks[receive])
        collectives.ring_shift(chunks[send], incoming, rank, world_size)
        chunks[receive].copy_(incoming)


def _gather_the_notebook_stub(chunks, rank, world_size):
    import torch

    from dtlib import collectives

    for _ in range(world_size - 1):
        send = receive = rank  # notebook 03's starting point
        incoming = torch.empty_like(chunks[receive])
        collectives.ring_shift(chunks[send], incoming, rank, world_size)
        chunks[receive].copy_(incoming)


def _gather_without_copy(chunks, rank, world_size):
    import torch

    from dtlib import collectives

    for step in range(world_size - 1):  # notebook 03's solution without chunks[receive].copy_(incoming)
        send, receive = (rank - step) % world_size, (rank - 1 - step) % world_size
        incoming = torch.empty_like(chunks[receive])
        collectives.ring_shift(chunks[send], incoming, rank, world_size)


def _gather_by_assignment(chunks, rank, world_size):
    import torch

    from dtlib import collectives

    for step in range(world_size - 1):
        send, receive = (rank - step) % world_size, (rank - 1 - step) % world_size
        incoming = torch.empty_like(chunks[receive])
        collectives.ring_shift(chunks[send], incoming, rank, world_size)
        chunks[receive] = incoming  # wrong: replaces the list entry, the buffer never sees it


def _scatter_without_add(chunks, rank, world_size):
    import torch

    from dtlib import collectives

    for step in range(world_size - 1):  # dtlib's reduce-scatter without chunks[receive] += incoming
        send, receive = (rank - 1 - step) % world_size, (rank - 2 - step) % world_size
        incoming = torch.empty_like(chunks[receive])
        collectives.ring_shift(chunks[send], incoming, rank, world_size)


def _rank_0_skips_the_ring(chunks, rank, world_size):
    from dtlib import collectives

    if rank != 0:
        collectives.ring_all_gather_phase(chunks, rank, world_size)


@pytest.mark.timeout(60)
def test_ring_phase_accepts_dtlibs_own_phases():
    from dtlib import collectives

    assert checks.ring_phase(collectives.ring_all_gather_phase)
    assert checks.ring_phase(collectives.ring_reduce_scatter_phase, which="reduce_scatter")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("phase", "says"),
    [
        (_gather_by_adding, "added twice"),
        (_gather_nothing, "never reached it"),
        (_gather_nothing, "never called ring_shift"),
        (_gather_without_copy, "what arrived never landed in chunks: copy it in with copy_"),
        (_gather_by_assignment, "never landed in the buffer"),
        (_gather_by_assignment, "chunks[receive].copy_(incoming)"),
        (_gather_wrong_chunks, "differ in size"),
        (_gather_the_notebook_stub, "differ in size"),
        (_rank_0_skips_the_ring, "The ring hung"),
    ],
)
def test_ring_phase_says_what_is_wrong(phase, says):
    feedback = checks.ring_phase(phase, timeout=5)
    assert not feedback.ok
    assert says in feedback.message, feedback.message


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("phase", "says"),
    [
        (_scatter_without_add, "was never added to chunks"),
        (_scatter_without_add, "chunks[receive] += incoming"),
        (_gather_nothing, "never called ring_shift"),
    ],
)
def test_ring_phase_says_what_is_wrong_with_a_reduce_scatter(phase, says):
    feedback = checks.ring_phase(phase, which="reduce_scatter", timeout=5)
    assert not feedback.ok
    assert says in feedback.message, feedback.message
    assert "Check which chunk" not in feedback.message


@pytest.mark.timeout(60)
def test_ring_phase_points_at_the_missing_copy_not_at_the_chunk_indices():
    feedback = checks.ring_phase(_gather_without_copy, timeout=5)
    assert not feedback.ok and "Check which chunk" not in feedback.message, feedback.message


def test_ring_phase_refuses_bad_arguments():
    assert "which must be" in checks.ring_phase(_gather_nothing, which="broadcast").message
    assert "function itself" in checks.ring_phase("my_phase").message


# -- notebook 02: an average without ReduceOp.AVG ------------------------------------------------


def _average_right(rank, world_size):
    import torch.distributed as dist

    from dtlib.collectives import starting_values

    values = starting_values(rank, world_size)
    dist.all_reduce(values)
    return values / world_size


def _average_forgot_to_divide(rank, world_size):
    import torch.distributed as dist

    from dtlib.collectives import starting_values

    values = starting_values(rank, world_size)
    dist.all_reduce(values)
    return values


def _average_with_avg(rank, world_size):
    import torch.distributed as dist

    from dtlib.collectives import starting_values

    values = starting_values(rank, world_size)
    dist.all_reduce(values, op=dist.ReduceOp.AVG)
    return values


def _average_forgot_the_all_reduce(rank, world_size):
    from dtlib.collectives import starting_values

    return starting_values(rank, world_size)


def _average_by_four(rank, world_size):
    import torch.distributed as dist

    from dtlib.collectives import starting_values

    values = starting_values(rank, world_size)
    dist.all_reduce(values)
    return values / 4  # wrong: the world size of the notebook, hard-coded


def _average_without_a_collective(rank, world_size):
    import torch

    from dtlib.collectives import starting_values

    return torch.stack([starting_values(r, world_size) for r in range(world_size)]).mean(0)


def _average_as(kind):
    def average(rank, world_size):
        import torch.distributed as dist

        from dtlib.collectives import starting_values

        values = starting_values(rank, world_size)
        dist.all_reduce(values)
        mean = values / world_size
        return {"list": mean.tolist(), "tuple": tuple(mean.tolist()), "numpy": mean.numpy()}[kind]

    return average


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("fn", "ok", "says"),
    [
        (_average_right, True, "holds the mean"),
        (_average_forgot_to_divide, False, "divide by world_size"),
        (_average_forgot_the_all_reduce, False, "still holds its own values"),
        (lambda rank, world_size: None, False, "return the averaged tensor"),
        (_average_as("list"), True, "holds the mean"),
        (_average_as("tuple"), True, "holds the mean"),
        (_average_as("numpy"), True, "holds the mean"),
        (_average_by_four, False, "With 5 ranks, rank 0 holds the sum divided by 4"),
        (_average_by_four, False, "not by a fixed number"),
        (_average_without_a_collective, False, "no collective was called"),
        (_average_without_a_collective, False, "Use dist.all_reduce"),
    ],
)
def test_average_of_ranks_says_what_is_wrong(fn, ok, says):
    feedback = checks.average_of_ranks(fn)
    assert feedback.ok is ok and says in feedback.message, feedback.message


@pytest.mark.timeout(60)
def test_average_with_reduce_op_avg_is_right_where_gloo_has_it_and_explained_where_not():
    feedback = checks.average_of_ranks(_average_with_avg)
    assert feedback.ok or "no ReduceOp.AVG" in feedback.message, feedback.message


# -- notebook 04: the gradient-averaging hook ------------------------------------------------------


def _hook_right(grad):
    grad = grad / dist.get_world_size()  # divide first, as DDP does: the sum of halves cannot overflow
    dist.all_reduce(grad)
    return grad


def _hook_sum_then_divide(grad):
    dist.all_reduce(grad)
    return grad / dist.get_world_size()  # right in fp32; in fp16 the sum overflows first


def _hook_by_two(grad):
    dist.all_reduce(grad)
    return grad / 2  # right on 2 ranks only


def _hook_sum(grad):
    dist.all_reduce(grad)
    return grad


def _hook_reduces_a_copy(grad):
    copy = grad.clone()
    dist.all_reduce(copy)
    return grad  # the sum landed in the copy


def test_the_hooks_oracle_is_the_mean_of_the_ranks_gradients():
    """One process on every rank's samples: its gradient is the mean of the ranks' gradients (the loss is a mean)."""
    from dtlib import data, models

    world_size, per_rank = 3, checks.SAMPLES_PER_RANK
    x, y = data.regression(per_rank * world_size, seed=1).tensors
    grads = []
    for rank in range(world_size):
        model = models.build("mlp", seed=0)
        part = slice(rank * per_rank, (rank + 1) * per_rank)
        models.loss_fn("mlp", model(x[part]), y[part]).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert torch.allclose(checks._one_process_gradient(world_size), torch.stack(grads).mean(0), atol=1e-6)


@pytest.mark.timeout(120)
def test_gradient_hook_accepts_all_reduce_then_divide_by_the_world_size():
    feedback = checks.gradient_hook(_hook_right)
    assert feedback.ok and "one process" in feedback.message, feedback.message


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("hook", "fragments"),
    [
        (_hook_by_two, ["With 3 ranks", "divided by 2", "divide by dist.get_world_size(), not a constant"]),
        (lambda grad: grad, ["kept its own gradients", "called no collective"]),
        (_hook_sum, ["holds the sum over ranks"]),
        (_hook_sum_then_divide, ["in fp16 two gradients of 40000", "divides each gradient by the world size first"]),
        (_hook_reduces_a_copy, ["kept its own gradients although your hook called all_reduce"]),
        ("average_gradient", ["Pass your hook function itself"]),
    ],
)
def test_gradient_hook_says_what_is_wrong(hook, fragments):
    feedback = checks.gradient_hook(hook)
    assert not feedback.ok
    for fragment in fragments:
        assert fragment in feedback.message, feedback.message


# -- notebook 05: bytes of model state under FULL_SHARD ---------------------------------------------

FULL_SHARD_BYTES = 16 * 28_064 / 4  # 112,256: 16 bytes per fp32 parameter with Adam, sharded over 4 ranks


def test_fsdp_memory_accepts_the_bytes():
    assert checks.fsdp_memory(FULL_SHARD_BYTES).ok
    assert checks.fsdp_memory(int(FULL_SHARD_BYTES)).ok


@pytest.mark.parametrize(
    ("answer", "fragments"),
    [
        (FULL_SHARD_BYTES / 1e6, ["0.112256 looks like the answer in MB", "112,256 bytes", "in bytes"]),
        (FULL_SHARD_BYTES / 2**20, ["the answer in MiB", "112,256 bytes"]),
        (FULL_SHARD_BYTES / 1e3, ["the answer in KB", "112,256 bytes"]),
        (FULL_SHARD_BYTES / 2**10, ["the answer in KiB", "112,256 bytes"]),
        (FULL_SHARD_BYTES / 1e9, ["the answer in GB", "112,256 bytes"]),
        (FULL_SHARD_BYTES / 2**30, ["the answer in GiB", "112,256 bytes"]),
        (16 * 28_064 / 1e3, ["looks like KB", "449,024 bytes", "as DDP does"]),
        (16 * 28_064, ["449,024 bytes: that is every rank holding everything"]),
        (0.2, ["0.2 bytes is off by a factor of 1.78e-06"]),
        (None, ["No answer yet"]),
        ("112256", ["not str"]),
    ],
)
def test_fsdp_memory_says_what_is_wrong(answer, fragments):
    feedback = checks.fsdp_memory(answer)
    assert not feedback.ok
    for fragment in fragments:
        assert fragment in feedback.message, feedback.message
    assert not re.search(r"(^|\s)0 bytes|factor of 0\.00", feedback.message)  # no small number shown as 0


def _wrap_blocks_then_root(model):
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def _wrap_root_only(model):
    from torch.distributed.fsdp import fully_shard

    fully_shard(model)
    return model


def _wrap_blocks_only(model):
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    return model


def _wrap_root_first(model):
    from torch.distributed.fsdp import fully_shard

    fully_shard(model)
    for block in model.blocks:
        fully_shard(block)
    return model


def _wrap_one_block(model):
    from torch.distributed.fsdp import fully_shard

    fully_shard(model.blocks[0])
    fully_shard(model)
    return model


def _wrap_in_ddp(model):
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


@pytest.mark.timeout(120)
def test_fsdp_wrap_accepts_blocks_then_root_and_reports_the_measured_bytes():
    feedback = checks.fsdp_wrap(_wrap_blocks_then_root)
    assert feedback.ok, feedback.message
    assert "224,632 bytes of model state" in feedback.message and "(16P/N = 224,512)" in feedback.message


@pytest.mark.timeout(300)
@pytest.mark.parametrize("wrap, says", [
    (lambda model: model, "Nothing was sharded"),
    (_wrap_root_only, "Only the root is a unit: forward gathers 112,256 bytes"),
    (_wrap_one_block, "Only some blocks are units"),
    (_wrap_blocks_only, "the root is not"),
    (_wrap_root_first, "fully_shard(model) came before the blocks"),
    (_wrap_in_ddp, "Return the model you were given"),
    ("fully_shard", "Pass your function itself"),
])
def test_fsdp_wrap_refuses_wrong_wraps_and_names_the_mistake(wrap, says):
    feedback = checks.fsdp_wrap(wrap)
    assert not feedback.ok
    assert says in feedback.message, feedback.message
