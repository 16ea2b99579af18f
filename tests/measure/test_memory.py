"""dtlib.measure.memory: the ZeRO paper's figures, the formulas' shape, and bytes measured on real tensors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dtlib.measure import memory
from dtlib.train import models


def test_zero_paper_example_as_the_paper_rounds_it():
    # ZeRO (Rajbhandari et al., 2020), Figure 1: 7.5B parameters, Adam in mixed precision, 64 GPUs.
    gb = {s: round(memory.estimate(7.5e9, 64, s) / 1e9, 1) for s in memory.STRATEGIES}
    assert gb == {"ddp": 120.0, "zero1": 31.4, "zero2": 16.6, "zero3": 1.9}


@pytest.mark.parametrize("alias, same_as", [("shard_grad_op", "zero2"), ("full_shard", "zero3"),
                                            ("no_shard", "ddp"), ("FULL_SHARD", "zero3")])
def test_fsdp_names_are_zero_stages(alias, same_as):
    assert memory.estimate(1e9, 8, alias) == memory.estimate(1e9, 8, same_as)


@given(st.integers(1, 10**12), st.integers(1, 4096))
def test_formulas_per_stage(num_params, world_size):
    p, n = num_params, world_size
    assert memory.estimate(p, n, "ddp") == pytest.approx(16 * p)
    assert memory.estimate(p, n, "zero1") == pytest.approx(4 * p + 12 * p / n)
    assert memory.estimate(p, n, "zero2") == pytest.approx(2 * p + 14 * p / n)
    assert memory.estimate(p, n, "zero3") == pytest.approx(16 * p / n)
    stages = [memory.estimate(p, n, s) for s in memory.STRATEGIES]
    assert stages == sorted(stages, reverse=True)  # each stage shards more, never less


@given(st.integers(1, 10**12), st.integers(1, 4096))
def test_formulas_in_fp32(num_params, world_size):
    """fp32 Adam (4 + 4 + 8 bytes): "4P + 12P/N" is ZeRO-2 here, while with mixed precision it is ZeRO-1."""
    p, n = num_params, world_size
    fp32 = {"param_bytes": 4, "grad_bytes": 4, "optim_bytes_per_param": 8}
    assert memory.estimate(p, n, "ddp", **fp32) == pytest.approx(16 * p)
    assert memory.estimate(p, n, "zero1", **fp32) == pytest.approx(8 * p + 8 * p / n)
    assert memory.estimate(p, n, "zero2", **fp32) == pytest.approx(4 * p + 12 * p / n)
    assert memory.estimate(p, n, "zero3", **fp32) == pytest.approx(16 * p / n)


@given(st.integers(1, 10**12), st.integers(1, 4096))
def test_fsdp_formulas(num_params, world_size):
    p, n = num_params, world_size
    assert memory.fsdp_estimate(p, n) == pytest.approx(16 * p / n)  # = ZeRO-3
    assert memory.fsdp_estimate(p, n, reshard_after_forward=False) == pytest.approx(2 * p + 16 * p / n)
    assert memory.fsdp_estimate(p, n, reshard_after_forward=False, compute_bytes=4) == pytest.approx(4 * p + 16 * p / n)
    assert memory.fsdp_estimate(p, n, moment_bytes=4) == pytest.approx(12 * p / n)  # SGD with momentum
    # FSDP keeps fp32 gradient shards where ZeRO-2 counts fp16 ones: 2P/N more, mixed precision
    assert memory.fsdp_estimate(p, n, reshard_after_forward=False) - memory.estimate(p, n, "zero2") == \
        pytest.approx(2 * p / n)


def _fsdp2_bytes(rank: int, world_size: int, reshard_after_forward: bool) -> dict[str, object]:
    """Train one step of FSDP2 with bf16 compute, then run a forward: the bytes at rest and gathered."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = models.build("transformer", seed=0)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for module in [*model.blocks, model]:
        fully_shard(module, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    optimizer = torch.optim.AdamW(model.parameters())
    tokens = torch.zeros(2, 16, dtype=torch.long)
    models.loss_fn("transformer", model(tokens), tokens).backward()
    optimizer.step()
    at_rest = memory.measured(model, optimizer)
    shards = {p.to_local().untyped_storage().data_ptr() for group in optimizer.param_groups for p in group["params"]}
    model(tokens)  # between forward and backward
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    after = [p for p in local if p.untyped_storage().data_ptr() not in shards]  # not a shard: gathered
    return {"at_rest": at_rest, "gathered": memory.measured(model)["parameters"] if after else 0,
            "gathered_dtypes": sorted({str(p.dtype) for p in after}),
            "num_params": sum(p.numel() for p in models.build("transformer").parameters())}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_fsdp_formula_against_fsdp2_itself(reshard_after_forward):
    """The oracle: real FSDP2 ranks with a bf16 MixedPrecisionPolicy keep fp32 shards of weights and gradients
    beside Adam's moments (16P/N) and, without resharding, the bf16 weights gathered as a second copy (2P)."""
    import dtlib

    world_size = 2
    held = dtlib.spawn(_fsdp2_bytes, world_size, args=(reshard_after_forward,), timeout=90, output="none")[0]
    p = held["num_params"]
    parts = memory.fsdp_breakdown(p, world_size, reshard_after_forward=reshard_after_forward)
    for part in ("parameters", "gradients"):
        assert 1 <= held["at_rest"][part] / parts[part] <= 1.05, part  # fp32 shards (padding on top)
    assert 1 <= held["at_rest"]["optimizer_state"] / parts["optimizer_state"] <= 1.05  # moments and step counters
    assert held["gathered"] == parts["gathered"]
    assert held["gathered_dtypes"] == ([] if reshard_after_forward else ["torch.bfloat16"])
    # fsdp_estimate is these parts' sum; the runner's peaks meet it in tests/train/test_fsdp.py


def test_breakdown_adds_up_and_takes_other_precisions():
    parts = memory.breakdown(1000, 4, "zero2", param_bytes=4, grad_bytes=4, optim_bytes_per_param=8)
    assert parts == {"parameters": 4000, "gradients": 1000, "optimizer_state": 2000}
    assert memory.estimate(1000, 4, "zero2", param_bytes=4, grad_bytes=4, optim_bytes_per_param=8) == 7000


@pytest.mark.parametrize("call, match", [
    (lambda: memory.estimate(10, 2, "zero4"), "unknown strategy 'zero4'"),
    (lambda: memory.estimate(10, 0, "ddp"), "world_size must be >= 1"),
    (lambda: memory.estimate(-1, 2, "ddp"), "num_params must be >= 0"),
    (lambda: memory.estimate(float("nan"), 2, "ddp"), "num_params must be a finite number, got nan"),
    (lambda: memory.estimate(float("inf"), 2, "zero3"), "num_params must be a finite number, got inf"),
    (lambda: memory.estimate(10, float("nan"), "zero3"), "world_size must be a finite number"),
    (lambda: memory.estimate(10, float("inf"), "zero3"), "world_size must be a finite number"),
    (lambda: memory.estimate(10, 2.5, "zero3"), "world_size must be a whole number"),
    (lambda: memory.estimate(10, 2, "ddp", param_bytes=float("nan")), "param_bytes must be a finite number"),
    (lambda: memory.estimate(10, 2, "ddp", optim_bytes_per_param=float("inf")), "optim_bytes_per_param must be"),
    (lambda: memory.fsdp_estimate(float("nan"), 2), "num_params must be a finite number"),
    (lambda: memory.fsdp_estimate(10, 2, compute_bytes=float("inf")), "compute_bytes must be a finite number"),
    (lambda: memory.estimate("10", 2, "ddp"), "num_params must be a finite number, got '10'"),
])
def test_bad_input_is_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_measured_counts_parameters_gradients_and_adam_state():
    model = models.build("mlp")
    num_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.Adam(model.parameters())
    assert memory.measured(model, optimizer) == {"parameters": 4 * num_params, "gradients": 0, "optimizer_state": 0}
    model(torch.randn(4, models.IN_FEATURES)).sum().backward()
    optimizer.step()
    held = memory.measured(model, optimizer)
    steps = len(list(model.parameters()))  # Adam keeps one scalar "step" tensor per parameter
    assert held["gradients"] == 4 * num_params
    assert held["optimizer_state"] == 8 * num_params + 4 * steps


def test_allocator_is_asked_only_on_a_gpu():
    assert memory.allocator(torch.device("cpu")) is None  # a CPU has no caching allocator to ask


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_allocator_peak_holds_the_model_state_and_more():
    """The formula predicts model state; CUDA's peak adds activations and temporary buffers on top."""
    device = torch.device("cuda", 0)
    torch.cuda.init()  # before CUDA starts, reset_peak_memory_stats raises "Invalid device argument" (an H100 did)
    torch.cuda.reset_peak_memory_stats(device)
    model = models.build("transformer", seed=0).to(device)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.zeros(8, 16, dtype=torch.long, device=device)).sum().backward()
    optimizer.step()
    state = sum(memory.measured(model, optimizer).values())
    numbers = memory.allocator(device)
    assert numbers is not None and numbers["peak"] > state
    assert numbers["allocated"] <= numbers["peak"] <= numbers["reserved"]
