"""dtlib.checks.measured: each prediction's measurement, against an oracle.

The ring simulator's bytes (one process, no torch.distributed) for the ring's measurement on real ranks; torch's
own DDP, its all-reduces counted as the dispatcher sees them, for the runner's count; the ZeRO formula (12 bytes
per parameter over the ranks) for the simulated model state; notebook 15's trace (proven against live ranks in
test_collective_order.py) for FSDP's all-gathers; closed forms for the rest.
"""

from __future__ import annotations

import pytest
import torch

from dtlib.checks import collective_order, measured
from dtlib.checks.predictions import PREDICTIONS, judge


@pytest.mark.timeout(180)
def test_the_rings_bytes_measured_on_real_ranks_are_the_simulators():
    from dtlib.ring import simulate_all_reduce

    simulated = simulate_all_reduce([[0.0] * measured.RING_ELEMENTS] * measured.RING_RANKS,
                                    keep_buffers=False).bytes_sent
    assert PREDICTIONS["ring bytes"].measure() == pytest.approx(max(simulated) / 2**20) == 1.5


def _torch_ddp_all_reduces(rank: int, world_size: int) -> int:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dtlib.measure.counting import count_collectives
    from dtlib.train import data, models

    model = DDP(models.build("wide_mlp", seed=0))
    x, y = (t[rank::world_size] for t in data.for_model("wide_mlp", 64).tensors)

    def step() -> None:
        models.loss_fn("wide_mlp", model(x), y).backward()

    for _ in range(2):
        step()
    return count_collectives(step)[1].get("all_reduce", 0)


@pytest.mark.timeout(180)
def test_ddps_all_reduces_measured_by_the_runner_are_torch_ddps_own():
    from dtlib.launch.spawn import spawn

    assert PREDICTIONS["ddp all-reduces"].measure() == spawn(_torch_ddp_all_reduces, world_size=2)[0] == 2


@pytest.mark.timeout(180)
def test_the_simulated_model_state_is_the_zero_formulas():
    from dtlib.sim.llama import LLAMA

    assert PREDICTIONS["model state"].measure() == pytest.approx(12 * LLAMA["7B"].params / 64 / 2**30, rel=1e-3)


def test_fsdps_all_gathers_are_counted_from_notebook_15s_trace(monkeypatch):

    traced = ["AG0", "AG1", "AG2", "AG2", "AG1", "RS2", "AG0", "RS1", "RS0"]  # torch 2.13's, on live ranks
    monkeypatch.setattr(collective_order, "observed", lambda: tuple(
        ("all_gather" if item[:2] == "AG" else "reduce_scatter", int(item[2])) for item in traced))
    assert PREDICTIONS["fsdp all-gathers"].measure() == 6


def test_hsdps_traffic_is_read_from_the_runners_ddp_and_hsdp_rows(monkeypatch):
    from dtlib.train import fsdp_compare

    asked = []
    monkeypatch.setattr(fsdp_compare, "strategies", lambda world_size, labels: asked.append((world_size, labels))
                        or ["ddp row", "hsdp row"])
    monkeypatch.setattr(fsdp_compare, "bytes_sent_per_rank", {"ddp row": 1.5, "hsdp row": 2.0}.get)
    assert PREDICTIONS["hsdp traffic"].measure() == pytest.approx(4 / 3)  # real rows: tests/train/test_fsdp.py
    assert asked == [(4, ("DDP", "FSDP2 HSDP (2 x 2 mesh)"))]


@pytest.mark.timeout(180)
def test_megatrons_mlp_all_reduces_once_each_way_under_torchs_tensor_parallelism():
    # The oracle: Megatron-LM (Shoeybi et al., 2019), its f and g operators: one all-reduce in forward (after the
    # row-parallel layer) and one in backward (the input's gradient, before the column-parallel layer).
    assert PREDICTIONS["tp all-reduces"].measure() == 2


def test_moe_copies_are_three_quarters_of_the_assignments_and_leave_the_kernels_random_state_alone():
    before = torch.random.get_rng_state()
    copies = PREDICTIONS["moe copies"].measure()
    assert torch.equal(torch.random.get_rng_state(), before)
    assert copies == pytest.approx(measured.MOE_TOKENS * 2 * 3 / 4, rel=0.05)  # 3 of 4 ranks hold 3/4 of experts


def test_the_simulated_jobs_waste_is_within_a_third_of_a_point_of_the_exact_expectation():
    from dtlib.sim import failures

    exact = 100 * failures.waste(3600, 4 * 3600, checkpoint_s=60, restart_s=300)
    assert PREDICTIONS["job waste"].measure() == pytest.approx(exact, abs=0.3)  # a fifth of the smallest cost
    assert judge(PREDICTIONS["job waste"], "15%", PREDICTIONS["job waste"].measure()).ok  # a percent sign is read


@pytest.mark.timeout(180)
def test_a_dtensor_distributed_and_gathered_back_costs_a_scatter_and_an_all_gather():
    # The oracle: torch's DTensor documentation (distribute_tensor scatters from the mesh's first rank;
    # full_tensor all-gathers), and notebook 15's stepper, which shows the two calls by name.
    assert PREDICTIONS["dtensor collectives"].measure() == 2


@pytest.mark.timeout(180)
def test_rank_2_holds_the_sum_of_every_ranks_value_after_a_plain_all_reduce():
    assert PREDICTIONS["all-reduced value"].measure() == sum(rank + 1.0 for rank in range(4))


@pytest.mark.timeout(180)
def test_an_all_gathers_output_holds_every_ranks_input():
    assert PREDICTIONS["gathered bytes"].measure() == 4 * measured.GATHERED * 4 / 1000  # ranks x numbers x bytes


def test_the_torchrun_rank_is_read_from_the_env_records_of_node_1s_second_process(monkeypatch):
    from dtlib.launch import torchrun

    records = [{"RANK": str(group * 2 + local), "GROUP_RANK": str(group), "LOCAL_RANK": str(local)}
               for group in (0, 1) for local in (0, 1)]  # as torchrun numbers them: tests/launch/test_torchrun.py
    monkeypatch.setattr(torchrun, "simulate_nodes", lambda *args, **kwargs: "finished")
    monkeypatch.setattr(torchrun, "env_records", lambda finished: records)
    assert PREDICTIONS["torchrun rank"].measure() == 3
    said = judge(PREDICTIONS["torchrun rank"], "1", 3).message
    assert said.startswith("You predicted 1; this machine measured 3. 1 is")  # a rank is a name: no "% below"


@pytest.mark.timeout(180)
def test_each_rank_of_a_spawned_job_is_a_process_of_its_own():
    assert PREDICTIONS["spawned processes"].measure() == measured.SPAWNED == 3
    assert "counts the notebook's kernel" in judge(PREDICTIONS["spawned processes"], "4", 3).message


def test_a_sampler_never_told_the_epoch_repeats_its_order_and_one_told_it_does_not():
    from torch.utils.data import DistributedSampler

    told = DistributedSampler(range(measured.SAMPLES), num_replicas=2, rank=0, shuffle=True)
    orders = set()
    for epoch in range(3):
        told.set_epoch(epoch)
        orders.add(tuple(told))
    assert len(orders) == 3 and PREDICTIONS["sampler orders"].measure() == 1


@pytest.mark.timeout(180)
def test_1f1b_holds_as_many_micro_batches_on_stage_0_as_there_are_stages():
    # The oracle: PipeDream-Flush (Narayanan et al., 2021): stage s of p holds at most p - s micro-batches.
    assert PREDICTIONS["micro-batches held"].measure() == measured.PIPELINE_STAGES < measured.PIPELINE_MICRO_BATCHES


@pytest.mark.timeout(180)
def test_a_column_parallel_weight_is_cut_by_both_dimensions_and_a_norm_by_dp_only():
    assert PREDICTIONS["numbers on rank 0"].measure() == 256 * 64 // 4 + 256 // 2


@pytest.mark.timeout(180)
def test_ring_attention_sends_each_ranks_kv_block_once_per_step_but_the_last():
    block = 2 * measured.KV_SEQUENCE // measured.RING_RANKS * measured.KV_HEADS * measured.KV_HEAD_DIM * 2  # bf16
    assert PREDICTIONS["ring attention bytes"].measure() == (measured.RING_RANKS - 1) * block / 2**20 == 12
