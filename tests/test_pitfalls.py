"""dtlib.pitfalls: each broken version fails the way the notebook says, each fix matches a direct computation.

Rank functions defined here travel to the ranks by value (``register_pickle_by_value``), as a
notebook cell's functions do, so the ranks never import this module.
"""

from __future__ import annotations

import os
import sys
import time

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

import dtlib
from dtlib import models, pitfalls

cloudpickle.register_pickle_by_value(sys.modules[__name__])

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# -- 1. set_epoch -------------------------------------------------------------------------------


def test_sampler_epochs_repeat_without_set_epoch_and_match_distributed_sampler():
    result = pitfalls.sampler_epochs(12, world_size=2, epochs=3)
    assert result["identical_without_set_epoch"] and not result["identical_with_set_epoch"]
    for rank in range(2):  # oracle: torch's sampler driven by hand
        sampler = DistributedSampler(range(12), num_replicas=2, rank=rank, shuffle=True, seed=0)
        for epoch in range(3):
            assert result["forgotten"][epoch][rank] == list(sampler)  # epoch never set: always epoch 0
        for epoch in range(3):
            sampler.set_epoch(epoch)
            assert result["fixed"][epoch][rank] == list(sampler)
    assert result["forgotten"][0] == result["fixed"][0]


# -- 2. checkpoint on every rank ----------------------------------------------------------------


@pytest.mark.timeout(60)
def test_checkpoint_writes_once_with_rank_0_and_a_barrier(tmp_path):
    numel = 10_000
    start = time.perf_counter()
    result = pitfalls.checkpoint_writes(world_size=2, numel=numel)
    elapsed = time.perf_counter() - start  # oracle for the times: both saves happen inside the call
    path = tmp_path / "checkpoint.pt"  # the same name: torch.save records it inside the zip
    torch.save({"weight": torch.arange(numel, dtype=torch.float32), "step": torch.tensor(7)}, path)
    size = os.path.getsize(path)  # oracle: the same state saved here
    every, once = result["every_rank"], result["rank0_then_barrier"]
    assert every["writers"] == [0, 1] and every["bytes_written"] == 2 * size
    assert once["writers"] == [0] and once["writes"] == 1 and once["bytes_written"] == size
    assert once["loaded_equal"] == [True, True] and once["errors"] == ["", ""]
    assert 0 < every["save_s"] + once["save_s"] <= elapsed


# -- 4. materialising before FSDP -----------------------------------------------------------------


@pytest.mark.timeout(90)
def test_meta_init_holds_no_full_model_before_sharding():
    result = pitfalls.meta_init_bytes(world_size=2)
    params = list(models.build("transformer").parameters())
    full = 4 * sum(p.numel() for p in params)  # fp32
    shard = [4 * sum(p.chunk(2, dim=0)[rank].numel() for p in params) for rank in range(2)]  # fully_shard: dim 0
    for name in ("normal", "meta"):
        for rank, row in enumerate(result[name]):
            assert row["before_sharding"] == (full if name == "normal" else 0)
            assert row["after_sharding"] == shard[rank]
            assert row["weights_equal_reference"]
    assert [row["source_bytes"] for row in result["meta"]] == [full, 0]


# -- 5. find_unused_parameters ------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_unused_parameters_fail_without_the_flag_and_match_one_process_with_it():
    result = pitfalls.unused_parameters(world_size=2, steps=3)
    assert "find_unused_parameters" in result["error"]
    assert len(result["losses_with_flag"]) == 3
    assert result["max_difference_from_single"] < 1e-6


# -- 6. functions defined in a cell under plain spawn --------------------------------------------


@pytest.mark.timeout(60)
def test_lambda_fails_to_pickle_under_plain_spawn_and_runs_under_dtlib(leftovers):
    times_ten = lambda rank, world_size: rank * 10  # noqa: E731 - the point is a lambda
    result = pitfalls.plain_spawn(times_ten)
    assert not result["started"] and result["where"] == "parent"
    assert result["error_type"] in ("PicklingError", "AttributeError") and "lambda" in result["message"]
    leftovers.assert_clean()
    assert dtlib.spawn(times_ten, 2, output="none") == [0, 10]


@pytest.mark.timeout(60)
def test_nested_function_fails_to_pickle_under_plain_spawn(leftovers):
    def nested(rank, world_size):
        return rank

    result = pitfalls.plain_spawn(nested)
    assert result["where"] == "parent" and "nested" in result["message"]
    leftovers.assert_clean()


def _cell_function(rank, world_size):
    return rank


@pytest.mark.timeout(60)
def test_cell_function_dies_in_the_child_and_leaves_no_process(leftovers, monkeypatch):
    # A notebook cell's function: __main__.cell_fn exists here, not in the new process's __main__.
    monkeypatch.setattr(_cell_function, "__module__", "__main__")
    monkeypatch.setattr(_cell_function, "__qualname__", "cell_fn")
    monkeypatch.setattr(sys.modules["__main__"], "cell_fn", _cell_function, raising=False)
    result = pitfalls.plain_spawn(_cell_function, timeout=30)
    assert result["started"] and result["where"] == "child", result
    assert result["error_type"] == "ProcessExitedException"
    assert "AttributeError" in result["child_says"] and "cell_fn" in result["child_says"]
    leftovers.assert_clean()


def _sleep(rank, world_size):
    time.sleep(60)


@pytest.mark.timeout(60)
def test_plain_spawn_stops_what_it_started_after_its_timeout(leftovers):
    began = time.monotonic()
    result = pitfalls.plain_spawn(_sleep, timeout=1)
    assert result["started"] and result["where"] == "child"
    assert time.monotonic() - began < 55  # the rank sleeps 60 s: it was stopped, not waited for
    leftovers.assert_clean()


# -- 7. CUDA before fork ------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only path")
def test_fork_works_while_cuda_is_untouched():
    result = pitfalls.fork_after_cuda()
    assert result["refused"] == "" and result["fork_results"] == [0, 1]
    assert not result["cuda_available"] and not result["cuda_initialized"]
    assert "forkserver" in result["explanation"]


def test_fork_is_refused_once_cuda_is_initialised(monkeypatch):
    # Stands for a GPU machine: the refusal comes from dtlib.spawn before any process starts.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    result = pitfalls.fork_after_cuda()
    assert "start_method='fork' is unsafe" in result["refused"] and result["fork_results"] is None


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(60)
def test_fork_is_refused_after_real_cuda_init():
    result = pitfalls.fork_after_cuda()
    assert result["cuda_initialized"] and "unsafe" in result["refused"]


# -- 8. different shapes in one collective ------------------------------------------------------


@pytest.mark.timeout(60)
def test_shape_mismatch_fails_and_padding_gives_the_direct_sum():
    result = pitfalls.shape_mismatch(world_size=2, timeout=8)
    assert result["error_kind"] in ("WorkerError", "WorkerTimeout") and result["headlines"]
    rank_0 = torch.arange(4.0)  # what the docstring says each rank holds
    rank_1 = torch.arange(8.0) + 100
    expected = (torch.cat([rank_0, torch.zeros(4)]) + rank_1).tolist()
    assert result["expected"] == expected and result["fixed"] == [expected, expected] and result["fixed_correct"]


def _all_reduce_with_detail(rank: int, world_size: int, shapes: list[list[int]]) -> str:
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.set_debug_level_from_env()  # the ranks' torch was imported before the variable was set
    dist.init_process_group("gloo")
    try:
        dist.all_reduce(torch.ones(shapes[rank]))
        return "no error"
    except RuntimeError as err:
        return str(err)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shapes, differ", [([[4], [8]], ("4vs 8", "8vs 4")),  # torch's spacing, by rank
                                            ([[2, 4], [4, 2]], ("2 4vs 4 2", "4 2vs 2 4")), ([[3], [3]], None)])
def test_detail_names_mismatched_collectives_even_with_equal_element_counts(shapes, differ):
    """Notebook 08: under TORCH_DISTRIBUTED_DEBUG=DETAIL both ranks raise and name both shapes; equal shapes pass."""
    said = dtlib.spawn(_all_reduce_with_detail, 2, args=(shapes,), init_process_group=False, timeout=45,
                       output="none")
    if differ is None:
        assert said == ["no error", "no error"]
        return
    for rank, message in enumerate(said):
        lines = pitfalls.fingerprint_summary(message).splitlines()
        assert lines[0] == "Detected mismatch between collectives on ranks.", message
        mine, theirs = (shapes[rank], shapes[1 - rank])
        assert f"Rank {rank} is running collective" in lines[1] and f"TensorShape={mine}".replace(" ", "") in \
            lines[1].replace(" ", "")
        assert f"TensorShape={theirs}".replace(" ", "") in lines[2].replace(" ", "") and "TensorOptions" not in lines[2]
        assert lines[3] == f"Collectives differ in the following aspects: Tensor Tensor shapes: {differ[rank]}"


def test_fingerprint_summary_leaves_other_messages_readable():
    assert pitfalls.fingerprint_summary("  some other\n error ") == "some other error"


# -- 9. map_location ----------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_map_location_puts_each_rank_on_its_own_device():
    saved_on = "cuda:0" if torch.cuda.is_available() else "cpu"
    for rank, row in enumerate(pitfalls.map_location(world_size=2)):
        assert row["location_in_file"] == saved_on
        assert row["without_map_location"] == saved_on  # every rank lands where rank 0 saved from
        own = f"cuda:{rank % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
        assert row["this_rank_device"] == own and row["with_map_location"] == own


# -- the exercise's checker ---------------------------------------------------------------------


def _mean_loss_fixed(rank, world_size):
    loss = torch.tensor([float(rank + 1)])
    dist.all_reduce(loss)
    return (loss / world_size).item()


def _mean_loss_buggy(rank, world_size):
    loss = torch.tensor([float(rank + 1)])
    if rank == 0:
        dist.all_reduce(loss)
        loss /= world_size
    return loss.item()


def _sum_not_mean(rank, world_size):
    loss = torch.tensor([float(rank + 1)])
    dist.all_reduce(loss)
    return loss


def _raises(rank, world_size):
    raise KeyError("loss")


def _mean_by_two(rank, world_size):
    loss = torch.tensor([float(rank + 1)])
    dist.all_reduce(loss)
    return (loss / 2).item()  # right on 2 ranks only


def _every_rank_waits_to_receive(rank, world_size):
    loss = torch.tensor([float(rank + 1)])
    dist.recv(loss, src=(rank + 1) % world_size)  # nobody sends: every rank waits
    return loss.item()


@pytest.mark.timeout(60)
def test_checker_accepts_every_rank_calling_the_collective():
    feedback = pitfalls.check_fixed_barrier(_mean_loss_fixed)
    assert feedback.ok and "2 ranks (1.5)" in feedback.message and "3 (2)" in feedback.message, feedback.message


@pytest.mark.timeout(60)
def test_checker_reports_which_rank_hung_where():
    feedback = pitfalls.check_fixed_barrier(_mean_loss_buggy, timeout=3)
    assert not feedback.ok
    line = _mean_loss_buggy.__code__.co_firstlineno + 3  # the dist.all_reduce line
    assert f"rank 0 waited in all_reduce (line {line}, in _mean_loss_buggy)" in feedback.message, feedback.message
    assert "while rank 1 returned without calling it" in feedback.message, feedback.message


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("fn", "world_size", "fragment"),
    [
        (_mean_loss_buggy, 3, "while ranks 1 and 2 returned without calling it"),
        (_every_rank_waits_to_receive, 2, "rank 1 waited in recv"),
        (_every_rank_waits_to_receive, 2, "and no rank returned: each waited for a call that no other rank made"),
    ],
)
def test_checker_names_the_ranks_that_returned_whatever_their_number(fn, world_size, fragment):
    feedback = pitfalls.check_fixed_barrier(fn, world_size=world_size, timeout=3)
    assert not feedback.ok and fragment in feedback.message, feedback.message
    assert "rank(s)" not in feedback.message and "none" not in feedback.message


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("fn", "fragment"),
    [
        (lambda rank, world_size: rank + 1, "Rank 0 returned its own loss 1"),
        (_sum_not_mean, "returned the sum 3"),
        (lambda rank, world_size: 2.0, "returned 2, expected the mean 1.5"),
        (lambda rank, world_size: None, "returned None"),
        (_raises, "rank 0 raised KeyError"),
        ("mean_loss", "Pass your function itself"),
        (lambda rank, world_size: 1.5, "Rank 0 returned the mean 1.5, but no collective was called"),
        (lambda rank, world_size: (world_size + 1) / 2, "no collective was called"),
        (_mean_by_two, "With 3 ranks, rank 0 returned 3, the sum divided by 2"),
        (_mean_by_two, "not a constant"),
    ],
)
def test_checker_says_what_is_wrong(fn, fragment):
    feedback = pitfalls.check_fixed_barrier(fn)
    assert not feedback.ok and fragment in feedback.message, feedback.message
