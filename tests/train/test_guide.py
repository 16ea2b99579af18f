"""dtlib.train.guide: each rule of the decision guide at its boundary, from the ZeRO formulas.

The one rule of memory, written out here rather than read from the module: model state and activations
together fit 90% of each GPU (10% stays for buffers and fragmentation); without a count of the activations,
they take 30% of the GPU, 10% with checkpointing. So model state may use 60% of the GPU, 80% with checkpointing.
"""

from __future__ import annotations

import pytest

from dtlib import checks
from dtlib.measure import memory
from dtlib.train import guide

MEM = 80.0  # GB per GPU
USABLE = MEM * 0.9  # model state and activations together: 72 GB
BUDGET = USABLE - MEM * 0.3  # model state beside the rule of thumb's activations: 48 GB
TIGHT = USABLE - MEM * 0.1  # the same with activation checkpointing: 64 GB
DDP_BYTES = 22  # 16 of model state, 4 of gradient buckets, 2 of autocast's bf16 weight copies
EPS = 1e-6


def _params_for(gb_per_gpu: float, bytes_per_param: float) -> float:
    return gb_per_gpu * 1e9 / bytes_per_param


HOST = 1000.0 * (1 - guide.HOST_RESERVE)  # GB of a node's RAM that offloading may use, by default


@pytest.mark.parametrize("mixed_precision, optimizer, state, compute", [
    (True, "adamw", 16, 2), (False, "adamw", 16, 4), (True, "sgd", 12, 2), (False, "sgd", 12, 4),
])
def test_bytes_per_param(mixed_precision, optimizer, state, compute):
    sizes = guide.bytes_per_param(mixed_precision, optimizer)
    assert sizes["param_bytes"] + sizes["grad_bytes"] + sizes["optim_bytes_per_param"] == state  # fp32 throughout
    assert sizes["compute_bytes"] == compute  # the dtype FSDP gathers the weights in


def test_ddp_up_to_its_budget_with_its_buckets_then_fsdp_before_any_recomputing():
    at_budget = _params_for(BUDGET, DDP_BYTES)  # 16 bytes of model state, 4 of buckets, 2 of bf16 copies
    assert guide.recommend(at_budget, MEM, 8).choice == "DDP"
    assert guide.recommend(at_budget * (1 + EPS), MEM, 8).choice == "FSDP, no reshard after forward"
    as_view = _params_for(BUDGET, 18)  # gradient_as_bucket_view=True: the buckets are the gradients
    assert guide.recommend(as_view, MEM, 8, gradient_as_bucket_view=True).choice == "DDP"
    assert guide.recommend(as_view, MEM, 8).choice == "FSDP, no reshard after forward"
    in_fp32 = _params_for(BUDGET, 20)  # no autocast, no bf16 copies: 16 + 4
    assert guide.recommend(in_fp32, MEM, 8, mixed_precision=False).choice == "DDP"
    assert guide.recommend(in_fp32 * (1 + EPS), MEM, 8, mixed_precision=False).choice != "DDP"
    assert guide.recommend(_params_for(BUDGET, 16), MEM, 8, mixed_precision=False,
                           gradient_as_bucket_view=True).choice == "DDP"
    assert "its gradient buckets and autocast's bf16 weight copies included" in guide.recommend(1e9, MEM, 8).reason
    # one GPU: nothing to shard over, so checkpointing comes before the impossible
    at_tight = _params_for(TIGHT, DDP_BYTES)
    assert guide.recommend(at_tight, MEM, 1).choice in ("FSDP full sharding", "DDP + activation checkpointing")


def test_no_reshard_then_full_sharding_on_one_node():
    n = 8
    at_no_reshard = _params_for(BUDGET, 2 + 16 / n)  # FSDP2, bf16 compute: 2P + 16P/N (not ZeRO-2's 2P + 14P/N)
    assert guide.recommend(at_no_reshard, MEM, n).choice == "FSDP, no reshard after forward"
    assert guide.recommend(at_no_reshard * (1 + EPS), MEM, n).choice == "FSDP full sharding"
    in_fp32 = _params_for(BUDGET, 4 + 16 / n)  # fp32 compute gathers 4-byte weights: 4P + 16P/N
    assert guide.recommend(in_fp32, MEM, n, mixed_precision=False).choice == "FSDP, no reshard after forward"
    assert guide.recommend(in_fp32 * (1 + EPS), MEM, n, mixed_precision=False).choice == "FSDP full sharding"
    at_zero3 = _params_for(BUDGET, 16 / n)
    assert guide.recommend(at_zero3, MEM, n).choice == "FSDP full sharding"
    assert guide.recommend(at_zero3 * (1 + EPS), MEM, n).choice == "FSDP full sharding + activation checkpointing"
    at_zero3_tight = _params_for(TIGHT, 16 / n)  # with checkpointing, full sharding keeps 90% of the GPU
    assert guide.recommend(at_zero3_tight, MEM, n).choice == "FSDP full sharding + activation checkpointing"
    assert guide.recommend(at_zero3_tight * (1 + EPS), MEM, n).choice == "FSDP full sharding + CPU offload"


def test_full_sharding_with_checkpointing_comes_before_offload():
    """30B on 8 x 80 GB: 60 GB of model state per GPU, over the 48 GB budget but within 64 GB with
    activation checkpointing; offload (480 GB of host RAM) would fit too, and is much slower."""
    advice = guide.recommend(30e9, MEM, 8)
    assert advice.choice == "FSDP full sharding + activation checkpointing", advice
    assert advice.gb_per_gpu["FSDP full sharding"] == pytest.approx(60)
    assert advice.checkpointing_budget_gb == pytest.approx(TIGHT)
    # the batch you measured decides instead: no checkpointing is assumed, so 60 GB + 20 GB of activations is out
    assert guide.recommend(30e9, MEM, 8, activation_gb=20).choice == "FSDP full sharding + CPU offload"


def test_the_room_left_for_activations_is_counted_in_the_90_percent_kept_not_the_whole_gpu():
    """The issue's second bullet: 30B on 8 x 80 GB leaves 72 - 60 = 12 GB for activations, not 80 - 60 = 20."""
    advice = guide.recommend(30e9, MEM, 8)
    assert "leaves 12.0 GB of the 72.0 GB usable for activations" in advice.reason, advice.reason
    assert "20.0 GB" not in advice.reason
    assert advice.activation_room_gb["FSDP full sharding"] == pytest.approx(USABLE - 60)
    assert "8.0 GB with it" in advice.reason  # 10% of 80: checkpointed, the activations fit the 12 GB


def test_13b_on_8_gpus_of_40_gb_needs_checkpointing_by_the_rule_the_prose_states():
    """The issue's first bullet: 16 x 13 / 8 = 26 GB of model state per GPU; a 40 GB GPU keeps 4 GB for buffers
    and, by the rule of thumb, 12 GB for activations, leaving 24 GB: full sharding alone does not fit. With
    checkpointing the activations take 4 GB and 32 GB is left: it fits."""
    advice = guide.recommend(13e9, 40, 8)
    assert advice.gb_per_gpu["FSDP full sharding"] == pytest.approx(26)
    assert advice.budget_gb == pytest.approx(24) and advice.checkpointing_budget_gb == pytest.approx(32)
    assert advice.choice == "FSDP full sharding + activation checkpointing", advice
    refused = checks.strategy_choice("FSDP full sharding", 13e9, 40, 8)
    assert not refused.ok and "needs 26.0 GB" in refused.message and "24.0 GB budget" in refused.message


@pytest.mark.parametrize("gpu_gb", [24, 40, 80, 141])
def test_every_choice_follows_the_one_rule(gpu_gb):
    """Over a sweep of sizes, the choice is the first in the guide's order whose model state, the rule of thumb's
    activations and 10% of buffers fit the GPU; nothing simpler does. Computed here from the model state alone."""
    order = ["DDP", "FSDP, no reshard after forward", "FSDP full sharding"]
    for params in [10 ** (e / 8) for e in range(64, 96)]:  # 1e8 .. 1e12 parameters
        state = guide.model_state_gb(params, 8)
        fits = [name for name in order if state[name] + 0.3 * gpu_gb + 0.1 * gpu_gb <= gpu_gb]
        fits += [name + guide.CHECKPOINTING for name in ("DDP", "FSDP full sharding")
                 if state[name] + 0.1 * gpu_gb + 0.1 * gpu_gb <= gpu_gb]
        choice = guide.recommend(params, gpu_gb, 8, host_memory_gb=0).choice
        assert choice == (fits[0] if fits else guide.BEYOND), (params, gpu_gb, choice, fits)


def test_offload_is_bounded_by_host_ram_not_by_the_gpus():
    """Offload puts the fp32 weight and gradient shards (pinned) and Adam's moments in host RAM: 16 bytes per
    parameter on each node, whatever the GPUs hold. 70B on one node needs 1,120 GB of it."""
    advice = guide.recommend(70e9, MEM, 8)
    assert advice.host_gb_per_node == pytest.approx(1120) and advice.host_budget_gb == pytest.approx(HOST)
    assert advice.choice == "more GPUs or fewer bytes per parameter" and "1120 GB of host RAM" in advice.reason
    assert guide.recommend(70e9, MEM, 8, host_memory_gb=2000).choice == "FSDP full sharding + CPU offload"
    assert guide.recommend(70e9, MEM, 16, nodes=2).host_gb_per_node == pytest.approx(560)  # two nodes share it
    at_offload = HOST * 1e9 / 16
    assert guide.recommend(at_offload, MEM, 8).choice == "FSDP full sharding + CPU offload"
    assert guide.recommend(at_offload * (1 + EPS), MEM, 8).choice == "more GPUs or fewer bytes per parameter"
    assert "FSDP full sharding + CPU offload" not in advice.gb_per_gpu  # the GPUs hold only the layers computed


def test_when_nothing_fits_the_guide_names_what_would_and_not_a_split_of_the_same_gpus():
    """Model state of 1,120 GB cannot fit 8 GPUs of 80 GB however it is split: tensor and pipeline parallelism
    divide the same 16 bytes per parameter, never below full sharding's 16P/N. The way out it names must fit."""
    advice = guide.recommend(70e9, MEM, 8)
    assert advice.choice == guide.BEYOND and "tensor / pipeline parallelism" not in guide.CHOICES
    assert "1120 GB in all" in advice.reason and "cannot fit it either" in advice.reason
    assert "at least 18 GPUs of 80 GB" in advice.reason and advice.gpus_needed == 18  # 1120 / 64 = 17.5
    assert guide.recommend(70e9, MEM, 18).choice == "FSDP full sharding + activation checkpointing"
    assert guide.recommend(70e9, MEM, 17).choice == guide.BEYOND
    assert "1400 GB of RAM or more" in advice.reason  # 1120 / 0.8
    assert guide.recommend(70e9, MEM, 8, host_memory_gb=1400).choice == "FSDP full sharding + CPU offload"
    assert guide.recommend(70e9, MEM, 8, host_memory_gb=1100).choice == guide.BEYOND  # 880 GB usable < 1120
    assert guide.recommend(70e9, MEM, 8, optimizer="sgd", host_memory_gb=1100).choice == guide.OFFLOAD  # 840 GB
    for gpus in (8, 32, 128):  # the named GPU count is the least that fits, at other sizes too
        for params in (3e11, 1e12):
            beyond = guide.recommend(params, MEM, gpus, host_memory_gb=256)
            if beyond.choice == guide.BEYOND:
                least = int(beyond.reason.split("at least ")[1].split()[0])
                assert least == beyond.gpus_needed
                assert guide.recommend(params, MEM, least, host_memory_gb=256).choice != guide.BEYOND
                assert guide.recommend(params, MEM, least - 1, host_memory_gb=256).choice == guide.BEYOND


def test_the_gpu_count_named_for_70b_is_the_one_its_own_count_accepts():
    """The issue's third bullet. With the rule of thumb, at the named count the model state, 10% of the GPU for
    checkpointed activations and 10% for buffers fit. With Llama 2 70B's shape at 4096 tokens, the checkpointed
    activations are counted (16.6 GB, with a GPU's kernels) and the count is theirs: the same job on that many GPUs,
    on one node or on whole nodes of 8, gets full sharding with checkpointing, never offload; on one GPU fewer,
    nothing fits."""
    from dtlib.sim.llama import LLAMA

    guessed = guide.recommend(70e9, MEM, 8).gpus_needed
    at, fewer = (guide.model_state_gb(70e9, gpus)["FSDP full sharding"] for gpus in (guessed, guessed - 1))
    assert at + 0.1 * MEM + 0.1 * MEM <= MEM < fewer + 0.1 * MEM + 0.1 * MEM
    job = {"shape": LLAMA["70B"], "tokens_per_gpu": 4096}
    params = LLAMA["70B"].params
    advice = guide.recommend(params, MEM, 8, **job)
    assert advice.choice == guide.BEYOND and f"at least {advice.gpus_needed} GPUs" in advice.reason
    least = advice.gpus_needed
    assert least == 20  # 1104 GB over 72 - 16.6 = 55.4 GB per GPU: 19.9
    checkpointed = advice.activation_gb["with checkpointing"]
    assert guide.model_state_gb(params, least)["FSDP full sharding"] + checkpointed <= USABLE
    assert guide.recommend(params, MEM, least, **job).choice == "FSDP full sharding + activation checkpointing"
    assert guide.recommend(params, MEM, least - 1, **job).choice == guide.BEYOND
    nodes = -(-least // 8)
    assert guide.recommend(params, MEM, nodes * 8, nodes=nodes, **job).choice == \
        "FSDP full sharding + activation checkpointing"
    assert guide.recommend(params, MEM, 16, nodes=2, **job).choice == guide.OFFLOAD  # 16 GPUs are too few


def test_hsdp_across_nodes_when_one_node_can_hold_a_full_shard_set():
    gpus, nodes = 16, 2
    at_hsdp = _params_for(BUDGET, 16 / (gpus // nodes))  # ZeRO-3 within one node of 8
    assert at_hsdp > _params_for(BUDGET, 2 + 16 / gpus)  # beyond no reshard over all 16: HSDP's rule decides
    assert guide.recommend(at_hsdp, MEM, gpus, nodes=nodes).choice == "HSDP"
    assert guide.recommend(at_hsdp * (1 + EPS), MEM, gpus, nodes=nodes).choice == "FSDP full sharding"
    assert guide.recommend(at_hsdp, MEM, gpus, nodes=1).choice == "FSDP full sharding"  # one node: no HSDP


def _ddp_bytes_at_end_of_forward(rank: int, world_size: int) -> dict[str, float]:
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import dtlib
    from dtlib.measure.peak import PeakTracker

    device = dtlib.rank_device()
    per_param = {}
    for autocast in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(16, 512), *[nn.Linear(512, 512, bias=False) for _ in range(4)]).to(device)
        optimizer = torch.optim.AdamW(model.parameters())
        tokens = torch.tensor([[rank]], device=device)
        with PeakTracker(model, optimizer) as held:
            ddp = DDP(model)
            for _ in range(2):  # no zero_grad: the first step's gradients are there at the second's forward
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                    loss = ddp(tokens).float().square().mean()
                at_end_of_forward = held.live()
                loss.backward()
                optimizer.step()
        per_param["bf16 autocast" if autocast else "fp32"] = at_end_of_forward / sum(p.numel() for p in
                                                                                   model.parameters())
    return per_param


@pytest.mark.timeout(180)
def test_ddp_under_bf16_autocast_holds_the_bytes_the_guide_counts():
    """Measured on two gloo ranks with PeakTracker at the end of forward, the gradients of the step before kept
    (as in gradient accumulation): fp32 weights, gradients, AdamW's moments and DDP's buckets, 20 bytes per
    parameter; under bf16 autocast also a bf16 copy of each linear layer's weight, which autograd keeps for
    backward: 2 bytes for each parameter autocast casts. The embedding stays fp32 and keeps no copy."""
    import dtlib

    measured = dtlib.spawn(_ddp_bytes_at_end_of_forward, world_size=2, output="none")[0]
    linear = 4 * 512 * 512 / (4 * 512 * 512 + 16 * 512)  # the share of parameters that autocast casts
    assert measured["fp32"] == pytest.approx(guide.model_state_gb(1, 2, mixed_precision=False)["DDP"] * 1e9,
                                             abs=0.02)
    assert measured["bf16 autocast"] == pytest.approx(20 + 2 * linear, abs=0.02)
    assert guide.model_state_gb(1, 2)["DDP"] * 1e9 == pytest.approx(22)  # what the guide counts: 2 for every one
    assert measured["bf16 autocast"] <= 22


def test_the_arithmetic_comes_with_the_answer():
    advice = guide.recommend(7e9, 80, 8)
    assert advice.gb_per_gpu["DDP"] == pytest.approx(memory.estimate(7e9, 8, "ddp") / 1e9 + 4 * 7 + 2 * 7)
    assert advice.gb_per_gpu["DDP"] == pytest.approx(154)  # 16 + 4 of buckets + 2 of bf16 copies, 7B of each
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


def test_tokens_per_gpu_without_a_shape_is_refused_not_ignored():
    """The issue's fourth bullet: the tokens alone do not say how many bytes each needs, so they must not
    vanish silently; the error names what to add."""
    from dtlib.sim.llama import LLAMA

    with pytest.raises(ValueError, match="tokens_per_gpu counts the activations only with the model's shape"):
        guide.recommend(7e9, 80, 8, tokens_per_gpu=8192)
    with pytest.raises(ValueError, match="not both"):
        guide.recommend(7e9, 80, 8, shape=LLAMA["7B"], tokens_per_gpu=4096, activation_gb=10)
    with pytest.raises(ValueError, match="tokens_per_gpu counts"):
        checks.strategy_choice("DDP", 7e9, 80, 8, tokens_per_gpu=8192)


@pytest.mark.parametrize("call, match", [
    (lambda: guide.recommend(0, 80, 8), "num_params and gpu_memory_gb must be > 0"),
    (lambda: guide.recommend(1e9, 80, 6, nodes=4), "split evenly"),
    (lambda: guide.recommend(1e9, 80, 8, optimizer="lion"), "optimizer must be one of"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


NOT_FINITE = [float("nan"), float("inf"), float("-inf")]


@pytest.mark.parametrize("argument", ["num_params", "gpu_memory_gb", "num_gpus", "nodes", "host_memory_gb",
                                      "activation_gb", "inter_node_gb_per_s"])
def test_nan_and_infinity_are_refused_by_name(argument):
    """NaN compares False with everything, so without a check it slips past every rule into a confident answer."""
    for value in NOT_FINITE:
        arguments = {"num_params": 7e9, "gpu_memory_gb": 80, "num_gpus": 8, "nodes": 1, "host_memory_gb": 1000,
                     "activation_gb": 10, "inter_node_gb_per_s": 50, argument: value}
        with pytest.raises(ValueError, match=f"{argument} must be a finite number"):
            guide.recommend(arguments.pop("num_params"), arguments.pop("gpu_memory_gb"), arguments.pop("num_gpus"),
                            **arguments)


@pytest.mark.parametrize("call, match", [
    (lambda: guide.recommend(1e9, 80, 8.5), "num_gpus must be a whole number"),
    (lambda: guide.recommend(1e9, 80, 8, inter_node_gb_per_s=0), "inter_node_gb_per_s must be > 0"),
    (lambda: guide.recommend(1e9, 80, 8, host_memory_gb=-1), "host_memory_gb must be >= 0"),
    (lambda: guide.largest_model("FSDP full sharding + CPU offload"), "choice must be one of"),
    (lambda: guide.largest_model("DDP", gpu_memory_gb=float("nan")), "gpu_memory_gb must be a finite number"),
    (lambda: guide.largest_model("DDP", num_gpus=float("inf")), "num_gpus must be a finite number"),
    (lambda: guide.cross_node_gb(float("nan"), 16, 2), "num_params must be a finite number"),
    (lambda: guide.model_state_gb(1e9, 8, nodes=float("nan")), "nodes must be a finite number"),
    (lambda: checks.strategy_choice("DDP", float("inf"), 80, 8), "num_params must be a finite number"),
])
def test_other_bad_numbers(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_whole_numbers_of_any_type_are_accepted():
    import numpy as np

    assert guide.recommend(7e9, 80, np.int64(8), nodes=np.int64(1)).choice == guide.recommend(7e9, 80, 8).choice
    assert guide.recommend(7e9, 80.0, 8.0).choice == guide.recommend(7e9, 80, 8).choice


def test_cross_node_bytes_by_hand():
    p, n, nodes = 1e9, 16, 2
    across = guide.cross_node_gb(p, n, nodes)
    # per GPU link: a ring over all 16 crosses once per node, its volume split over the node's 8 links
    assert across["DDP"] == pytest.approx(2 * 15 / 16 * 4 / 8)  # all-reduce of fp32 gradients over all 16
    assert across["FSDP, no reshard after forward"] == pytest.approx(15 / 16 * (2 + 4) / 8)  # bf16 AG, fp32 RS
    assert across["FSDP full sharding"] == pytest.approx(15 / 16 * (2 * 2 + 4) / 8)  # gathered twice
    assert across["HSDP"] == pytest.approx(2 * 1 / 2 * 4 / 8)  # only the shard's all-reduce, 2 replicas
    assert across["DDP"] / across["HSDP"] == pytest.approx(15 / 16 * 2)  # (N-1)/N x r/(r-1): not g times
    four = guide.cross_node_gb(p, 32, 4)
    assert four["DDP"] / four["HSDP"] == pytest.approx(31 / 32 * 4 / 3)  # less on more nodes
    assert set(guide.cross_node_gb(p, 8, 1).values()) == {0.0}  # one node: nothing crosses nodes
    fp32 = guide.cross_node_gb(p, n, nodes, mixed_precision=False)
    assert fp32["FSDP full sharding"] / fp32["DDP"] == pytest.approx(1.5)  # notebook 06's measured ratios
    assert fp32["FSDP, no reshard after forward"] / fp32["DDP"] == pytest.approx(1.0)


def test_a_slow_link_between_nodes_moves_the_choice_to_hsdp():
    slow = guide.SLOW_LINK_GB_PER_S * (1 - EPS)
    for params, usual in ((1e9, "DDP"), (7e9, "FSDP, no reshard after forward")):
        assert guide.recommend(params, MEM, 16, nodes=2).choice == usual  # 50 GB/s per GPU: fast
        assert guide.recommend(params, MEM, 16, nodes=2, inter_node_gb_per_s=guide.SLOW_LINK_GB_PER_S).choice == usual
        advice = guide.recommend(params, MEM, 16, nodes=2, inter_node_gb_per_s=slow)
        assert advice.choice == "HSDP" and f"{usual} would send" in advice.reason, advice.reason
        assert guide.recommend(params, MEM, 8, inter_node_gb_per_s=slow).choice == usual  # one node: no link
    # HSDP must still fit: 40B needs 80 GB per GPU sharded within a node of 8, so full sharding over both
    assert guide.recommend(40e9, MEM, 16, nodes=2, inter_node_gb_per_s=1.5).choice == "FSDP full sharding"


def test_the_batch_you_want_decides_through_the_activations():
    """A larger batch needs more activation memory; sharding frees room for it."""
    assert guide.recommend(1e9, MEM, 8).choice == "DDP"  # 22 GB of model state, within the 48 GB budget
    room = USABLE - DDP_BYTES  # what DDP leaves: 50 GB
    assert guide.recommend(1e9, MEM, 8, activation_gb=room).choice == "DDP"
    bigger = guide.recommend(1e9, MEM, 8, activation_gb=room * (1 + EPS))
    assert bigger.choice == "FSDP, no reshard after forward" and bigger.budget_gb < room
    assert bigger.activation_room_gb["FSDP, no reshard after forward"] == pytest.approx(72 - 4)  # 2P + 16P/8 = 4
    assert f"with {room * (1 + EPS):.1f} GB of activations it uses" in bigger.reason


def test_largest_model_inverts_the_formulas():
    assert guide.largest_model("DDP") == pytest.approx(BUDGET * 1e9 / DDP_BYTES)  # 2.18B on 80 GB
    assert guide.largest_model("DDP", mixed_precision=False) == pytest.approx(BUDGET * 1e9 / 20)
    assert guide.largest_model("FSDP, no reshard after forward") == pytest.approx(BUDGET * 1e9 / (2 + 16 / 8))
    assert guide.largest_model("FSDP full sharding") == pytest.approx(BUDGET * 1e9 / 2)
    assert guide.largest_model("HSDP", num_gpus=8, nodes=2) == pytest.approx(BUDGET * 1e9 / 4)
    for choice in guide.ON_GPU:  # at the largest size, the choice's model state is the budget exactly
        size = guide.largest_model(choice)
        assert guide.model_state_gb(size, 8)[choice] == pytest.approx(BUDGET)


# -- notebook 06's exercise checker --------------------------------------------------------------


def test_strategy_choice_accepts_what_recommend_picks():
    for params in (1e9, 4e9, 7e9, 20e9, 100e9, 1e12):
        advice = guide.recommend(params, MEM, 8)
        assert checks.strategy_choice(advice.choice, params, MEM, 8).ok


@pytest.mark.parametrize("params, answer, nodes, fragments", [
    # 20e9 on one node of 8: HSDP's 40 GB fits 56 GB; what rules it out is that there is one node
    (20e9, "HSDP", 1, ["one node", "nothing to replicate across"]),
    # a replica of 3e9 needs 66 GB (22 bytes each): more than checkpointing's 64 GB, not only than 48 GB
    (3e9, "DDP + activation checkpointing", 1, ["needs 66.0 GB", "64.0 GB budget",
                                                "10% for buffers and 10% for activations, checkpointed"]),
    (3e9, "DDP", 1, ["needs 66.0 GB", "48.0 GB budget", "10% for buffers and 30% for activations"]),
    (20e9, "FSDP, no reshard after forward", 1, ["needs 80.0 GB", "48.0 GB budget"]),  # 2 x 20 + 16 x 20 / 8
    (70e9, "FSDP full sharding + CPU offload", 1, ["needs 1120.0 GB of host RAM per node", "800.0 GB usable"]),
    (1e9, "FSDP full sharding", 1, ["would fit, but a simpler strategy fits too: DDP"]),
    (40e9, "FSDP full sharding + activation checkpointing", 1, ["needs 80.0 GB", "64.0 GB budget", "checkpointed"]),
    (30e9, "FSDP full sharding", 1, ["needs 60.0 GB", "48.0 GB budget", "30% for activations"]),
    (30e9, "more GPUs or fewer bytes per parameter", 1, ["these GPUs can hold this model",
                                                         "FSDP full sharding + activation checkpointing fits"]),
    (20e9, "FSDP", 1, ["'FSDP, no reshard after forward', 'HSDP'"]),  # each choice quoted: one has a comma
])
def test_strategy_choice_gives_the_true_reason(params, answer, nodes, fragments):
    feedback = checks.strategy_choice(answer, params, MEM, 8, nodes=nodes)
    assert not feedback.ok
    for fragment in fragments:
        assert fragment in feedback.message, feedback.message
    if answer == "HSDP":
        assert "budget" not in feedback.message, feedback.message


@pytest.mark.parametrize("nodes", [1, 2, 8])
def test_strategy_choice_says_more_than_the_budget_only_when_it_is_more(nodes):
    """Every "needs X GB ... more than the Y GB budget" over a sweep of sizes has X > Y, and Y is the budget
    of that choice: the GPU minus 10% for buffers and 10% for activations with checkpointing, 30% without."""
    import re

    said = 0
    for params in [10 ** (e / 4) for e in range(32, 50)]:  # 1e8 .. 3e12 parameters
        for answer in guide.CHOICES:
            message = checks.strategy_choice(answer, params, MEM, 8, nodes=nodes).message
            found = re.search(r"needs ([\d.]+) GB of model state per GPU, more than the ([\d.]+) GB budget", message)
            if found:
                said += 1
                assert float(found[1]) > float(found[2]), message
                tight = answer.endswith(guide.CHECKPOINTING)
                assert float(found[2]) == pytest.approx(TIGHT if tight else BUDGET), message
    assert said > 0


# -- real jobs: activations counted, DDP's buckets, the network -------------------------------------------------


def test_a_1_3b_job_on_two_24_gb_gpus_gets_fsdp_without_resharding_not_ddp_with_checkpointing():
    """DDP under bf16 autocast holds 22 bytes per parameter (28.6 GB), over the GPU whatever the activations;
    FSDP without resharding needs 13 GB, recomputes nothing and sends 25% fewer bytes than DDP."""
    from dtlib.sim.llama import Shape

    gpt_xl = Shape(layers=24, hidden=2048, heads=16, kv_heads=16, ffn=5504)  # a Llama-like 1.3B
    for job in ({}, {"shape": gpt_xl, "tokens_per_gpu": 2048}):
        advice = guide.recommend(1.3e9, 24, 2, **job)
        assert advice.choice == "FSDP, no reshard after forward", advice
        assert advice.gb_per_gpu["DDP"] == pytest.approx(28.6) and advice.gb_per_gpu[advice.choice] == pytest.approx(13)
    seconds = guide.network_seconds(1.3e9, 2)
    assert seconds["FSDP, no reshard after forward"] == pytest.approx(0.75 * seconds["DDP"])


def test_a_70b_job_on_64_gpus_needs_checkpointing_because_of_its_activations_and_says_its_network_time():
    from dtlib.sim.llama import LLAMA

    job = {"nodes": 8, "shape": LLAMA["70B"], "tokens_per_gpu": 4096, "inter_node_gb_per_s": 1.5}
    advice = guide.recommend(LLAMA["70B"].params, MEM, 64, **job)
    assert advice.choice == "FSDP full sharding + activation checkpointing", advice
    assert advice.activation_gb["without checkpointing"] > 110  # Korthikanti's count for this block: about 118
    assert "the activations (119.1 GB per GPU) do not fit beside FSDP full sharding" in advice.reason
    assert advice.network_s[advice.choice] == pytest.approx(46, abs=1)  # 69 GB per GPU across nodes at 1.5 GB/s
    assert "s of communication per step" in advice.reason


def test_activations_larger_than_the_gpu_are_never_offered_offload():
    from dtlib.sim.llama import LLAMA

    advice = guide.recommend(LLAMA["7B"].params, MEM, 8, shape=LLAMA["7B"], tokens_per_gpu=131_072,
                             host_memory_gb=100_000)
    assert advice.choice == guide.TOKENS and advice.activation_gb["with checkpointing"] > MEM
    assert "no data-parallel strategy and no offload cuts them" in advice.reason
    assert "context parallelism" in advice.reason
    job = {"shape": LLAMA["7B"], "tokens_per_gpu": 131_072}
    assert checks.strategy_choice(guide.TOKENS, LLAMA["7B"].params, MEM, 8, **job).ok
    more = checks.strategy_choice(guide.BEYOND, LLAMA["7B"].params, MEM, 8, **job)
    assert not more.ok and "more GPUs do not help here" in more.message
    fewer = checks.strategy_choice(guide.TOKENS, LLAMA["7B"].params, MEM, 8, shape=LLAMA["7B"], tokens_per_gpu=4096)
    assert not fewer.ok and "need not be cut or split" in fewer.message


def test_measured_activations_without_checkpointing_rule_checkpointing_out_and_say_so():
    advice = guide.recommend(30e9, MEM, 8, activation_gb=20)
    assert advice.choice == guide.OFFLOAD and "keep the activations" in advice.reason
    said = checks.strategy_choice("FSDP full sharding + activation checkpointing", 30e9, MEM, 8, activation_gb=20)
    assert not said.ok and "measure with it on" in said.message


@pytest.mark.parametrize("activations", ["a Llama-like shape of this size", "30% rule of thumb", "Llama 2 70B"])
def test_the_calculator_takes_the_optimizer_the_precision_and_the_activations(activations, monkeypatch):
    import matplotlib.pyplot as plt

    from dtlib import plots

    shown = []
    monkeypatch.setattr(plt, "show", lambda: shown.append(plt.gcf().axes[0].get_title()))
    calculator = plots.guide_calculator()
    calculator.f(params_b=7, gpu_memory_gb=80, num_gpus=64, nodes=8, host_memory_gb=1000, inter_node_gb_per_s=1.5,
                 optimizer="sgd", precision="fp32", activations=activations, tokens_per_gpu=4096)
    plt.close("all")
    assert "sgd, fp32" in shown[-1]  # the first drawing is the defaults
    assert ("activations" in shown[-1]) == (activations != "30% rule of thumb")
    assert ("69B parameters" in shown[-1]) == (activations == "Llama 2 70B")
    calculator.f(params_b=7, gpu_memory_gb=80, num_gpus=64, nodes=8, host_memory_gb=1000, inter_node_gb_per_s=1.5,
                 optimizer="sgd", precision="fp32", activations=activations, tokens_per_gpu=8192)
    plt.close("all")
    assert (shown[-1] != shown[-2]) == (activations != "30% rule of thumb")  # the tokens move the figure
