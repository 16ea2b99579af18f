"""dtlib.checks.typed: a typed answer read as a person means it, and the typed checkers that read through it.

Oracle: the exercise's own names and numbers, written the ways a learner writes them (case, spacing, torch's
enum names, the ZeRO paper's names, Decimal, strings with thousands separators and a unit), against things that
only look alike (another strategy, a number of another unit, text).
"""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch

from dtlib import checks
from dtlib.checks import typed
from dtlib.train import guide

CHOICES = ("DDP", "FSDP full sharding", "FSDP, no reshard after forward")


@pytest.mark.parametrize(("answer", "meant"), [
    ("ddp", "DDP"), ("  DDP\n", "DDP"), ("fsdp full sharding ", "FSDP full sharding"),
    ("Fsdp_Full-Sharding", "FSDP full sharding"), ("FSDP,no reshard after forward", "FSDP, no reshard after forward"),
    ("zero-3", "FSDP full sharding"), ("FULL_SHARD", "FSDP full sharding"),
])
def test_a_choice_is_matched_whatever_its_case_spacing_or_synonym(answer, meant):
    assert typed.choice(answer, CHOICES, {"ZeRO 3": "FSDP full sharding", "full shard": "FSDP full sharding"},
                        "a strategy") == meant


@pytest.mark.parametrize(("answer", "said"), [
    (None, "No answer yet: set `answer` to a strategy, one of: 'DDP', "),
    (3, "Answer with a strategy as a string, one of: 'DDP', "),
    ("FSDP", "Answer with a strategy, one of: 'DDP', "),  # which FSDP? not a name the exercise has
    ("DDPP", "'DDPP' is none of them"),
])
def test_what_matches_no_choice_is_told_so(answer, said):
    result = typed.choice(answer, CHOICES, {}, "a strategy")
    assert not typed.chosen(result, CHOICES) and said in result


@pytest.mark.parametrize(("answer", "value"), [
    (112256, 112256), (112256.0, 112256), (Decimal("112256"), 112256), (Fraction(224512, 2), 112256),
    (np.float32(112256), 112256), (np.int64(112256), 112256), (torch.tensor([112256.0]), 112256),
    ("112256", 112256), ("112,256", 112256), ("112_256", 112256), ("112,256 bytes", 112256), (" 1.12256e5 ", 112256),
    ("0.5", 0.5), (Decimal("0.5"), 0.5),
])
def test_a_number_is_read_however_it_was_written(answer, value):
    read = typed.number(answer, "bytes")
    assert read == value and type(read) is type(value)


@pytest.mark.parametrize(("answer", "said"), [
    (None, "No answer yet"), (True, "not bool"), ("abc", "not the text 'abc'"), ("112 MB", "not the text '112 MB'"),
    ("1,12,256", "not the text"), (float("inf"), "finite"), ([1, 2], "not list"), (torch.ones(2), "not Tensor"),
])
def test_what_is_no_number_is_told_so(answer, said):
    read = typed.number(answer, "bytes")
    assert isinstance(read, str) and said in read, read


@pytest.mark.parametrize("answer", ["fsdp full sharding", "FSDP full sharding ", "Fsdp Full Sharding", "FULL_SHARD",
                                    "ZeRO-3"])
def test_06s_strategy_is_taken_in_any_spelling(answer):
    feedback = checks.strategy_choice(answer, 13e9, 80, 8)
    assert feedback.ok and guide.CHOICES[4] == "FSDP full sharding", feedback.message


def test_06s_synonyms_name_real_choices():
    assert set(checks.answers.STRATEGY_SYNONYMS.values()) <= set(guide.CHOICES)


@pytest.mark.parametrize("answer", [Decimal(112256), "112,256", "112256 bytes", np.float64(112256.0)])
def test_05s_bytes_are_taken_as_any_number(answer):
    assert checks.fsdp_memory(answer).ok


@pytest.mark.parametrize("words", ["--no-python python train.py", "--no-python python3 -u train.py"])
def test_07s_command_may_run_python_itself(words):
    command = f"torchrun --nnodes=2 --nproc_per_node=4 --node_rank=1 --master_addr=10.0.0.1 {words}"
    feedback = checks.torchrun_command(command, nnodes=2, nproc_per_node=4, node_rank=1, master_addr="10.0.0.1")
    assert feedback.ok, feedback.message


def test_07s_no_python_still_needs_the_script():
    command = "torchrun --nnodes=2 --nproc_per_node=4 --node_rank=1 --master_addr=10.0.0.1 --no-python python -m x"
    feedback = checks.torchrun_command(command, nnodes=2, nproc_per_node=4, node_rank=1, master_addr="10.0.0.1")
    assert not feedback.ok


def test_a_number_without_a_unit_is_read_and_refused_without_naming_one():
    # Before, an empty unit cut every string to nothing ("3"[:-0] is ""), and the messages said "of ,".
    assert typed.number("3", "") == 3
    assert typed.number("x", "", whole=True) == "Answer with a whole number, not the text 'x'."


@pytest.mark.parametrize(("answer", "unit", "value"), [
    ("3 samples", "samples per rank", 3), ("3 sample per rank", "samples per rank", 3), ("pp=4", "pipeline stages", 4),
    ("4 stages", "pipeline stages", 4), ("answer: 3", "samples per rank", 3), ("4 micro-batch", "micro-batches", 4),
    ("micro_batch = 3", "samples per rank", 3),
    # review: refused as text, though the unit is spelled as a choice's name may be (typed.key)
    ("32 microbatches", "micro-batches", 32), ("32 micro batches", "micro-batches", 32),
    ("32 micro_batches", "micro-batches", 32), ("3 sequences", "samples per rank", 3),
    ("3 sequences per rank", "samples per rank", 3), ("3 samples/rank", "samples per rank", 3),
    ("pp 4", "pipeline stages", 4), ("4-stage", "pipeline stages", 4), ("1780 s", "seconds", 1780),
    ("1780 sec", "seconds", 1780),
])
def test_a_number_is_read_with_a_name_before_it_and_its_unit_in_a_word_or_two(answer, unit, value):
    """14's right answers were refused as text: "3 samples", "4 stages", "pp=4"."""
    assert typed.number(answer, unit, whole=True) == value


@pytest.mark.parametrize(("answer", "unit"), [("32 GPUs", "pipeline stages"), ("3 per rank", "samples per rank"),
                                              ("112 MB", "bytes"), ("4 stages of 8", "pipeline stages"),
                                              ("27-32", "micro-batches"), ("3 s", "samples per rank")])
def test_another_unit_or_more_words_are_not_read(answer, unit):
    assert isinstance(typed.number(answer, unit, whole=True), str)


@pytest.mark.parametrize("answer", [10**400, -(10**400), "9" * 400, "9" * 5000, Decimal(10**400)],
                         ids=["10**400", "-10**400", "400 digits", "5000 digits", "Decimal(10**400)"])
def test_a_number_past_what_a_float_holds_is_refused_not_raised(answer):
    """Review: 10**400 and a 400-digit string raised OverflowError (math.isfinite on an int past a float)."""
    read = typed.number(answer, "micro-batches", whole=True)
    assert isinstance(read, str) and "that a float can hold (below 1.8e308)" in read, read


def test_a_long_answer_is_cut_with_its_closing_quote():
    """Review: a refusal cut the quoted answer at 60 characters, its closing quote with it."""
    said = typed.choice("FSDP full sharding (ZeRO-3) and then some more words that run on", CHOICES, {}, "a strategy")
    assert said.endswith("'FSDP full sharding (ZeRO-3) and then some more words that...' is none of them."), said
    assert typed.number("x" * 60, "bytes").endswith("'" + "x" * 37 + "...'."), typed.number("x" * 60, "bytes")
