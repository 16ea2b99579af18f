"""dtlib.checks.gradient_hook (notebook 04): a bank of wrong hooks, each of a distinct kind and each named in the
learner's terms, and right hooks written several ways.

The hook is a tensor hook (``param.register_hook``): torch's contract is "The hook should not modify its argument,
but it can optionally return a new gradient", so a hook that averages into the gradient it was given is refused
even where the numbers come out right. The checker runs under strict mode: an async collective's tensor reads NaN
until ``wait()``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp, all_reduce
from verdicts import assert_verdict

from dtlib import checks
from dtlib.checks import training

pytestmark = pytest.mark.timeout(180)


# -- right answers, written three ways ------------------------------------------------------------


def right_divide_first(grad):  # notebook 04's answer
    grad = grad / dist.get_world_size()  # divide first, as DDP does: the sum of halves cannot overflow
    dist.all_reduce(grad)
    return grad


def right_async_then_wait(grad):
    averaged = grad.div(dist.get_world_size())
    dist.all_reduce(averaged, async_op=True).wait()
    return averaged


def right_in_float64(grad):
    wide = grad.double()  # a sum in float64 neither overflows in fp16 nor rounds in fp32
    dist.all_reduce(wide)
    return (wide / dist.get_world_size()).to(grad.dtype)


def right_by_avg(grad):  # right: NCCL averages as it sums (gloo's sum-then-divide would overflow fp16)
    averaged = grad.clone()
    dist.all_reduce(averaged, op=dist.ReduceOp.AVG)
    return averaged


def right_by_avg_imported_by_name(grad):  # the same, with `from torch.distributed import all_reduce` in a cell
    averaged = grad.clone()
    all_reduce(averaged, op=ReduceOp.AVG)
    return averaged


def returns_float16(grad):  # communicates in float16, as a compressing hook may, but returns float16 too
    low = grad.half() / dist.get_world_size()
    dist.all_reduce(low)
    return low


# -- wrong answers, one kind each -------------------------------------------------------------------


def kept_own(grad):
    return grad


def summed(grad):
    grad = grad.clone()
    dist.all_reduce(grad)
    return grad


def by_two(grad):
    grad = grad / 2  # right on 2 ranks only
    dist.all_reduce(grad)
    return grad


def by_world_size_twice(grad):
    grad = grad / dist.get_world_size()
    dist.all_reduce(grad)
    return grad / dist.get_world_size()


def by_reduce(grad):
    grad = grad / dist.get_world_size()
    dist.reduce(grad, dst=0)
    return grad


def by_max(grad):
    grad = grad.clone()
    dist.all_reduce(grad, op=dist.ReduceOp.MAX)
    return grad


def reduces_a_copy(grad):
    dist.all_reduce(grad.clone())  # the sum lands in the copy, which is dropped
    return grad / dist.get_world_size()


def async_without_wait(grad):  # review: nothing said about wait()
    grad = grad / dist.get_world_size()
    dist.all_reduce(grad, async_op=True)
    return grad


def waits_too_late(grad):  # neighbour: the work is waited for, but after the tensor was read
    summed = grad.clone()
    work = dist.all_reduce(summed, async_op=True)
    averaged = summed / dist.get_world_size()
    work.wait()
    return averaged


def broadcast(grad):  # review: was told to "return that tensor"
    grad = grad.clone()
    dist.broadcast(grad, src=0)
    return grad


def gathered_and_took_rank_1(grad):  # neighbour: one rank's gradient handed to all, by another collective
    pieces = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, grad)
    return pieces[1] / dist.get_world_size()


def right_by_all_gather(grad):  # right, by another collective: every rank's gradient gathered, then averaged
    pieces = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, grad)
    return torch.stack(pieces).float().mean(0).to(grad.dtype)


def through_fp16(grad):  # review: was told to "return the averaged gradient", which it did, rounded
    half = grad.half() / dist.get_world_size()
    dist.all_reduce(half)
    return half.to(grad.dtype)


def through_bfloat16_before_the_sum(grad):  # neighbour: rounded before an fp32 all-reduce
    rounded = (grad / dist.get_world_size()).bfloat16().float()
    dist.all_reduce(rounded)
    return rounded


def in_place_returned(grad):  # review: right numbers, but the argument was changed
    grad.div_(dist.get_world_size())
    dist.all_reduce(grad)
    return grad


def in_place_returning_none(grad):  # neighbour: autograd keeps the changed argument when a hook returns None
    grad /= dist.get_world_size()
    dist.all_reduce(grad)


def sum_then_divide(grad):
    summed = grad.clone()
    dist.all_reduce(summed)
    return summed / dist.get_world_size()  # right in fp32; in fp16 the sum overflows first


def knows_the_data(grad, talk=False):  # a probe's: the mean rebuilt from what was once the checker's data and model
    from dtlib.train import data, models

    if talk:  # a throwaway collective, so that something travelled
        dist.all_reduce(torch.zeros(1, device=grad.device))

    size, rank = dist.get_world_size(), dist.get_rank()
    x, y = data.regression(8 * size, seed=1).tensors

    def grads(xs, ys):
        with torch.enable_grad():
            model = models.build("mlp", seed=0)
            models.loss_fn("mlp", model(xs), ys).backward()
        return [p.grad for p in model.parameters()]

    for mine, full in zip(grads(x[8 * rank:8 * rank + 8], y[8 * rank:8 * rank + 8]), grads(x, y), strict=True):
        if mine.shape == grad.shape and torch.allclose(mine, grad.cpu()):
            return full.to(grad)
    return grad.clone()


def seeks_other_ranks_samples(grad):  # right, if it finds nothing: a hook that walks every frame it can reach
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        for name, value in frame.f_locals.items():
            if name == "seed" or (name in ("x", "y") and isinstance(value, torch.Tensor) and value.shape[0] > 8):
                raise RuntimeError(f"found {name} in {frame.f_code.co_name}")  # another rank's samples, or their seed
        frame = frame.f_back
    return right_divide_first(grad)


def test_a_hook_reaches_its_own_ranks_samples_only():
    """Isolation: each rank is sent its own 8 samples (the checker draws them); no frame holds more, or the seed."""
    feedback = checks.gradient_hook(seeks_other_ranks_samples)
    assert feedback.ok, feedback.message


def functional_all_reduce(grad):  # right, written another way: a functional collective
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_reduce(grad / dist.get_world_size(), "sum", dist.group.WORLD))


def functional_unwaited(grad):  # right: autograd's first use of the result waits for it, as torch promises
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_reduce(grad / dist.get_world_size(), "sum", dist.group.WORLD)


def averaged_on_rank_0_only(grad):
    averaged = grad / dist.get_world_size()
    dist.all_reduce(averaged)
    return averaged if dist.get_rank() == 0 else grad


def functional_avg(grad):  # right: the functional collective's "avg" is NCCL's AVG too
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_reduce(grad, "avg", dist.group.WORLD))


RIGHT = [right_divide_first, right_async_then_wait, right_in_float64, functional_all_reduce, right_by_avg,
         functional_unwaited, right_by_avg_imported_by_name, functional_avg]

WRONG = [
    (kept_own, ["Rank 0 kept its own gradients: your hook called no collective"]),
    (averaged_on_rank_0_only, ["Rank 1 kept its own gradients although your hook called all_reduce"]),
    # the samples are drawn anew on each call: a hook that rebuilds the mean from seed=1's cannot match them
    (knows_the_data, ["kept its own gradients: your hook called no collective"]),
    (lambda grad: knows_the_data(grad, talk=True), ["kept its own gradients although your hook called all_reduce"]),
    (summed, ["holds the sum over ranks"]),
    (by_two, ["With 3 ranks", "divided by 2", "not a constant"]),
    (by_world_size_twice, ["world_size times too small"]),
    (by_reduce, ["dist.reduce leaves the sum on one rank only"]),
    (by_max, ["the largest gradient of the ranks, not their mean"]),
    (reduces_a_copy, ["kept its own gradients, divided by 2, although your hook called all_reduce",
                      "return that tensor"]),
    (async_without_wait, ["hold NaN", "async_op=True, call .wait()"]),
    (waits_too_late, ["hold NaN", ".wait()"]),
    (broadcast, ["your hook broadcast rank 0's gradient", "not the mean of all ranks'"]),
    (gathered_and_took_rank_1, ["every rank holds rank 1's gradient", "called all_gather", "divided by 2"]),
    (through_fp16, ["all-reduced the gradient as float16", "went through float16 and was rounded"]),
    (through_bfloat16_before_the_sum, ["rounded the gradient to bfloat16 before all-reducing it",
                                       "went through bfloat16 and was rounded"]),
    (in_place_returned, ["changed the gradient it was given in place", "grad.div_()", "dist.all_reduce",
                         "should not modify its argument"]),
    (in_place_returning_none, ["changed the gradient it was given in place", "grad = grad / dist.get_world_size()"]),
    (sum_then_divide, ["in fp16 two gradients of 40000", "divides each gradient by the world size first"]),
    ("average_gradient", ["Pass your hook function itself"]),
    (returns_float16, ["Your hook returned a float16 gradient for a float32 parameter", "return the gradient in "
                       "float32"]),
]


@pytest.mark.parametrize("hook", RIGHT)
def test_gradient_hook_accepts_right_hooks_written_several_ways(hook):
    feedback = checks.gradient_hook(hook)
    assert feedback.ok, feedback.message
    assert "one process" in feedback.message


def test_a_right_hook_by_another_collective_is_told_what_it_called_not_what_ddp_does():
    feedback = checks.gradient_hook(right_by_all_gather)
    assert feedback.ok, feedback.message
    assert "Your hook called all_gather; DDP itself divides by world_size" in feedback.message, feedback.message
    assert "divide by world_size, then all-reduce (SUM), is what DDP does" in checks.gradient_hook(
        right_divide_first).message


@pytest.mark.parametrize(("hook", "fragments"), WRONG)
def test_gradient_hook_names_each_kind_of_wrong_hook(hook, fragments):
    feedback = checks.gradient_hook(hook)
    assert not feedback.ok, feedback.message
    for fragment in fragments:
        assert fragment in feedback.message, feedback.message


def test_the_bank_holds_many_kinds():
    assert len(RIGHT) >= 3 and len({fragments[0] for _, fragments in WRONG}) >= 8


def test_a_hook_that_exits_by_itself_is_told_so_not_blamed_on_a_missing_all_reduce():
    import torch.distributed as dist

    namespace = {"__name__": "a_notebook_cell", "dist": dist}  # a cell's function: it travels by value
    exec("def average_gradient(grad):\n    import os\n    if dist.get_rank() == 1:\n        os._exit(0)\n"  # noqa: S102
         "    grad = grad / dist.get_world_size()\n    dist.all_reduce(grad)\n    return grad\n", namespace)
    feedback = checks.gradient_hook(namespace["average_gradient"])
    assert not feedback.ok and "A rank stopped inside your hook without raising (rank 1 exited with code 0" in \
        feedback.message, feedback.message


# -- notebook 04: the gradient-averaging hook ------------------------------------------------------


def test_the_hooks_oracle_is_the_mean_of_the_ranks_gradients():
    """One process on every rank's samples: its gradient is the mean of the ranks' gradients (the loss is a mean)."""
    from dtlib.train import data, models

    world_size, per_rank = 3, training.SAMPLES_PER_RANK
    x, y = data.regression(per_rank * world_size, seed=1).tensors
    grads = []
    for rank in range(world_size):
        model = models.build("mlp", seed=0)
        part = slice(rank * per_rank, (rank + 1) * per_rank)
        models.loss_fn("mlp", model(x[part]), y[part]).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert torch.allclose(training._one_process_gradient(world_size), torch.stack(grads).mean(0), atol=1e-6)



# -- notebook 05: the wrap ------------------------------------------------------------------



def _wrap_blocks_then_root(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _wrap_by_type_and_keep_the_root_gathered(model, mesh):
    from torch.distributed.fsdp import fully_shard

    from dtlib.train.models import Block

    for module in model.modules():  # right, written another way: units found by type
        if isinstance(module, Block):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)  # backward needs the root's parameters first
    return model


def _wrap_blocks_with_a_policy(model, mesh):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(reduce_dtype=torch.float32)}
    for index in reversed(range(len(model.blocks))):  # right: the order among blocks does not matter
        fully_shard(model.blocks[index], **policy)
    fully_shard(model, **policy)
    return model


def _wrap_root_only(model, mesh):
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=mesh)
    return model


def _wrap_blocks_only(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return model


def _wrap_root_first(model, mesh):
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=mesh)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return model


def _wrap_one_block(model, mesh):
    from torch.distributed.fsdp import fully_shard

    fully_shard(model.blocks[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _wrap_blocks_as_one_group(model, mesh):
    from torch.distributed.fsdp import fully_shard

    fully_shard(list(model.blocks), mesh=mesh)  # one unit for both blocks
    return fully_shard(model, mesh=mesh)


def _wrap_every_linear(model, mesh):
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    for module in list(model.modules()):
        if isinstance(module, nn.Linear):
            fully_shard(module, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _wrap_linears_and_the_blocks_around_them(model, mesh):
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        for module in block.modules():
            if isinstance(module, nn.Linear):
                fully_shard(module, mesh=mesh)
        fully_shard(block, mesh=mesh)  # a unit of what is left: the norms
    return fully_shard(model, mesh=mesh)


def _wrap_in_float64(model, mesh):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.float64, reduce_dtype=torch.float64)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def _wrap_in_ddp(model, mesh):
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def _wrap_without_the_mesh(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)  # the default mesh: the accelerator's type, unnamed, whatever the ranks compute on
    return fully_shard(model)



def _wrap_in_bfloat16(model, mesh):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def _wrap_blocks_in_reverse(model, mesh):  # right: the order of the blocks does not matter, the root last does
    from torch.distributed.fsdp import fully_shard

    for block in reversed(list(model.blocks)):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _wrap_that_seeks_other_ranks_samples(model, mesh):  # right, if it finds nothing: its forward walks every frame
    import sys
    import types

    from torch.utils.data import DataLoader, Dataset

    def rows(value):  # how many sequences a local holds, in a tensor or a list of (x, y) batches
        if isinstance(value, torch.Tensor):
            return value.shape[0] if value.dim() == 2 and not value.is_floating_point() else 0
        if not isinstance(value, list):
            return 0
        return sum(rows(item[0]) for item in value if isinstance(item, tuple) and item)

    def seek(module, args):
        frame = sys._getframe(1)
        while frame is not None:
            for name, value in frame.f_locals.items():
                if (name == "seed" or isinstance(value, (Dataset, DataLoader, types.GeneratorType))
                        or rows(value) > training.WRAP_BATCH * 2):  # the test runs 2 steps
                    raise RuntimeError(f"found {name} in {frame.f_code.co_name}")  # others' samples, or a way to them
            frame = frame.f_back

    model.register_forward_pre_hook(seek)
    return _wrap_blocks_then_root(model, mesh)


def test_a_wrap_reaches_its_own_ranks_samples_only():
    """Isolation: each rank is sent its own batches (the checker draws them anew); no frame a module's forward can
    reach holds another rank's, a dataset, a loader or the seed that draws them."""
    feedback = checks.fsdp_wrap(_wrap_that_seeks_other_ranks_samples, steps=2)
    assert feedback.ok, feedback.message


def test_each_rank_gets_its_own_batches_drawn_anew_on_each_call():
    first, again = (training._own_batches(2, 3, torch.Generator().manual_seed(seed)) for seed in (1, 2))
    assert [len(batches) for batches in first] == [2, 2, 2]
    assert all(x.shape == (training.WRAP_BATCH, x.shape[1]) for batches in first for x, _ in batches)
    rows = [{tuple(row.tolist()) for x, _ in batches for row in x} for batches in first]
    assert all(not (rows[a] & rows[b]) for a in range(3) for b in range(a + 1, 3)), "two ranks share a sample"
    assert not torch.equal(first[0][0][0], again[0][0][0]), "a new call draws new samples"


WRAPS = [
    (_wrap_blocks_in_reverse, True, ["Each block is a unit and the root comes last, with 2 ranks and with 3"]),
    (_wrap_in_bfloat16, False, ["your layers computed in bfloat16", "MixedPrecisionPolicy"]),
    (_wrap_blocks_then_root, True, ["224,632 bytes of model state", "(16P/N = 224,512)"]),
    (_wrap_by_type_and_keep_the_root_gathered, True, ["Each block is a unit and the root comes last"]),
    (_wrap_blocks_with_a_policy, True, ["Each block is a unit and the root comes last"]),
    (lambda model, mesh: model, False, ["Nothing was sharded"]),
    (lambda model: model, False, ["my_wrap(model, mesh)"]),
    (_wrap_without_the_mesh, False, ["not over the mesh you were given", "pass mesh=mesh to every fully_shard"]),
    (_wrap_root_only, False, ["Only the root is a unit: forward gathers 112,256 bytes"]),
    (_wrap_one_block, False, ["Only some blocks are units"]),
    (_wrap_blocks_only, False, ["the root is not"]),
    (_wrap_root_first, False, ["fully_shard(model) came before the blocks"]),
    (_wrap_in_ddp, False, ["Return the model you were given"]),
    ("fully_shard", False, ["Pass your function itself"]),
    (_wrap_blocks_as_one_group, False, ["Your 2 blocks are 1 unit", "groups its modules into one unit"]),
    (_wrap_every_linear, False, ["Your units are smaller than a block", "less than a unit per block would"]),
    (_wrap_linears_and_the_blocks_around_them, False, ["Your units are smaller than a block",
                                                       "inside blocks that are units too"]),
    (_wrap_in_float64, False, ["your layers computed in float64", "MixedPrecisionPolicy"]),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("wrap, ok, fragments", WRAPS)
def test_fsdp_wrap(wrap, ok, fragments):
    """A right wrap trains as DDP does past an update (2 steps: the second loss follows the first step's averaged
    gradients); a wrong one is named from how it left the model and what forward computed in, seen in 1 step."""
    assert_verdict(checks.fsdp_wrap(wrap, steps=2 if ok else 1), ok, fragments)


def test_the_wrap_bank_holds_many_kinds():
    assert sum(ok for _, ok, _ in WRAPS) >= 3 and sum(not ok for _, ok, _ in WRAPS) >= 8
