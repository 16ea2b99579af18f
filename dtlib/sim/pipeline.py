"""A pipeline step written out: the 1F1B schedule of notebook 10, one stage per rank of the "pp" dimension,
activations and their gradients passed between neighbouring stages, each send posted with the next receive in
one ``dist.batch_isend_irecv`` (what NCCL needs of dependent transfers).

It is written by hand, not with ``torch.distributed.pipelining``, because the same code must run on fake tensors
(the schedules' warm-up reads a tensor's value with ``.item()``, which a fake tensor has not) and on live ranks,
so that the simulator's tables can be proved against real ones.

Example (rank 0 is stage 0)::

    pipeline_step(stage_model, optimizer, tokens, mesh)    # tokens: (micro_batches, micro_batch, seq_len)
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dtlib.sim.llama import next_token_loss, vocabulary_sharded


def one_f_one_b(stage: int, stages: int, micro_batches: int) -> list[str]:
    """The order in which a stage runs its forwards ("F") and backwards ("B") under 1F1B: stage s first runs
    ``stages - s - 1`` forwards, then alternates, then drains; so it holds at most ``stages - s`` micro-batches'
    activations at once, whatever the number of micro-batches.

    Example: ``one_f_one_b(0, 2, 3)`` is ``["F", "F", "B", "F", "B", "B"]``.
    """
    warmup = min(stages - stage - 1, micro_batches)
    return ["F"] * warmup + ["F", "B"] * (micro_batches - warmup) + ["B"] * warmup


class _Transfers:
    """A stage's point-to-point transfers, posted as NCCL needs them: a send waits until the stage next receives,
    then goes out in one ``dist.batch_isend_irecv`` with that receive. Two neighbours that each post a lone
    blocking send to the other would both wait on NCCL; posted together, every transfer finds its match."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group, self.waiting = group, []

    def send(self, tensor: torch.Tensor, to: int) -> None:
        self.waiting.append(dist.P2POp(dist.isend, tensor, to, self.group))

    def receive(self, into: torch.Tensor, source: int) -> torch.Tensor:
        self.flush(dist.P2POp(dist.irecv, into, source, self.group))
        return into

    def flush(self, *more: dist.P2POp) -> None:
        ops, self.waiting = [*self.waiting, *more], []
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()


def pipeline_step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, mesh: DeviceMesh,
                  dtype: torch.dtype = torch.bfloat16) -> None:
    """One training step of this rank's stage (``model``, a :class:`dtlib.sim.llama.Llama` stage) under 1F1B.

    ``tokens`` holds every micro-batch, (micro_batches, micro_batch, seq_len), the same on every stage (the last
    uses them as targets); activations travel between stages in ``dtype``, the blocks' compute dtype. FSDP's
    gradient reduce-scatter runs once, in the last micro-batch's backward.
    """
    pp = mesh["pp"]
    group, stage, stages = pp.get_group(), pp.get_local_rank(), pp.size()
    before = dist.get_global_rank(group, stage - 1) if stage > 0 else None
    after = dist.get_global_rank(group, stage + 1) if stage < stages - 1 else None
    micro_batches, micro_batch, seq_len = tokens.shape
    transfers = _Transfers(group)
    inputs: deque[torch.Tensor] = deque()
    outputs: deque[torch.Tensor] = deque()
    done = 0
    for op in one_f_one_b(stage, stages, micro_batches):
        if op == "F":
            batch = tokens[len(inputs) + done]
            x = batch
            if before is not None:  # the previous stage's activations, which this stage differentiates
                shape = (micro_batch, model.positions_held(seq_len), model.hidden)  # a share, under SP
                x = transfers.receive(torch.empty(shape, dtype=dtype, device=tokens.device), before)
                x.requires_grad_()
            with vocabulary_sharded(model):  # logits split over the vocabulary stay split into the loss
                y = model(x)
                if after is None:  # the last stage: the loss, averaged over the micro-batches
                    y = next_token_loss(y, batch) / micro_batches
            if after is not None:
                transfers.send(y.detach(), after)
            inputs.append(x)
            outputs.append(y)
        else:
            if hasattr(model, "set_requires_gradient_sync"):  # FSDP: reduce-scatter once, on the last backward
                model.set_requires_gradient_sync(done == micro_batches - 1)
            x, y = inputs.popleft(), outputs.popleft()
            if after is None:
                with vocabulary_sharded(model):
                    y.backward()
            else:
                y.backward(transfers.receive(torch.empty_like(y), after))
            if before is not None:
                transfers.send(x.grad, before)
            done += 1
    transfers.flush()
    optimizer.step()
    optimizer.zero_grad()
