"""DDP, FSDP2 and FSDP1 on GPUs (NCCL) against one process on the CPU; CUDA's allocator beside the ZeRO
formula; notebook 04's SyncBatchNorm cell on the GPU it was written for.

One GPU runs NCCL at world size 1 (the ranks' whole path: process group, CUDA tensors, DDP's buckets, FSDP's
all-gathers and reduce-scatters); with more GPUs the same tests run on 2 ranks.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from notebook_code import definitions

import dtlib
from dtlib.train import data, ddp, fsdp, models
from dtlib.train.fsdp import FSDPConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

WORLD = max(1, min(2, torch.cuda.device_count()))  # NVML: this process does not initialise CUDA
GPU_VS_CPU_ATOL = 1e-4  # the same fp32 arithmetic, summed in another order on another device
# Adam divides each step by the gradient's own running size, so where a gradient is near zero a difference in
# its last bits moves the parameter by a sizeable part of lr: compare FSDP's Adam losses more loosely. Still
# 500 times finer than the 0.5 the loss falls by in those steps.
ADAM_LOSS_ATOL = 1e-3


def _trained(before: torch.Tensor, after: torch.Tensor) -> bool:
    """Training moved the parameters by far more than the tolerance the comparisons allow."""
    return bool((after - before).abs().max() > 100 * GPU_VS_CPU_ATOL)


@pytest.mark.timeout(180)
def test_ddp_on_gpus_reaches_the_single_process_parameters():
    config = ddp.TrainConfig(model="mlp", steps=6)
    results = ddp.run(config, WORLD, backend="nccl", output="none", timeout=150)
    reference = ddp.train_single(config, world_size=WORLD)  # one process on the CPU, the whole global batch
    untrained = ddp.train_single(replace(config, steps=1)).params
    for rank, result in enumerate(results):
        assert (result.rank, result.world_size, result.backend) == (rank, WORLD, "nccl")
        torch.testing.assert_close(result.params, reference.params, rtol=0, atol=GPU_VS_CPU_ATOL)
        assert _trained(untrained, result.params)
        assert result.comm_calls == [1] * config.steps  # the mlp's gradients fit one bucket
    np.testing.assert_allclose(np.mean([r.losses for r in results], axis=0), reference.losses, rtol=0,
                               atol=GPU_VS_CPU_ATOL)


def single_process_losses(config: FSDPConfig) -> list[float]:
    """The oracle: one process on the CPU, the whole global batch per step, plain Adam, no wrapper."""
    model = models.build(config.model, seed=config.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    batches = data.batches(data.for_model(config.model, config.num_samples, seed=config.seed), world_size=1,
                           rank=0, batch_size=config.global_batch, seed=config.seed)
    losses = []
    for _ in range(config.steps):
        x, y = next(batches)
        loss = models.loss_fn(config.model, model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


FSDP_CONFIGS = {"fsdp2": FSDPConfig(api="fsdp2"), "fsdp2 cpu_offload": FSDPConfig(api="fsdp2", cpu_offload=True),
                "fsdp1": FSDPConfig(api="fsdp1")}


@pytest.fixture(scope="module")
def fsdp_runs() -> dict[str, list[fsdp.FSDPResult]]:
    """Each config of FSDP_CONFIGS trained on WORLD GPUs, one after another in one launch."""
    names = list(FSDP_CONFIGS)
    runs = fsdp.run_many([FSDP_CONFIGS[name] for name in names], WORLD, backend="nccl", output="none", timeout=150)
    return dict(zip(names, runs, strict=True))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(FSDP_CONFIGS))
def test_fsdp_on_gpus_trains_like_one_process(fsdp_runs, name):
    results = fsdp_runs[name]
    expected = single_process_losses(FSDP_CONFIGS[name])
    for result in results:
        np.testing.assert_allclose(result.losses, expected, rtol=0, atol=ADAM_LOSS_ATOL, err_msg=name)
    assert expected[-1] < expected[0] - 0.5  # it trained: the comparison can tell
    placements = results[0].shard_example["placements"]
    assert (placements == "flat parameter") if name == "fsdp1" else ("Shard(dim=0)" in placements), placements


@pytest.mark.timeout(240)
def test_cpu_offload_pins_host_memory_when_the_ranks_compute_on_gpus(fsdp_runs):
    """On GPU ranks the runner offloads to pinned host memory, and notes that (on CPU ranks: pin_memory=False)."""
    for result in fsdp_runs["fsdp2 cpu_offload"]:
        assert [note.split(":")[0] for note in result.notes] == ["CPUOffloadPolicy(pin_memory=True)"], result.notes


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(FSDP_CONFIGS))
def test_cuda_allocator_holds_the_zero_formulas_model_state_and_more(fsdp_runs, name):
    """dtlib.measure.memory.allocator on GPU ranks: allocated <= peak <= reserved, and the first step's peak sits
    above the model state the ZeRO formula predicts (activations and communication buffers come on top)."""
    for result in fsdp_runs[name]:
        numbers, at_rest = result.cuda_memory, sum(result.memory_at_rest.values())
        assert numbers is not None, name
        assert 0 < numbers["allocated"] <= numbers["peak"] <= numbers["reserved"], (name, numbers)
        assert 1 <= at_rest / sum(result.estimate.values()) <= 1.05, (name, result.memory_at_rest, result.estimate)
        if name != "fsdp2 cpu_offload":  # offloaded shards live in host memory, outside CUDA's allocator
            assert numbers["peak"] > at_rest, (name, numbers, result.memory_at_rest)


@pytest.mark.timeout(120)
def test_notebook_04s_syncbatchnorm_uses_the_global_batch_statistics():
    code = definitions("04_ddp.ipynb", ["bind_device", "batchnorm_statistics"])
    reports = dtlib.spawn(code["batchnorm_statistics"], WORLD, backend="nccl", output="none", timeout=90)
    everyone = []
    for rank in range(WORLD):  # the cell's samples, made again here: one process, every rank's batch
        torch.manual_seed(rank)
        everyone.append(torch.randn(8, 4) + rank)
    whole = torch.cat(everyone).mean(0)
    for _local, global_mean, gathered_mean, layer, real in reports:
        assert layer == "SyncBatchNorm" and real is not None  # the layer itself ran: only on GPUs
        torch.testing.assert_close(gathered_mean, whole, rtol=0, atol=1e-6)
        torch.testing.assert_close(global_mean, whole, rtol=0, atol=1e-5)
        torch.testing.assert_close(real, whole, rtol=0, atol=1e-5)  # statistics of the global batch
    if WORLD > 1:
        assert not torch.allclose(reports[0][0], whole, atol=1e-2)  # a rank's own mean would differ


@pytest.mark.timeout(180)
def test_the_simulators_gpu_kernels_are_what_a_gpu_keeps():
    """Notebook 14's default count (``kernels="cuda"``: CUDA's fused RMSNorm, SDPA's flash kernel) against the
    same step on this GPU, torch's own kernels, rank 0 measured by the same tracker. GPU run must confirm: the
    activations equal, byte for byte, as the CPU's kernels equal the CPU's live ranks (tests/sim)."""
    from dtlib.sim.llama import LLAMA
    from dtlib.sim.proof import on_live_ranks
    from dtlib.sim.step import simulate

    args = {"dp": WORLD, "seq_len": 64, "micro_batch": 2}
    real = on_live_ranks(LLAMA["tiny"], **args)
    assert real.kernels == "cuda"
    fake, cpu = (simulate(LLAMA["tiny"], depths=None, kernels=kernels, **args) for kernels in ("cuda", "cpu"))
    assert real.traffic == fake.traffic
    assert real.memory["activations"] == fake.memory["activations"] < cpu.memory["activations"], \
        (real.memory, fake.memory, cpu.memory)
