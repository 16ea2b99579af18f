"""dtlib.checks.tensor_parallel_mlp: the right split passes with 2 and 3 ranks; each wrong one is named.

The oracle is one process's MLP; the wrong answers are the ones a learner writes: no all-reduce, an average,
the first layer split by its input features, weights sliced along the wrong dimension, an all-gather of the
hidden activations, every rank computing everything.

Rank functions defined here travel to the ranks by value (``register_pickle_by_value``), as a notebook cell's
functions do, so the ranks never import this module (or pytest).
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtlib import checks
from dtlib.checks.tensor_parallel import BATCH, FEATURES, mlp_inputs

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(300)


def megatron(rank, world_size):
    x, up, down = mlp_inputs()
    y = F.gelu(x @ up.chunk(world_size, 0)[rank].T) @ down.chunk(world_size, 1)[rank].T
    dist.all_reduce(y)
    return y


def no_all_reduce(rank, world_size):
    x, up, down = mlp_inputs()
    return F.gelu(x @ up.chunk(world_size, 0)[rank].T) @ down.chunk(world_size, 1)[rank].T


def averaged(rank, world_size):
    y = no_all_reduce(rank, world_size)
    dist.all_reduce(y)
    return y / world_size


def first_layer_by_input_features(rank, world_size):
    x, up, down = mlp_inputs()
    h = F.gelu(x.chunk(world_size, 1)[rank] @ up.chunk(world_size, 1)[rank].T)  # a partial sum, then gelu
    y = h @ down.T
    dist.all_reduce(y)
    return y


def down_by_output_features(rank, world_size):
    x, up, down = mlp_inputs()
    h = F.gelu(x @ up.chunk(world_size, 0)[rank].T)
    y = h @ down.chunk(world_size, 0)[rank].T  # (4, 6) @ (12, 4): the shapes do not fit
    dist.all_reduce(y)
    return y


def gathered_hidden(rank, world_size):
    x, up, down = mlp_inputs()
    h = F.gelu(x @ up.chunk(world_size, 0)[rank].T)
    pieces = [torch.empty_like(h) for _ in range(world_size)]
    dist.all_gather(pieces, h)
    return torch.cat(pieces, 1) @ down.T


def everything_everywhere(rank, world_size):
    x, up, down = mlp_inputs()
    return F.gelu(x @ up.T) @ down.T


def hidden_only(rank, world_size):
    x, up, _ = mlp_inputs()
    return F.gelu(x @ up.chunk(world_size, 0)[rank].T)


def two_all_reduces(rank, world_size):
    y = megatron(rank, world_size)
    dist.all_reduce(y.new_zeros(1))  # an extra collective: one more than the MLP needs
    return y


def reduce_then_broadcast(rank, world_size):  # right values, through one rank
    x, up, down = mlp_inputs()
    y = F.gelu(x @ up.chunk(world_size, 0)[rank].T) @ down.chunk(world_size, 1)[rank].T
    dist.reduce(y, dst=0)
    dist.broadcast(y, src=0)
    return y


def all_reduce_of_a_transpose(rank, world_size):
    x, up, down = mlp_inputs()
    hidden = F.gelu(x @ up.chunk(world_size, 0)[rank].T)
    y = (down.chunk(world_size, 1)[rank] @ hidden.T).T  # a transposed view: NCCL refuses it
    dist.all_reduce(y)
    return y


@pytest.mark.parametrize("fn, ok, fragments", [
    (megatron, True, ["with 2 ranks and with 3", "one all-reduce"]),
    (reduce_then_broadcast, False, ["summed through one rank", "One dist.all_reduce of the summands does both"]),
    (all_reduce_of_a_transpose, False, ["tensor is not contiguous", "t.contiguous()"]),
    (no_all_reduce, False, ["holds only its share of the output", "dist.all_reduce(y)"]),
    (averaged, False, ["divided by 2", "do not divide"]),
    (first_layer_by_input_features, False, ["by its input features (dim 1 of up)", "gelu of a partial sum"]),
    (down_by_output_features, False, ["shapes did not fit", "columns of down (dim 1)"]),
    (gathered_hidden, False, ["Right values, but rank 0 gathered (all_gather)", "one all_reduce"]),
    (everything_everywhere, False, ["communicated nothing", "only its slice"]),
    (hidden_only, False, ["returned its hidden activations", "shape (4, 6)"]),
    (two_all_reduces, False, ["2 all-reduces per rank"]),
    ("megatron", False, ["Pass your function itself"]),
])
def test_tensor_parallel_mlp(fn, ok, fragments):
    feedback = checks.tensor_parallel_mlp(fn)
    assert feedback.ok is ok, feedback.message
    for fragment in fragments:
        assert fragment in feedback.message, feedback.message


def test_the_inputs_are_the_same_on_every_call_and_split_evenly_over_2_and_3_ranks():
    first, second = mlp_inputs(), mlp_inputs()
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    x, up, down = first
    assert x.shape == (4, 8) and up.shape == (12, 8) and down.shape == (8, 12)
    assert up.shape[0] % 2 == up.shape[0] % 3 == 0


#: The MLP's output on the lesson's inputs, worked out in advance (what a notebook cell could print and paste).
LESSON_OUTPUT = (F.gelu(mlp_inputs("cpu")[0] @ mlp_inputs("cpu")[1].T) @ mlp_inputs("cpu")[2].T).tolist()


def precomputed_after_a_right_all_reduce(rank, world_size):
    x, up, down = mlp_inputs()
    y = F.gelu(x @ up.chunk(world_size, 0)[rank].T) @ down.chunk(world_size, 1)[rank].T
    dist.all_reduce(y)  # the right communication, then the numbers of the lesson's inputs
    return torch.tensor(LESSON_OUTPUT, device=y.device)


def test_each_check_draws_new_inputs_so_numbers_worked_out_in_advance_fail():
    lesson = mlp_inputs("cpu")
    feedback = checks.tensor_parallel_mlp(precomputed_after_a_right_all_reduce)
    assert not feedback.ok and "returned the MLP's output for the lesson's inputs" in feedback.message, \
        feedback.message
    assert all(torch.equal(a, b) for a, b in zip(lesson, mlp_inputs("cpu"), strict=True))  # the lesson's again


# -- right numbers reached without tensor parallelism, and right answers written other ways (review of 09) --


def broadcast_from_rank_0(rank, world_size):
    x, up, down = mlp_inputs()
    y = F.gelu(x @ up.T) @ down.T
    dist.broadcast(y, 0)
    return y


def whole_mlp_averaged(rank, world_size):
    x, up, down = mlp_inputs()
    y = F.gelu(x @ up.T) @ down.T
    dist.all_reduce(y)
    return y / world_size


def batch_split(rank, world_size):
    x, up, down = mlp_inputs()
    y = x.new_zeros(4, 8)
    rows = slice(rank * 4 // world_size, (rank + 1) * 4 // world_size)
    y[rows] = F.gelu(x[rows] @ up.T) @ down.T
    dist.all_reduce(y)
    return y


def hidden_all_reduced(rank, world_size):
    x, up, down = mlp_inputs()
    h = x.new_zeros(4, 12)
    mine = slice(rank * 12 // world_size, (rank + 1) * 12 // world_size)
    h[:, mine] = F.gelu(x @ up[mine].T)
    dist.all_reduce(h)
    return h @ down.T


def written_for_two_ranks(rank, world_size):
    x, up, down = mlp_inputs()
    y = F.gelu(x @ up[6 * rank:6 * rank + 6].T) @ down[:, 6 * rank:6 * rank + 6].T  # 6 = 12 / 2, fixed
    dist.all_reduce(y)
    return y


def maximum(rank, world_size):
    y = no_all_reduce(rank, world_size)
    dist.all_reduce(y, op=dist.ReduceOp.MAX)
    return y


def gelu_after_the_sum(rank, world_size):
    x, up, down = mlp_inputs()
    y = (x @ up.chunk(world_size, 0)[rank].T) @ down.chunk(world_size, 1)[rank].T
    dist.all_reduce(y)
    return F.gelu(y)


def async_without_wait(rank, world_size):
    import time

    y = no_all_reduce(rank, world_size)
    dist.all_reduce(y, async_op=True)
    if rank == 0:
        time.sleep(0.5)  # rank 1 returns before its peer even sends
    return y


def async_with_wait(rank, world_size):
    y = no_all_reduce(rank, world_size)
    dist.all_reduce(y, async_op=True).wait()
    return y


def index_slices(rank, world_size):
    x, up, down = mlp_inputs()
    mine = slice(rank * 12 // world_size, (rank + 1) * 12 // world_size)
    y = F.gelu(x @ up[mine].T) @ down[:, mine].T
    dist.all_reduce(y)
    return y


def dtensor_from_local(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    mesh = init_device_mesh("cpu", (world_size,))
    return DTensor.from_local(no_all_reduce(rank, world_size), mesh, [Partial()]).full_tensor()


def dtensor_returned(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    mesh = init_device_mesh("cpu", (world_size,))
    return DTensor.from_local(no_all_reduce(rank, world_size), mesh, [Partial()]).redistribute(mesh, [Replicate()])


def in_bfloat16(rank, world_size):
    x, up, down = (t.bfloat16() for t in mlp_inputs())
    y = F.gelu(x @ up.chunk(world_size, 0)[rank].T) @ down.chunk(world_size, 1)[rank].T
    dist.all_reduce(y)
    return y


def all_reduced_in_bfloat16(rank, world_size):
    x, up, down = mlp_inputs()
    y = F.gelu(x @ up.chunk(world_size, 0)[rank].T) @ down.chunk(world_size, 1)[rank].T
    wire = y.bfloat16()  # "half the bytes on the wire"
    dist.all_reduce(wire)
    return wire.float()


def _padded(y, world_size):
    flat = y.reshape(-1)  # 32 numbers: 3 ranks need padding to 33
    return torch.cat([flat, flat.new_zeros(-flat.numel() % world_size)])


def reduce_scatter_then_all_gather(rank, world_size):  # an all-reduce in its two halves (09, section 5)
    padded = _padded(no_all_reduce(rank, world_size), world_size)
    mine = padded.new_empty(padded.numel() // world_size)
    dist.reduce_scatter_tensor(mine, padded)
    whole = torch.empty_like(padded)
    dist.all_gather_into_tensor(whole, mine)
    return whole[:BATCH * FEATURES].view(BATCH, FEATURES)


def reduce_scatter_then_all_gather_as_lists(rank, world_size):
    pieces = list(_padded(no_all_reduce(rank, world_size), world_size).chunk(world_size))
    mine = torch.empty_like(pieces[0])
    dist.reduce_scatter(mine, pieces)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    return torch.cat(gathered)[:BATCH * FEATURES].view(BATCH, FEATURES)


def reduce_scatter_without_all_gather(rank, world_size):
    padded = _padded(no_all_reduce(rank, world_size), world_size)
    mine = padded.new_empty(padded.numel() // world_size)
    dist.reduce_scatter_tensor(mine, padded)
    return mine


def reduce_scatter_of_the_whole_output(rank, world_size):  # every weight on every rank, then the two halves
    x, up, down = mlp_inputs()
    padded = _padded(F.gelu(x @ up.T) @ down.T / world_size, world_size)
    mine = padded.new_empty(padded.numel() // world_size)
    dist.reduce_scatter_tensor(mine, padded)
    whole = torch.empty_like(padded)
    dist.all_gather_into_tensor(whole, mine)
    return whole[:BATCH * FEATURES].view(BATCH, FEATURES)


def written_for_four_ranks(rank, world_size):
    x, up, down = mlp_inputs()
    y = F.gelu(x @ up[3 * rank:3 * rank + 3].T) @ down[:, 3 * rank:3 * rank + 3].T  # 3 = 12 / 4, fixed
    dist.all_reduce(y)
    return y


def chunks_for_two_ranks(rank, world_size):
    x, up, down = mlp_inputs()
    y = F.gelu(x @ up.chunk(2, 0)[rank].T) @ down.chunk(2, 1)[rank].T  # 2 pieces, whatever the world size
    dist.all_reduce(y)
    return y


def interleaved_features(rank, world_size):  # right: any equal partition of the hidden features works
    x, up, down = mlp_inputs()
    y = F.gelu(x @ up[rank::world_size].T) @ down[:, rank::world_size].T
    dist.all_reduce(y)
    return y


def slices_in_reverse(rank, world_size):  # right: which rank takes which slice is free
    x, up, down = mlp_inputs()
    mine = world_size - 1 - rank
    y = F.gelu(x @ up.chunk(world_size, 0)[mine].T) @ down.chunk(world_size, 1)[mine].T
    dist.all_reduce(y)
    return y


def flattened_all_reduce(rank, world_size):  # right: the summand all-reduced flat, then shaped back
    x, up, down = mlp_inputs()
    flat = (F.gelu(x @ up.chunk(world_size, 0)[rank].T) @ down.chunk(world_size, 1)[rank].T).reshape(-1).clone()
    dist.all_reduce(flat)
    return flat.view(x.shape[0], -1)


def transposed_all_reduce(rank, world_size):  # right: computed as (features, batch), transposed at the end
    x, up, down = mlp_inputs()
    y_t = down.chunk(world_size, 1)[rank] @ F.gelu(up.chunk(world_size, 0)[rank] @ x.T)
    dist.all_reduce(y_t)
    return y_t.T


def whole_mlp_after_a_summand(rank, world_size):  # wrong: the summand all-reduced, then thrown away
    x, up, down = mlp_inputs()
    y = F.gelu(x @ up.chunk(world_size, 0)[rank].T) @ down.chunk(world_size, 1)[rank].T
    dist.all_reduce(y)
    return F.gelu(x @ up.T) @ down.T


def uneven_shares(rank, world_size):  # wrong, though the sum is right: rank 0 takes half again as many features
    x, up, down = mlp_inputs()
    bounds = [0, 7, 12] if world_size == 2 else [0, 5, 9, 12]
    mine = slice(bounds[rank], bounds[rank + 1])
    y = F.gelu(x @ up[mine].T) @ down[:, mine].T
    dist.all_reduce(y)
    return y


def rounded_for_the_log(rank, world_size):  # wrong: right to 5 decimals only
    y = megatron(rank, world_size)
    return torch.round(y * 1e5) / 1e5


def tanh_gelu(rank, world_size):  # wrong: gelu's tanh approximation, right to about 3 to 4 digits
    x, up, down = mlp_inputs()
    y = F.gelu(x @ up.chunk(world_size, 0)[rank].T, approximate="tanh") @ down.chunk(world_size, 1)[rank].T
    dist.all_reduce(y)
    return y


def in_float64(rank, world_size):  # right: more precise than float32, cast back
    x, up, down = (t.double() for t in mlp_inputs())
    y = F.gelu(x @ up.chunk(world_size, 0)[rank].T) @ down.chunk(world_size, 1)[rank].T
    dist.all_reduce(y)
    return y.float()


def feature_by_feature(rank, world_size):  # right: the summand added up one hidden feature at a time
    x, up, down = mlp_inputs()
    y = torch.zeros(x.shape[0], down.shape[0], device=x.device)
    for j in range(rank, up.shape[0], world_size):
        y += torch.outer(F.gelu(x @ up[j]), down[:, j])
    dist.all_reduce(y)
    return y


@pytest.mark.parametrize("fn, ok, fragments", [
    (rounded_for_the_log, False, ["right to about 5 digits, not to float32's precision", "off by",
                                  "float32's rounding allows"]),
    (tanh_gelu, False, ["gelu's tanh approximation", "keep the default"]),
    (in_float64, True, []),
    (feature_by_feature, True, []),
    (broadcast_from_rank_0, False, ["also moved data (broadcast)"]),
    (interleaved_features, True, []),
    (slices_in_reverse, True, []),
    (flattened_all_reduce, True, []),
    (transposed_all_reduce, True, []),
    (whole_mlp_after_a_summand, False, ["flops' worth of matrices, where its share of the MLP is",
                                        "computed with more than its own rows of up"]),
    (uneven_shares, False, ["the ranks computed [7, 5] hidden features", "an equal share (6)"]),
    (whole_mlp_averaged, False, ["multiplied 1,536 flops' worth of matrices, where its share of the MLP is 768"]),
    (batch_split, False, ["all-reduced a tensor that is not its summand"]),
    (hidden_all_reduced, False, ["all-reduced a tensor of shape (4, 12)"]),
    (written_for_two_ranks, False, ["with 3 ranks rank 0 all-reduced the summand of hidden features 0 to 5",
                                    "your slice is written for 2 ranks"]),  # 6 rows, where 3 ranks hold 4 each
    (written_for_four_ranks, False, ["as if there were 4 ranks", "written for 4 ranks"]),
    (chunks_for_two_ranks, False, ["Rank 2 took a piece that does not exist", "IndexError",
                                   "up.chunk(world_size, 0)[rank]"]),
    (reduce_scatter_then_all_gather, True, ["reduce-scatter then all-gather", "one dist.all_reduce(y)"]),
    (reduce_scatter_then_all_gather_as_lists, True, ["all-reduce in its two halves"]),
    (reduce_scatter_without_all_gather, False, ["returned a float32 tensor of shape (16,)"]),
    (reduce_scatter_of_the_whole_output, False, ["reduce-scattered a tensor that is not its summand"]),
    (maximum, False, ["ReduceOp.MAX keeps the largest"]),
    (gelu_after_the_sum, False, ["applied gelu after the second layer"]),
    (async_without_wait, False, ["call .wait()"]),
    (async_with_wait, True, []),
    (index_slices, True, []),
    (dtensor_from_local, True, []),
    (dtensor_returned, False, ["returned a DTensor", "full_tensor()"]),
    (in_bfloat16, False, ["computed in bfloat16", "compute in float32"]),
    (all_reduced_in_bfloat16, False, ["to about 3 digits only", "the split is right", "Keep every step in float32"]),
])
def test_tensor_parallel_mlp_is_not_fooled_by_right_numbers_and_takes_right_answers_in_any_spelling(fn, ok, fragments):
    feedback = checks.tensor_parallel_mlp(fn)
    assert feedback.ok is ok, feedback.message
    for fragment in fragments:
        assert fragment in feedback.message, feedback.message


def test_an_all_reduce_read_part_way_is_named_as_unfinished():
    """gloo writes the sum into the tensor chunk by chunk: a rank that returns without wait() may hand back a
    tensor whose numbers are partly its summand and partly the sum (seen in a full gate run)."""
    from dtlib.checks.tensor_parallel import _part_way

    summand, total = torch.zeros(4, 8, dtype=torch.float64), torch.ones(4, 8, dtype=torch.float64)
    torn = torch.cat([total[:2], summand[2:]])
    assert _part_way(torn, summand, total) and _part_way(summand, summand, total)
    assert not _part_way(total, summand, total)  # finished: right
    assert not _part_way(torch.full((4, 8), 0.5, dtype=torch.float64), summand, total)  # something else


def megatron_by_tensor_split(rank, world_size):
    x, up, down = mlp_inputs()
    y = F.gelu(x @ up.tensor_split(world_size, 0)[rank].T) @ down.tensor_split(world_size, 1)[rank].T
    dist.all_reduce(y)
    return y


def test_the_model_answer_passes_at_every_world_size_the_checker_accepts_and_others_are_refused_by_name():
    assert checks.tensor_parallel_mlp(megatron_by_tensor_split, world_size=3).ok  # runs 3 and 4 ranks
    for world_size in (1, 4, 5, 6):  # 12 hidden features: 4 and 5 ranks, 5 and 6, 6 and 7 cannot both split evenly
        with pytest.raises(ValueError, match="tensor_parallel_mlp checks world sizes 2 or 3"):
            checks.tensor_parallel_mlp(megatron_by_tensor_split, world_size=world_size)
