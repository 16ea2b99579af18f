"""dtlib.memory: the ZeRO paper's figures, the formulas' shape, and bytes measured on real tensors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dtlib import memory, models


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


def test_breakdown_adds_up_and_takes_other_precisions():
    parts = memory.breakdown(1000, 4, "zero2", param_bytes=4, grad_bytes=4, optim_bytes_per_param=8)
    assert parts == {"parameters": 4000, "gradients": 1000, "optimizer_state": 2000}
    assert memory.estimate(1000, 4, "zero2", param_bytes=4, grad_bytes=4, optim_bytes_per_param=8) == 7000


@pytest.mark.parametrize("call, match", [
    (lambda: memory.estimate(10, 2, "zero4"), "unknown strategy 'zero4'"),
    (lambda: memory.estimate(10, 0, "ddp"), "world_size must be >= 1"),
    (lambda: memory.estimate(-1, 2, "ddp"), "num_params must be >= 0"),
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
