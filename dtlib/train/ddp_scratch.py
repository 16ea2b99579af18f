"""DDP written from scratch, in two steps: a hook per parameter, then flat buckets that overlap backward.

Both wrap a module whose replicas start equal (the constructor broadcasts rank 0's
parameters) and leave every rank with the same averaged gradients after backward.
Call :meth:`finish_gradient_sync` between ``loss.backward()`` and ``optimizer.step()``
(torch's DDP hides that call in an autograd callback)::

    model = BucketedDDP(dtlib.train.models.build("mlp"), bucket_cap_mb=1)
    loss_fn(model(x), y).backward()
    model.finish_gradient_sync()     # waits for the last buckets, copies averages into .grad
    optimizer.step()

``tests/train/test_ddp_scratch.py`` checks both against ``torch.nn.parallel.DistributedDataParallel``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def _trainable(module: nn.Module) -> list[nn.Parameter]:
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters: there are no gradients to synchronise")
    return params


class Replicated(nn.Module):
    """What both versions share: rank 0's weights everywhere, forward, and ``no_sync``."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.require_sync = True
        self.params = _trainable(module)
        with torch.no_grad():
            for tensor in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(tensor, src=0)  # replicas must start equal

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: the hooks skip the all-reduce inside this block."""
        self.require_sync = False
        try:
            yield
        finally:
            self.require_sync = True

    def finish_gradient_sync(self) -> None:
        """Nothing is left in flight after this returns."""


class NaiveDDP(Replicated):
    """(a) One blocking all-reduce per parameter, from a hook that fires once its gradient is in ``.grad``.

    ``register_post_accumulate_grad_hook``, not ``register_hook``: after backward passes under
    ``no_sync``, only ``.grad`` holds the sum of every micro-batch's gradient.
    """

    def __init__(self, module: nn.Module):
        super().__init__(module)
        for param in self.params:
            param.register_post_accumulate_grad_hook(self._average)  # fires after .grad is accumulated

    def _average(self, param: torch.Tensor) -> None:
        if not self.require_sync:
            return
        param.grad /= dist.get_world_size()  # divide first, as DDP does: a 16-bit sum then cannot overflow
        dist.all_reduce(param.grad)  # SUM over ranks, in place: the average


class BucketedDDP(Replicated):
    """(b) Gradients packed into flat buckets in reverse parameter order (the order backward
    produces them); a full bucket is all-reduced asynchronously while backward goes on.

    ``bucket_cap_mb`` (MB = 2**20 bytes, as DDP reads it): a bucket closes once it holds
    at least this many bytes. Buckets are launched strictly in order, so every rank
    issues the same collectives in the same order even if hooks fire in another.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0):
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        super().__init__(module)
        cap_bytes = bucket_cap_mb * 2**20
        self.buckets: list[list[nn.Parameter]] = [[]]
        for param in reversed(self.params):
            if sum(p.numel() * p.element_size() for p in self.buckets[-1]) >= cap_bytes:
                self.buckets.append([])
            self.buckets[-1].append(param)
        self.flat = [torch.zeros(sum(p.numel() for p in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
                     for bucket in self.buckets]  # one contiguous buffer per bucket
        self._where: dict[nn.Parameter, tuple[int, int]] = {}
        for index, bucket in enumerate(self.buckets):
            offset = 0
            for param in bucket:
                self._where[param] = (index, offset)
                offset += param.numel()
                param.register_post_accumulate_grad_hook(self._ready)
        self._reset()

    def _reset(self) -> None:
        self._pending = [len(bucket) for bucket in self.buckets]
        self._next_to_launch = 0
        self._works: list[Any] = []
        self._gradients_seen = 0  # since the last sync: hooks that fired outside no_sync

    def _ready(self, param: torch.Tensor) -> None:
        if not self.require_sync:
            return
        self._gradients_seen += 1
        index, offset = self._where[param]
        self.flat[index][offset:offset + param.numel()].copy_(param.grad.reshape(-1))
        self._pending[index] -= 1
        while self._next_to_launch < len(self.buckets) and self._pending[self._next_to_launch] == 0:
            buffer = self.flat[self._next_to_launch]
            buffer /= dist.get_world_size()  # pre-divide: the sum of averages is the average
            self._works.append(dist.all_reduce(buffer, async_op=True))
            self._next_to_launch += 1

    def finish_gradient_sync(self) -> None:
        """Wait for every bucket, then write the averaged gradients back into ``.grad``."""
        if self._gradients_seen == 0:
            return  # inside no_sync, or no backward since the last call
        for work in self._works:
            work.wait()  # nothing stays in flight, whatever happens next
        if self._next_to_launch < len(self.buckets):
            launched = self._next_to_launch
            self._reset()
            raise RuntimeError(f"only {launched} of {len(self.buckets)} buckets got all their gradients: a "
                               "parameter was unused in this step (torch's DDP needs find_unused_parameters=True "
                               "for that)")
        for index, bucket in enumerate(self.buckets):
            for param in bucket:
                _, offset = self._where[param]
                param.grad.copy_(self.flat[index][offset:offset + param.numel()].view_as(param))
        self._reset()
