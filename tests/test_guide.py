"""dtlib.guide: each rule of the decision guide at its boundary, from the ZeRO formulas."""

from __future__ import annotations

import pytest

from dtlib import guide, memory

MEM = 80.0  # GB per GPU
BUDGET = MEM * (1 - guide.ACTIVATION_RESERVE)
TIGHT = MEM * (1 - guide.CHECKPOINTING_RESERVE)
EPS = 1e-6


def _params_for(gb_per_gpu: float, bytes_per_param: float) -> float:
    return gb_per_gpu * 1e9 / bytes_per_param


@pytest.mark.parametrize("mixed_precision, optimizer, expected", [
    (True, "adamw", 16), (False, "adamw", 16), (True, "sgd", 12), (False, "sgd", 12),
])
def test_bytes_per_param(mixed_precision, optimizer, expected):
    assert sum(guide.bytes_per_param(mixed_precision, optimizer).values()) == expected


def test_ddp_up_to_the_budget_then_checkpointing_then_fsdp():
    at_budget = _params_for(BUDGET, 16)  # DDP holds 16 bytes per parameter
    assert guide.recommend(at_budget, MEM, 8).choice == "DDP"
    assert guide.recommend(at_budget * (1 + EPS), MEM, 8).choice == "DDP + activation checkpointing"
    at_tight = _params_for(TIGHT, 16)
    assert guide.recommend(at_tight, MEM, 8).choice == "DDP + activation checkpointing"
    assert guide.recommend(at_tight * (1 + EPS), MEM, 8).choice == "FSDP, no reshard after forward"


def test_zero2_then_full_sharding_on_one_node():
    n = 8
    at_zero2 = _params_for(BUDGET, 2 + 14 / n)  # ZeRO-2: 2P + 14P/N
    assert guide.recommend(at_zero2, MEM, n).choice == "FSDP, no reshard after forward"
    assert guide.recommend(at_zero2 * (1 + EPS), MEM, n).choice == "FSDP full sharding"
    at_zero3 = _params_for(BUDGET, 16 / n)
    assert guide.recommend(at_zero3, MEM, n).choice == "FSDP full sharding"
    assert guide.recommend(at_zero3 * (1 + EPS), MEM, n).choice == "FSDP full sharding + CPU offload"


def test_offload_then_model_parallelism():
    n = 8
    at_offload = _params_for(BUDGET, 4 / n)  # weight and gradient shards only: (2 + 2) P / N
    assert guide.recommend(at_offload, MEM, n).choice == "FSDP full sharding + CPU offload"
    assert guide.recommend(at_offload * (1 + EPS), MEM, n).choice == "tensor / pipeline parallelism"


def test_hsdp_across_nodes_when_one_node_can_hold_a_full_shard_set():
    gpus, nodes = 16, 2
    at_hsdp = _params_for(BUDGET, 16 / (gpus // nodes))  # ZeRO-3 within one node of 8
    assert at_hsdp > _params_for(BUDGET, 2 + 14 / gpus)  # beyond ZeRO-2 over all 16: HSDP's rule decides
    assert guide.recommend(at_hsdp, MEM, gpus, nodes=nodes).choice == "HSDP"
    assert guide.recommend(at_hsdp * (1 + EPS), MEM, gpus, nodes=nodes).choice == "FSDP full sharding"
    assert guide.recommend(at_hsdp, MEM, gpus, nodes=1).choice == "FSDP full sharding"  # one node: no HSDP


def test_the_arithmetic_comes_with_the_answer():
    advice = guide.recommend(7e9, 80, 8)
    assert advice.gb_per_gpu["DDP"] == pytest.approx(memory.estimate(7e9, 8, "ddp") / 1e9) == pytest.approx(112)
    assert advice.gb_per_gpu["FSDP full sharding"] == pytest.approx(14)
    assert advice.budget_gb == pytest.approx(BUDGET)
    assert advice.choice in str(advice) and "GB" in advice.reason


def test_common_sizes_table_grows_monotonically():
    rows = guide.table()
    for gpu_gb in (40, 80):
        choices = [guide.CHOICES.index(r["choice"]) for r in rows if r["gpu_gb"] == gpu_gb]
        assert choices == sorted(choices)  # a bigger model never gets a lighter strategy
    assert {r["choice"] for r in rows if r["params_b"] < 1} == {"DDP"}
    assert {r["choice"] for r in rows if r["params_b"] >= 13} <= set(guide.CHOICES[2:])


@pytest.mark.parametrize("call, match", [
    (lambda: guide.recommend(0, 80, 8), "num_params and gpu_memory_gb must be > 0"),
    (lambda: guide.recommend(1e9, 80, 6, nodes=4), "split evenly"),
    (lambda: guide.recommend(1e9, 80, 8, optimizer="lion"), "optimizer must be one of"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
