"""Synthetic data made in code, and what ``DistributedSampler`` hands each rank.

Example::

    dataset = dtlib.train.data.for_model("mlp", num_samples=256)      # x: (256, 16), y: (256, 1)
    order = dtlib.train.data.sampler_indices(10, world_size=2, epochs=2)
    order[0][1]   # the indices rank 1 sees in epoch 0
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from dtlib.train.models import IN_FEATURES, SEQ_LEN, VOCAB


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
    """The data set that goes with ``dtlib.train.models.build(model)``."""
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


def batches(dataset: TensorDataset, world_size: int, rank: int, batch_size: int, *, seed: int = 0,
            first_step: int = 0, set_epoch: bool = True) -> Iterator[list[torch.Tensor]]:
    """This rank's batches from step ``first_step`` on, epoch after epoch, for ever.

    A ``DistributedSampler`` (shuffled with ``seed``, tail dropped so every rank gets as
    many) feeds a ``DataLoader``; ``set_epoch`` reshuffles each epoch unless told not to.
    Resuming at ``first_step`` skips exactly the batches already seen, so a resumed run
    sees the same data as one that never stopped.
    Example: ``x, y = next(batches(dataset, 2, 0, batch_size=16))``.
    """
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                                 drop_last=True)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
    per_epoch = len(loader)
    if per_epoch == 0:
        raise ValueError(f"{len(dataset)} samples over {world_size} ranks give no full batch of {batch_size}")
    for epoch in itertools.count(first_step // per_epoch):
        if set_epoch:
            sampler.set_epoch(epoch)
        skip = first_step - epoch * per_epoch if epoch == first_step // per_epoch else 0
        yield from itertools.islice(loader, skip, None)
