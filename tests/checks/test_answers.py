"""dtlib.checks.answers: a backend (notebook 00), the bytes of FSDP's model state (05) and a strategy (06),
typed into a cell; the right answers written several ways and one of each kind of wrong answer."""

from __future__ import annotations

import re
from decimal import Decimal

import numpy as np
import pytest
import torch
import torch.distributed as dist
from verdicts import assert_verdict

from dtlib import checks
from dtlib.launch.spawn import resolve_backend

# -- notebook 00: the backend "auto" picks ------------------------------------------------------


_PICKED = resolve_backend("auto", 2)
_NOT_PICKED = "nccl" if _PICKED == "gloo" else "gloo"
BACKEND = [
    (_PICKED, True, "Right"),
    (_PICKED.upper(), True, "Right"),
    (f"  {_PICKED.capitalize()}\n", True, "Right"),  # as typed, with spaces and a capital
    (dist.Backend(_PICKED), True, "Right"),  # torch's own constant
    (None, False, "No answer yet"),
    (42, False, "as a string, one of: 'gloo', 'nccl' (not int)"),
    (["gloo"], False, "not list"),
    ("tcp", False, "not a backend name"),
    ("mpi", False, "'auto' never picks it"),
    ("ucc", False, "experimental backend"),
    ("auto", False, "the question is which backend it then picks"),
    ("cpu", False, "is a device, not a backend"),
    ("cuda", False, "(nccl is the one for cuda tensors)"),
    ("gloo or nccl", False, "Pick one"),
    (_NOT_PICKED, False, "GPU"),
]


@pytest.mark.parametrize(("answer", "ok", "fragment"), BACKEND)
def test_backend_choice(answer, ok, fragment):
    assert_verdict(checks.backend_choice(answer, world_size=2), ok, [fragment])


def test_the_backend_bank_holds_many_kinds():
    assert sum(ok for _, ok, _ in BACKEND) >= 3 and len({said for _, ok, said in BACKEND if not ok}) >= 8


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="needs a machine with fewer than 2 GPUs")
def test_backend_choice_says_why_nccl_is_wrong_without_gpus():
    assert_verdict(checks.backend_choice("nccl", world_size=2), False, ["one CUDA GPU per rank"])



# -- notebook 05: bytes of model state under FULL_SHARD, and the wrap ---------------------------------

FULL_SHARD_BYTES = 16 * 28_064 / 4  # 112,256: 16 bytes per fp32 parameter with Adam, sharded over 4 ranks


@pytest.mark.parametrize(
    ("answer", "ok", "fragments"),
    [
        (FULL_SHARD_BYTES, True, ["112,256 bytes per rank"]),
        (int(FULL_SHARD_BYTES), True, ["112,256 bytes per rank"]),
        (FULL_SHARD_BYTES / 1e6, False, ["0.112256 looks like the answer in MB", "112,256 bytes", "in bytes"]),
        (FULL_SHARD_BYTES / 2**20, False, ["the answer in MiB", "112,256 bytes"]),
        (FULL_SHARD_BYTES / 2**30, False, ["the answer in GiB", "112,256 bytes"]),
        (16 * 28_064 / 1e3, False, ["looks like KB", "449,024 bytes", "as DDP does"]),
        (16 * 28_064, False, ["449,024 bytes: that is every rank holding everything"]),
        (0.2, False, ["0.2 bytes is off by a factor of 1.78e-06"]),
        (None, False, ["No answer yet"]),
        ("112256", True, ["112,256 bytes per rank"]),  # typed as text: the same number (dtlib.checks.typed)
        ("112,256 bytes", True, ["112,256 bytes per rank"]),
        (Decimal(112256), True, ["112,256 bytes per rank"]),
        ("about 112 kB", False, ["not the text 'about 112 kB'"]),
        (np.int64(FULL_SHARD_BYTES), True, ["112,256 bytes per rank"]),  # computed with numpy
        (torch.tensor(16 * 28_064) / 4, True, ["112,256 bytes per rank"]),  # or with torch
        (4 * 28_064 / 4, False, ["counts the parameters only"]),
        (12 * 28_064 / 4, False, ["misses the gradients"]),
        (float("nan"), False, ["Answer with a finite number of bytes, not nan"]),
        (-FULL_SHARD_BYTES, False, ["a positive count"]),
    ],
)
def test_fsdp_memory(answer, ok, fragments):
    feedback = checks.fsdp_memory(answer)
    assert_verdict(feedback, ok, fragments)
    assert not re.search(r"(^|\s)0 bytes|factor of 0\.00", feedback.message)  # no small number shown as 0


# -- notebook 06: the strategy for 13B parameters on 8 GPUs of 80 GB --------------------------------------------

#: (answer, right, what the message must say): the job is notebook 06's, 13e9 parameters on one node of 8 x 80 GB
STRATEGY = [
    ("FSDP full sharding", True, ["Right: FSDP full sharding", "26.0 GB per GPU"]),
    ("ZeRO-3", True, ["Right"]),  # the ZeRO paper's name (dtlib.checks.answers.STRATEGY_SYNONYMS)
    ("FULL_SHARD", True, ["Right"]),  # FSDP1's enum
    *((name, True, ["Right"]) for name in ("fully_shard", "ZeRO stage 3", "FSDP, full sharding", "FSDP full sharding.",
                                           "full sharding")),  # review: refused; FSDP2's call, the ZeRO paper's stage
    ("DDP", False, ["DDP needs 286.0 GB of model state per GPU, more than the 48.0 GB budget"]),
    ("ZeRO-2", False, ["FSDP, no reshard after forward needs 52.0 GB"]),  # a synonym, read as its strategy
    ("FSDP full sharding + activation checkpointing", False, ["fits without recomputing every block's forward"]),
    ("HSDP", False, ["this job has one node"]),
    ("fsdp", False, ["'fsdp' is none of them"]),  # not one strategy: FSDP has several
    ("tensor parallel", False, ["'tensor parallel' is none of them"]),  # not a choice the guide weighs
    (None, False, ["No answer yet"]),
    (3, False, ["as a string", "(not int)"]),
]


@pytest.mark.parametrize(("answer", "ok", "fragments"), STRATEGY)
def test_strategy_choice(answer, ok, fragments):
    assert_verdict(checks.strategy_choice(answer, 13e9, 80, 8), ok, fragments)


def test_a_strategy_that_fits_is_refused_where_a_simpler_one_fits_too():
    assert_verdict(checks.strategy_choice("FSDP full sharding", 1e9, 80, 8), False,
                   ["would fit, but a simpler strategy fits too: DDP"])


def test_the_strategy_bank_holds_many_kinds():
    assert sum(ok for _, ok, _ in STRATEGY) >= 3 and len({tuple(says) for _, ok, says in STRATEGY if not ok}) >= 8
