"""dtlib.train.data: synthetic data sets by seed, and DistributedSampler's split checked against its arithmetic."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dtlib.train import data
from dtlib.train.models import IN_FEATURES, SEQ_LEN, VOCAB


def test_regression_shapes_and_determinism():
    x, y = data.regression(40).tensors
    assert x.shape == (40, IN_FEATURES) and y.shape == (40, 1)
    again_x, again_y = data.regression(40).tensors
    assert torch.equal(x, again_x) and torch.equal(y, again_y)
    other_x, _ = data.regression(40, seed=1).tensors
    assert not torch.equal(x, other_x)


def test_regression_targets_follow_a_smooth_function_of_the_inputs():
    _, y = data.regression(500).tensors
    assert y.abs().max() <= 1.0 + 5 * 0.05  # sin(...) plus noise of std 0.05
    assert y.std() > 0.1  # not noise only


def test_tokens_shapes_range_and_determinism():
    inputs, targets = data.tokens(12).tensors
    assert inputs.shape == targets.shape == (12, SEQ_LEN)
    assert inputs.dtype == torch.int64
    assert 0 <= int(inputs.min()) and int(inputs.max()) < VOCAB
    again_inputs, again_targets = data.tokens(12).tensors
    assert torch.equal(inputs, again_inputs) and torch.equal(targets, again_targets)
    assert not torch.equal(inputs, data.tokens(12, seed=3).tensors[0])


def test_tokens_targets_are_the_inputs_shifted_by_one():
    inputs, targets = data.tokens(20).tensors
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    stride = (targets - inputs) % VOCAB  # (N, T): one stride per sequence, 1, 2 or 3
    assert torch.equal(stride, stride[:, :1].expand_as(stride))
    assert set(stride[:, 0].tolist()) <= {1, 2, 3}


def test_for_model_picks_tokens_for_the_transformer_and_regression_otherwise():
    assert data.for_model("transformer", 8).tensors[0].dtype == torch.int64
    assert torch.equal(data.for_model("mlp", 8).tensors[0], data.regression(8).tensors[0])
    assert torch.equal(data.for_model("transformer", 8, seed=2).tensors[1], data.tokens(8, seed=2).tensors[1])


@settings(max_examples=60, deadline=None)
@given(per_rank=st.integers(1, 12), world_size=st.integers(1, 8), seed=st.integers(0, 3))
def test_divisible_length_gives_disjoint_ranks_that_cover_everything(per_rank, world_size, seed):
    n = per_rank * world_size
    for epoch in data.sampler_indices(n, world_size, epochs=2, seed=seed):
        seen = [i for indices in epoch for i in indices]
        assert all(len(indices) == per_rank for indices in epoch)
        assert sorted(seen) == list(range(n))  # disjoint and complete


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 60), world_size=st.integers(1, 8), drop_last=st.booleans())
def test_any_length_pads_or_drops_as_the_arithmetic_says(n, world_size, drop_last):
    per_rank = n // world_size if drop_last else math.ceil(n / world_size)
    epoch = data.sampler_indices(n, world_size, drop_last=drop_last)[0]
    counts = Counter(i for indices in epoch for i in indices)
    assert [len(indices) for indices in epoch] == [per_rank] * world_size
    assert set(counts) <= set(range(n))
    if drop_last:
        assert max(counts.values(), default=1) == 1  # nothing repeated
        assert len(counts) == per_rank * world_size  # n % world_size indices dropped
    else:
        assert set(counts) == set(range(n))  # nothing dropped
        assert sum(counts.values()) - n == per_rank * world_size - n  # the padding, made of repeats


def test_padding_and_dropping_on_ten_samples_and_four_ranks():
    padded = data.sampler_indices(10, 4, drop_last=False)[0]
    assert [len(indices) for indices in padded] == [3] * 4
    counts = Counter(i for indices in padded for i in indices)
    assert set(counts) == set(range(10)) and sorted(counts.values()) == [1] * 8 + [2] * 2  # 2 repeats
    dropped = data.sampler_indices(10, 4, drop_last=True)[0]
    assert [len(indices) for indices in dropped] == [2] * 4
    assert len(set(range(10)) - {i for indices in dropped for i in indices}) == 2


def test_set_epoch_reshuffles_every_epoch():
    epochs = data.sampler_indices(64, 2, epochs=3)
    for a in range(3):
        for b in range(a + 1, 3):
            assert epochs[a][0] != epochs[b][0], f"epochs {a} and {b} give rank 0 the same order"
            assert epochs[a][1] != epochs[b][1]


def test_without_set_epoch_every_epoch_repeats_the_first():
    epochs = data.sampler_indices(64, 2, epochs=3, set_epoch=False)
    assert epochs[1] == epochs[0] and epochs[2] == epochs[0]
    assert epochs[0] == data.sampler_indices(64, 2)[0]  # the order of epoch 0 with set_epoch


def test_seed_changes_the_order_and_no_shuffle_is_round_robin():
    assert data.sampler_indices(32, 2, seed=0)[0] != data.sampler_indices(32, 2, seed=1)[0]
    assert data.sampler_indices(10, 3, shuffle=False, drop_last=True)[0] == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]


@pytest.mark.parametrize("dataset_len, world_size", [(10, 0), (0, 2), (-1, 2)])
def test_bad_sizes_are_refused(dataset_len, world_size):
    with pytest.raises(ValueError, match="need world_size >= 1 and dataset_len >= 1"):
        data.sampler_indices(dataset_len, world_size)
