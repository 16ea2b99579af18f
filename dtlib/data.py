"""Synthetic data made in code, and what ``DistributedSampler`` hands each rank.

Example::

    dataset = dtlib.data.for_model("mlp", num_samples=256)      # x: (256, 16), y: (256, 1)
    order = dtlib.data.sampler_indices(10, world_size=2, epochs=2)
    order[0][1]   # the indices rank 1 sees in epoch 0
"""

from __future__ import annotations

import torch
from torch.utils.data import DistributedSampler, TensorDataset

from dtlib.models import IN_FEATURES, SEQ_LEN, VOCAB


def regression(num_samples: int, in_features: int = IN_FEATURES, seed: int = 0) -> TensorDataset:
    """``y = sin(x @ w) + noise``: a smooth target an MLP can learn. x: (N, in_features), y: (N, 1)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, in_features, generator=generator)
    w = torch.randn(in_features, 1, generator=generator) / in_features**0.5
    y = torch.sin(x @ w) + 0.05 * torch.randn(num_samples, 1, generator=generator)
    return TensorDataset(x, y)


def tokens(num_samples: int, seq_len: int = SEQ_LEN, vocab: int = VOCAB, seed: int = 0) -> TensorDataset:
    """Sequences that count up with a random stride: learnable next-token prediction.

    inputs and targets: (N, seq_len) integers, targets shifted by one position.
    """
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(vocab, (num_samples, 1), generator=generator)
    stride = torch.randint(1, 4, (num_samples, 1), generator=generator)
    sequence = (start + stride * torch.arange(seq_len + 1)) % vocab  # (N, T + 1)
    return TensorDataset(sequence[:, :-1], sequence[:, 1:])


def for_model(model: str, num_samples: int, seed: int = 0) -> TensorDataset:
    """The data set that goes with ``dtlib.models.build(model)``."""
    return tokens(num_samples, seed=seed) if model == "transformer" else regression(num_samples, seed=seed)


def sampler_indices(dataset_len: int, world_size: int, epochs: int = 1, *, set_epoch: bool = True,
                    shuffle: bool = True, drop_last: bool = False, seed: int = 0) -> list[list[list[int]]]:
    """``[epoch][rank]``: the indices ``DistributedSampler`` gives each rank, computed without processes.

    ``set_epoch=False`` shows the classic mistake: every epoch repeats the first one's order.
    With ``drop_last=False`` the sampler pads by repeating indices so all ranks get as many;
    with ``True`` it drops the tail instead.
    Example: ``sampler_indices(10, 4, drop_last=False)[0]`` gives each of 4 ranks 3 indices (2 repeated).
    """
    if world_size < 1 or dataset_len < 1:
        raise ValueError(f"need world_size >= 1 and dataset_len >= 1, got {world_size} and {dataset_len}")
    samplers = [DistributedSampler(range(dataset_len), num_replicas=world_size, rank=rank, shuffle=shuffle,
                                   seed=seed, drop_last=drop_last) for rank in range(world_size)]
    order = []
    for epoch in range(epochs):
        for sampler in samplers:
            if set_epoch:
                sampler.set_epoch(epoch)
        order.append([list(sampler) for sampler in samplers])
    return order
