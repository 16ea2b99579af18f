"""dtlib.checks.predictions: predict, then measure.

Oracles: the ring simulator's bytes (one process, no torch.distributed) for the ring's measurement on real ranks;
torch's own DDP, its all-reduces counted as the dispatcher sees them, for the runner's count; the ZeRO formula
(12 bytes per parameter over the ranks) for the simulated model state; notebook 15's trace (proven against live
ranks in test_stepping_checker.py) for FSDP's all-gathers; for the verdicts,
guesses of every kind a learner types (right, near, off by a telling factor, off by another, text, nothing, a
fraction of a count).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dtlib.checks import measured, predictions
from dtlib.checks.predictions import PREDICTIONS, Prediction, judge

FIXED = Prediction(question="How many?", unit="MiB", measure=lambda: 1.5, why="Because.",
                   hints=((2.0, "Twice: the naive way."),))
COUNT = dataclasses.replace(FIXED, unit="calls", whole=True, measure=lambda: 2)


@pytest.mark.parametrize("guess", ["1.5", 1.5, "1.5 MiB", " 1.5 ", "1.52", 1.45, torch.tensor(1.5), "3/2", " 3 / 2"])
def test_a_guess_within_the_tolerance_is_right_whatever_its_form(guess):
    verdict = judge(FIXED, guess, 1.5)
    assert verdict.ok, verdict
    assert "this machine measured 1.5 MiB" in verdict.message and verdict.message.endswith("Because.")


@pytest.mark.parametrize(("guess", "said"), [
    ("3", "Yours is 2 times the measurement. Twice: the naive way. Because."),  # a telling factor: its hint
    ("0.75", "Yours is the measurement divided by 2. Because."),  # no hint for this factor: the reason alone
    ("1.6", "Yours is 7% above the measurement. Because."),  # just past the tolerance
    ("1.2", "Yours is 20% below the measurement. Because."),
    ("-1.5", "this machine measured 1.5 MiB. Because."),  # no factor between numbers of other signs
    ("0", "this machine measured 1.5 MiB. Because."),
])
def test_a_wrong_guess_is_told_how_far_off_and_why(guess, said):
    verdict = judge(FIXED, guess, 1.5)
    assert not verdict.ok and verdict.message.endswith(said), verdict


@pytest.mark.parametrize(("guess", "said"), [
    ("", "Type your prediction first, a number of MiB, then measure."),
    (None, "Type your prediction first"),
    ("a lot", "Predict a number of MiB, not the text 'a lot'."),
    ("1.5 GiB", "not the text '1.5 GiB'"),  # another unit is not read as this one
    ("3/0", "not the text '3/0'"),
    ("3/2 MiB", "not the text '3/2 MiB'"),  # a fraction is read bare, as a number; with a unit it is text
])
def test_what_is_not_a_number_of_the_unit_is_refused_by_name(guess, said):
    verdict = judge(FIXED, guess, 1.5)
    assert not verdict.ok and said in verdict.message, verdict


def test_a_count_must_be_exact_and_whole():
    assert judge(COUNT, "2", 2).ok
    assert not judge(COUNT, "2.5", 2).ok and "whole number of calls, not 2.5" in judge(COUNT, "2.5", 2).message
    assert not judge(COUNT, 3, 2).ok  # within no tolerance: a count is right or wrong
    assert "You predicted 3; this machine measured 2 calls." in judge(COUNT, 3, 2).message


def test_every_prediction_has_a_question_a_unit_a_reason_and_hints_for_factors_other_than_one():
    for name, prediction in PREDICTIONS.items():
        assert prediction.question.endswith("?") and prediction.why, name
        assert prediction.unit or not prediction.how_far, f"{name}: only a name (a rank) has no unit"
        assert all(factor > 0 and factor != 1 for factor, _ in prediction.hints), name


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
    from dtlib.checks import stepping

    traced = ["AG0", "AG1", "AG2", "AG2", "AG1", "RS2", "AG0", "RS1", "RS0"]  # torch 2.13's, on live ranks
    monkeypatch.setattr(stepping, "observed", lambda: tuple(
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


def test_the_simulated_jobs_waste_is_within_a_point_of_the_exact_expectation():
    from dtlib.sim import failures

    exact = 100 * failures.waste(3600, 4 * 3600, checkpoint_s=60, restart_s=300)
    assert PREDICTIONS["job waste"].measure() == pytest.approx(exact, abs=1.0)
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


def test_a_counts_hint_is_shown_for_its_own_number_only():
    numbers = PREDICTIONS["numbers on rank 0"]
    assert "cuts the norm four ways" in judge(numbers, "4160", 4224).message
    assert "Yours is 1% below the measurement. The Linear" in judge(numbers, "4200", 4224).message  # no hint


def test_numbers_are_shown_as_a_person_reads_them():
    assert "You predicted 1,536; this machine measured 1,542 copies." in judge(
        dataclasses.replace(FIXED, unit="copies"), "1536", 1542.0).message


def test_the_widget_asks_measures_once_and_judges_every_guess(monkeypatch, capsys):
    pytest.importorskip("ipywidgets")
    calls = []
    monkeypatch.setitem(PREDICTIONS, "fixed", dataclasses.replace(FIXED, measure=lambda: calls.append(1) or 1.5))
    box = predictions.predict("fixed")
    assert "dtlib-prediction" in box._dom_classes and "How many?" in box.children[0].value
    guess, button = box.children[1].children
    guess.value = "3"
    button.click()
    guess.value = "1.5"
    button.click()
    shown = capsys.readouterr().out  # outside a kernel, the output widget lets prints through
    assert "✗ You predicted 3;" in shown and "✓ You predicted 1.5;" in shown and len(calls) == 1


def test_a_measurement_that_fails_says_so_and_the_next_press_measures_again(monkeypatch, capsys):
    pytest.importorskip("ipywidgets")
    attempts = []

    def flaky() -> float:
        attempts.append(1)
        if len(attempts) == 1:
            raise TimeoutError("ranks did not answer")
        return 1.5

    monkeypatch.setitem(PREDICTIONS, "flaky", dataclasses.replace(FIXED, measure=flaky))
    guess, button = predictions.predict("flaky").children[1].children
    guess.value = "1.5"
    button.click()
    button.click()
    shown = capsys.readouterr().out
    assert "The measurement failed, so nothing was judged: TimeoutError: ranks did not answer" in shown
    assert "✓ You predicted 1.5;" in shown and len(attempts) == 2


def test_an_unknown_prediction_is_refused_with_the_names_there_are():
    with pytest.raises(ValueError, match="no prediction named 'rings bytes': choose one of"):
        predictions.predict("rings bytes")
