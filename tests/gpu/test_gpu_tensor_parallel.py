"""Notebook 09's own rank functions on GPUs: ``parallelize_module`` on a one-dimensional mesh of the rank's device
type (NCCL), against the one-process block each function builds beside it, and the collectives it counts.

One GPU runs them at world size 1 (a mesh of one CUDA device); with two GPUs, at the notebook's world size,
where the counts and sizes must be those its checked outputs print.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from notebook_code import definitions

import dtlib

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

WORLD = max(1, min(2, torch.cuda.device_count()))  # NVML: this process does not initialise CUDA
NAMES = ["Attention", "Block", "TP_PLAN", "SP_PLAN", "reduce_partial_gradients", "tp_block", "vocab_parallel_loss"]
DIM, BATCH, SEQ = 32, 4, 16  # the notebook's block and batch
SHARDED, WHOLE = 4 * DIM * DIM + (4 * DIM * DIM + 4 * DIM) + 4 * DIM * DIM, DIM + 2 * 2 * DIM  # its formula's terms


def _tensor_parallel(rank: int, world_size: int, tp_block: Callable[..., dict],
                     vocab_parallel_loss: Callable[..., dict], tp_plan: dict, sp_plan: dict) -> dict[str, dict]:
    """The notebook's three runs in one launch: its block under TP, under TP + SP, and the vocabulary-parallel loss."""
    return {"tp": tp_block(rank, world_size, tp_plan), "sp": tp_block(rank, world_size, sp_plan, True),
            "loss": vocab_parallel_loss(rank, world_size)}


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    code = definitions("09_tensor_parallel.ipynb", NAMES)
    args = (code["tp_block"], code["vocab_parallel_loss"], code["TP_PLAN"], code["SP_PLAN"])
    return dtlib.spawn(_tensor_parallel, WORLD, args=args, backend="nccl", output="none", timeout=150)


@pytest.mark.timeout(180)
def test_tp_and_sp_blocks_give_the_one_process_output_and_gradients(reports):
    for rank, report in enumerate(reports):
        for plan in ("tp", "sp"):
            result = report[plan]
            assert result["same output"] and result["same gradients"], (rank, plan, result)
        assert report["tp"]["parameters here"] == SHARDED // WORLD + WHOLE  # the notebook's formula


@pytest.mark.timeout(180)
def test_sequence_parallel_saves_what_the_notebooks_formula_says(reports):
    per_norm = (BATCH * SEQ * DIM + 2 * BATCH * SEQ) * 4  # a LayerNorm keeps its input, its mean and 1/std (fp32)
    tp, sp = reports[0]["tp"], reports[0]["sp"]
    assert tp["saved bytes"] - sp["saved bytes"] == 2 * per_norm * (WORLD - 1) // WORLD, (tp["saved bytes"],
                                                                                           sp["saved bytes"])


@pytest.mark.timeout(180)
def test_loss_parallel_gives_the_one_process_loss(reports):
    for report in reports:
        assert report["loss"]["same loss"], report["loss"]


@pytest.mark.timeout(180)
@pytest.mark.skipif(WORLD < 2, reason="the notebook's counts are for 2 ranks (needs 2 GPUs)")
def test_collectives_are_the_ones_the_notebook_prints(reports):
    tp, sp, loss = reports[0]["tp"], reports[0]["sp"], reports[0]["loss"]
    assert (tp["forward"], tp["backward"]) == ({"all_reduce": 2}, {"all_reduce": 2})
    assert sp["forward"] == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}
    assert sp["backward"] == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2, "all_reduce": 4}
    assert loss["collectives"] == {"all_reduce": 3}
