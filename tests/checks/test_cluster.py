"""dtlib.checks.cluster (notebook 14): its verdicts come from its own simulations, whatever a learner did to the
results a cell holds. On the tiny Llama, with a GPU sized between two answers' simulated peaks, so that the
right answer is known without the 7B's and 70B's minutes; the 70B exercise itself is simulated once, for its
model answer and the wrong answer next to it, and its bank of answers is judged against a table of peaks (each
70B layout costs half a minute here, and notebook 14 runs the exercise's own layouts end to end)."""

from __future__ import annotations

import dataclasses

import pytest

from dtlib import checks
from dtlib.checks import cluster
from dtlib.measure.peak import CATEGORIES
from dtlib.sim.llama import LLAMA
from dtlib.sim.step import Layout, Simulated, simulate


def _in_gib_in_place(result: Simulated) -> None:
    """A learner's conversion of the results their cell holds: every byte count divided by 2**30, in place."""
    for category in result.memory:
        result.memory[category] /= 2**30
    result.traffic[:] = [dataclasses.replace(row, payload=row.payload / 2**30, sent=row.sent / 2**30)
                         for row in result.traffic]


def _between(low: int, high: int) -> float:
    """A GPU, in GiB, that holds ``low`` bytes and not ``high``."""
    return (low + high) / 2 / 2**30


@pytest.mark.timeout(300)
def test_largest_micro_batch_judges_its_own_numbers_after_yours_are_converted_to_gib_in_place():
    args = {"dp": 2, "seq_len": 40}  # a layout of this test alone
    mine = {size: simulate(LLAMA["tiny"], micro_batch=size, **args) for size in (1, 2, 3)}
    assert mine[2].peak < mine[3].peak
    gpu_gib = _between(mine[2].peak, mine[3].peak)  # 2 samples fit, 3 do not

    def verdicts() -> list[bool]:
        return [checks.largest_micro_batch(answer, shape="tiny", gpu_gib=gpu_gib, **args).ok for answer in (1, 2, 3)]

    assert verdicts() == [False, True, False]
    for result in mine.values():
        _in_gib_in_place(result)
    assert verdicts() == [False, True, False]


@pytest.mark.timeout(300)
def test_smallest_pipeline_judges_its_own_numbers_after_yours_are_converted_to_gib_in_place():
    args = {"tp": 2, "seq_len": 40, "micro_batches": 2}  # a layout of this test alone
    mine = {pp: simulate(LLAMA["tiny"], pp=pp, checkpointing=True, **args) for pp in (1, 2)}
    assert mine[2].peak < mine[1].peak
    gpu_gib = _between(mine[2].peak, mine[1].peak)  # the tiny model's 2 layers fit in 2 stages, not in 1

    def verdicts() -> list[bool]:
        return [checks.smallest_pipeline(answer, shape="tiny", gpu_gib=gpu_gib, **args).ok for answer in (1, 2)]

    assert verdicts() == [False, True]
    for result in mine.values():
        _in_gib_in_place(result)
    assert verdicts() == [False, True]


@pytest.mark.timeout(300)
def test_the_70b_exercise_simulated_takes_its_model_answer_and_refuses_the_stage_count_below():
    """Llama-2-70B, tp=8 per stage, sequence 8192, checkpointing, 4 micro-batches, 79 GiB: pp=2 peaks at about
    85 GiB, in AdamW's step, pp=4 at about 46 (the two layouts notebook 14's exercise cells simulate); the message
    says when each peaks, not activations of 0.0 GiB beside the claim that they do not divide."""
    right = checks.smallest_pipeline(4)
    assert right.ok, right.message
    assert "Right: with pp=4 (32 GPUs)" in right.message and "pp=2 would peak at" in right.message
    wrong = checks.smallest_pipeline(2)
    assert not wrong.ok and "over the 79 GiB" in wrong.message and "but hardly the activations" in wrong.message
    assert "At pp=2 rank 0 peaks in the optimizer's step" in wrong.message, wrong.message
    assert "At pp=4 rank 0 peaks with 35.8 GiB of model state and 7.5 of activations" in right.message, right.message


#: Rank 0's peak in GiB by pipeline stages, shaped as the 70B exercise's simulations give them: pp=1 and pp=2 over
#: the 79 GiB GPU, pp=4 the fewest that fits.
PEAKS_GIB = {1: 150.0, 2: 81.0, 4: 49.0, 5: 44.0, 8: 33.0}


def _stage_from_table(shape: str, pp: int, tp: int, seq_len: int, micro_batches: int) -> Simulated:
    """A stand-in for the checker's simulation of stage 0: the table's peak, 20 GiB of it activations."""
    memory = dict.fromkeys(CATEGORIES, 0)
    memory["activations"] = 20 * 2**30
    memory["weights"] = round(PEAKS_GIB[pp] * 2**30) - memory["activations"]
    layout = Layout(tp=tp, pp=pp, seq_len=seq_len, micro_batches=micro_batches)
    return Simulated(LLAMA[shape], layout, True, memory, [])


#: (answer, ok, what the message must say)
SMALLEST_PIPELINE = [
    (4, True, ["Right: with pp=4 (32 GPUs)", "pp=2 would peak at 81.0 GiB"]),
    ("4", True, ["Right: with pp=4"]),  # typed as text: the same number (dtlib.checks.typed)
    ("pp 4", True, ["Right: with pp=4"]),  # review: refused while "pp=4" passed
    ("4-stage", True, ["Right: with pp=4"]),
    (4.0, True, ["Right"]),
    (2, False, ["With pp=2, rank 0 peaks at 81.0 GiB", "over the 79 GiB", "but hardly the activations"]),
    (1, False, ["With pp=1, rank 0 peaks at 150.0 GiB"]),
    (8, False, ["pp=8 fits (33.0 GiB)", "but pp=5 fits too"]),
    (5, False, ["pp=5 fits", "but pp=4 fits too (49.0 GiB of 79)"]),
    (3, False, ["cannot split the 80 layers into equal stages"]),
    (0, False, ["cannot split the 80 layers"]),
    (-4, False, ["cannot split the 80 layers"]),
    (2.5, False, ["whole number of pipeline stages"]),
    (None, False, ["No answer yet"]),
    ("four", False, ["Answer with a whole number of pipeline stages, not the text 'four'"]),
]


@pytest.mark.parametrize(("answer", "ok", "fragments"), SMALLEST_PIPELINE)
def test_smallest_pipeline_judges_every_kind_of_answer(monkeypatch, answer, ok, fragments):
    monkeypatch.setattr(cluster, "_stage_0", _stage_from_table)
    feedback = checks.smallest_pipeline(answer)
    assert feedback.ok is ok, feedback.message
    for fragment in fragments:
        assert fragment in feedback.message, feedback.message
