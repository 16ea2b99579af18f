"""dtlib.checks.cluster (notebook 14): its verdicts come from its own simulations, whatever a learner did to the
results a cell holds. On the tiny Llama, with a GPU sized between two answers' simulated peaks, so that the
right answer is known without the 7B's and 70B's minutes (tests/checks/test_answers.py runs those)."""

from __future__ import annotations

import dataclasses

import pytest

from dtlib import checks
from dtlib.sim.llama import LLAMA
from dtlib.sim.step import Simulated, simulate


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
