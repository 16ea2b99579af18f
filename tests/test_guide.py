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


# -- notebook 06's exercise checker --------------------------------------------------------------


def test_check_choice_accepts_what_recommend_picks():
    for params in (1e9, 4e9, 7e9, 20e9, 100e9, 1e12):
        advice = guide.recommend(params, MEM, 8)
        assert guide.check_choice(advice.choice, params, MEM, 8).ok


@pytest.mark.parametrize("params, answer, nodes, fragments", [
    # 20e9 on one node of 8: HSDP's 40 GB fits 56 GB; what rules it out is that there is one node
    (20e9, "HSDP", 1, ["one node", "nothing to replicate across"]),
    # a replica of 4.6e9 needs 73.6 GB: more than checkpointing's 72 GB (10% reserve), not only than 56 GB
    (4.6e9, "DDP + activation checkpointing", 1, ["needs 73.6 GB", "72.0 GB budget", "minus 10%"]),
    (4.6e9, "DDP", 1, ["needs 73.6 GB", "56.0 GB budget", "minus 30%"]),
    (20e9, "FSDP, no reshard after forward", 1, ["needs 75.0 GB", "56.0 GB budget"]),
    (1e9, "FSDP full sharding", 1, ["would fit, but a simpler strategy fits too: DDP"]),
    (20e9, "FSDP", 1, ["'FSDP, no reshard after forward', 'HSDP'"]),  # each choice quoted: one has a comma
])
def test_check_choice_gives_the_true_reason(params, answer, nodes, fragments):
    feedback = guide.check_choice(answer, params, MEM, 8, nodes=nodes)
    assert not feedback.ok
    for fragment in fragments:
        assert fragment in feedback.message, feedback.message
    if answer == "HSDP":
        assert "budget" not in feedback.message, feedback.message


@pytest.mark.parametrize("nodes", [1, 2, 8])
def test_check_choice_says_more_than_the_budget_only_when_it_is_more(nodes):
    """Every "needs X GB ... more than the Y GB budget" over a sweep of sizes has X > Y, and Y is the budget
    of that choice: the GPU minus 10% with activation checkpointing, minus 30% otherwise."""
    import re

    said = 0
    for params in [10 ** (e / 4) for e in range(32, 50)]:  # 1e8 .. 3e12 parameters
        for answer in guide.CHOICES:
            message = guide.check_choice(answer, params, MEM, 8, nodes=nodes).message
            found = re.search(r"needs ([\d.]+) GB of model state per GPU, more than the ([\d.]+) GB budget", message)
            if found:
                said += 1
                assert float(found[1]) > float(found[2]), message
                tight = answer == "DDP + activation checkpointing"
                assert float(found[2]) == pytest.approx(TIGHT if tight else BUDGET), message
    assert said > 0
