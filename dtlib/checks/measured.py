"""The measurements behind the predictions (:mod:`dtlib.checks.predictions`): each runs dtlib's or torch's own
code on live ranks, or in this process, on sizes fixed here, and returns the one figure a learner predicted.

Each owns its inputs, as every checker does, so the figure is this machine's and the reasoning under it holds for
any learner. Example: ``ring_mib()`` is 1.5 on any machine (4 ranks, 1 MiB each: what each rank sends).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DistributedSampler

from dtlib import compat
from dtlib.checks import collective_order
from dtlib.launch import torchrun
from dtlib.launch.device import rank_device
from dtlib.launch.spawn import spawn
from dtlib.measure.counting import count_collectives, watching
from dtlib.measure.stages import StageClock, in_flight_peak
from dtlib.ring.send_recv import ring_all_reduce
from dtlib.sim import failures
from dtlib.sim.llama import LLAMA
from dtlib.sim.step import simulate
from dtlib.train import ddp, fsdp_compare

RING_RANKS = 4
RING_ELEMENTS = 2**18  # float32: 1 MiB per rank
GATHERED = 1000  # float32 numbers per rank in notebook 02's all-gather
#: 20 jobs of 2,000 hours, about 10,000 failures in all: the simulated share within 0.3 points of the exact one,
#: a fifth of the smallest cost the prediction asks about (one job alone is within a point only), in two seconds
JOB_HOURS, JOB_RUNS = 2000, 20
MOE_RANKS, MOE_EXPERTS, MOE_TOKENS, MOE_DIM = 4, 8, 1024, 16
SPAWNED = 3  # ranks in notebook 00's first job
SAMPLES = 16  # a dataset's size in notebook 08's sampler
PIPELINE_STAGES, PIPELINE_MICRO_BATCHES = 4, 8  # notebook 10's 1F1B
KV_SEQUENCE, KV_HEADS, KV_HEAD_DIM = 4096, 8, 128  # notebook 12's ring attention, in bf16, on RING_RANKS ranks



def _sent_bytes(run: Callable[[], object]) -> int:
    """Bytes this rank sends while ``run()`` runs, as c10d's ``send`` sees them (``batch_isend_irecv`` posts one
    per peer and step)."""
    sent: list[int] = []

    def see(namespace: str, name: str, args: tuple) -> None:
        if namespace == "c10d" and name == "send":
            sent.append(sum(tensor.nbytes for tensor in args[0]))

    with watching(see):
        run()
    return sum(sent)


def _ring_sent(rank: int, world_size: int, elements: int) -> int:
    """Bytes this rank sends in dtlib's ring all-reduce of ``elements`` float32 numbers."""
    return _sent_bytes(lambda: ring_all_reduce(torch.ones(elements, device=rank_device())))


def ring_mib() -> float:
    return max(spawn(_ring_sent, world_size=RING_RANKS, args=(RING_ELEMENTS,), output="none")) / 2**20


def ddp_calls() -> float:
    first = ddp.run(ddp.TrainConfig(model="wide_mlp", steps=3), world_size=2, output="none")[0]
    return first.comm_calls[-1]


def model_state_gib() -> float:
    return simulate(LLAMA["7B"], dp=64, seq_len=4096).model_state() / 2**30  # dtlib's layout: kept for the checker


def fsdp_all_gathers() -> float:
    return sum(op == "all_gather" for op, _ in collective_order.observed())  # notebook 15's trace, on 2 live ranks


def hsdp_over_ddp() -> float:
    ddp_row, hsdp_row = fsdp_compare.strategies(world_size=4, labels=("DDP", "FSDP2 HSDP (2 x 2 mesh)"))
    return fsdp_compare.bytes_sent_per_rank(hsdp_row) / fsdp_compare.bytes_sent_per_rank(ddp_row)


def _tp_mlp_calls(rank: int, world_size: int) -> int:
    """All-reduces of one forward and backward of a Megatron MLP under torch's tensor parallelism, its input
    needing a gradient as inside a model."""
    device = rank_device()
    mesh = init_device_mesh(device.type, (world_size,))
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)).to(device)
    parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(4, 16).to(device).requires_grad_()
    y, forward = count_collectives(mlp, x)
    _, backward = count_collectives(lambda: y.sum().backward())
    return forward.get("all_reduce", 0) + backward.get("all_reduce", 0)


def tp_all_reduces() -> float:
    return spawn(_tp_mlp_calls, world_size=2, output="none")[0]


def moe_copies_sent() -> float:
    """Copies of rank 0's tokens that a random router sends to other ranks' experts (its own generator: the
    notebook's random state is left as it was)."""
    generator = torch.Generator().manual_seed(0)
    router = torch.randn(MOE_DIM, MOE_EXPERTS, generator=generator)
    tokens = torch.randn(MOE_TOKENS, MOE_DIM, generator=generator)
    chosen = (tokens @ router).topk(2, dim=-1).indices  # each token's 2 experts
    return float((chosen // (MOE_EXPERTS // MOE_RANKS) != 0).sum())  # experts 2r and 2r + 1 live on rank r


def _dtensor_calls(rank: int, world_size: int) -> int:
    """Collectives of ``distribute_tensor`` with ``Shard(0)`` and then ``full_tensor()``, on this rank."""
    device = rank_device()
    mesh = init_device_mesh(device.type, (world_size,))
    x, made = count_collectives(lambda: distribute_tensor(torch.arange(16.0).view(4, 4).to(device), mesh, [Shard(0)]))
    _, gathered = count_collectives(x.full_tensor)
    return sum(made.values()) + sum(gathered.values())


def dtensor_collectives() -> float:
    return spawn(_dtensor_calls, world_size=2, output="none")[0]


def job_waste_percent() -> float:
    """The share of the wall time of :data:`JOB_RUNS` long simulated jobs that made no new work, in percent
    (failures drawn at random, one fixed seed per job)."""
    wall_s = sum(failures.simulate(work_s=JOB_HOURS * 3600, interval_s=3600, mtbf_s=4 * 3600, checkpoint_s=60,
                                   restart_s=300, seed=seed).wall_s for seed in range(JOB_RUNS))
    return 100 * (1 - JOB_RUNS * JOB_HOURS * 3600 / wall_s)


def _summed(rank: int, world_size: int) -> float:
    total = torch.tensor([rank + 1.0], device=rank_device())
    dist.all_reduce(total)
    return total.item()


def sum_on_rank_2() -> float:
    return spawn(_summed, world_size=4, output="none")[2]


def _gathered_bytes(rank: int, world_size: int, elements: int) -> int:
    device = rank_device()
    gathered = torch.empty(world_size * elements, device=device)
    compat.all_gather_single(gathered, torch.full((elements,), float(rank), device=device))
    return gathered.nbytes


def gathered_kb() -> float:
    return spawn(_gathered_bytes, world_size=4, args=(GATHERED,), output="none")[0] / 1000


def torchrun_rank() -> float:
    records = torchrun.env_records(torchrun.simulate_nodes(["-m", "dtlib.examples.env"], nnodes=2,
                                                           nproc_per_node=2, rendezvous="static"))
    return next(int(r["RANK"]) for r in records if r["GROUP_RANK"] == "1" and r["LOCAL_RANK"] == "1")


def _pid(rank: int, world_size: int) -> int:
    return os.getpid()


def spawned_processes() -> float:
    """Different process IDs among what ``spawn`` returns from 3 ranks, each returning its own."""
    return len(set(spawn(_pid, world_size=SPAWNED, output="none")))


def sampler_orders() -> float:
    """Different orders rank 0 of 2 gets from a shuffling ``DistributedSampler`` over 3 epochs, never told the
    epoch (``set_epoch`` not called), as notebook 08's first pitfall."""
    sampler = DistributedSampler(range(SAMPLES), num_replicas=2, rank=0, shuffle=True)  # no process group needed
    return len({tuple(sampler) for _ in range(3)})


def _held_by_stage_0(rank: int, world_size: int) -> int:
    """The most micro-batches whose forward had run and whose backward had not on stage 0, in torch's 1F1B with
    one stage per rank (each pass a 1 ms stand-in for a GPU's work)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    device = rank_device()
    clock = StageClock(forward_s=0.001, backward_s=0.002)
    torch.manual_seed(0)
    stage = PipelineStage(clock.wrap(nn.Linear(8, 8).to(device), rank), rank, world_size, device)
    schedule = Schedule1F1B(stage, n_microbatches=PIPELINE_MICRO_BATCHES, loss_fn=F.mse_loss)
    x, y = (torch.randn(2 * PIPELINE_MICRO_BATCHES, 8).to(device) for _ in range(2))
    for _ in range(2):  # the first step also infers the shapes on stand-in tensors; the second is counted
        clock.clear()
        feeds = (x,) if rank == 0 else ()
        schedule.step(*feeds, **({"target": y, "losses": []} if rank == world_size - 1 else {}))
    return in_flight_peak(clock.spans(), rank)


def micro_batches_held() -> float:
    return spawn(_held_by_stage_0, world_size=PIPELINE_STAGES, output="none")[0]


def _numbers_held(rank: int, world_size: int) -> int:
    """Numbers of a Linear's and a LayerNorm's weights on this rank: the Linear ColwiseParallel over tp, the norm
    left out of the plan, then the whole model sharded by fully_shard over dp, as notebook 11 lays its blocks."""
    from torch.distributed.fsdp import fully_shard

    device = rank_device()
    mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("dp", "tp"))
    model = nn.Sequential(nn.Linear(64, 256, bias=False), nn.LayerNorm(256, bias=False)).to(device)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return sum(parameter.to_local().numel() for parameter in model.parameters())


def numbers_on_rank_0() -> float:
    return spawn(_numbers_held, world_size=4, output="none")[0]


def _kv_bytes_sent(rank: int, world_size: int) -> int:
    """Bytes this rank sends while ring attention's K/V blocks go round (section 2 of notebook 12: one block
    posted onward at every step but the last), as c10d's ``send`` sees them."""
    tokens, heads, head_dim = KV_SEQUENCE // world_size, KV_HEADS, KV_HEAD_DIM
    blocks = [torch.zeros(2, heads, tokens, head_dim, dtype=torch.bfloat16, device=rank_device())]  # K and V
    blocks.append(torch.empty_like(blocks[0]))  # the block arriving

    def go_round() -> None:
        for _ in range(world_size - 1):
            kv, incoming = blocks
            ops = [dist.P2POp(dist.isend, kv, (rank + 1) % world_size),
                   dist.P2POp(dist.irecv, incoming, (rank - 1) % world_size)]
            for transfer in dist.batch_isend_irecv(ops):
                transfer.wait()
            blocks.reverse()  # the block received is the one passed on next

    return _sent_bytes(go_round)


def kv_mib_sent() -> float:
    return spawn(_kv_bytes_sent, world_size=RING_RANKS, output="none")[0] / 2**20
