"""dtlib.checks.softmax_merge (notebook 12): the merge by log-sum-exp passes in any spelling; naive ones fail
where the scores leave float32's or float64's range."""

from __future__ import annotations

import pytest
import torch

from dtlib import checks


def _right_merge(out1, lse1, out2, lse2):
    lse = torch.logaddexp(lse1, lse2)
    return torch.exp(lse1 - lse) * out1 + torch.exp(lse2 - lse) * out2, lse


def _naive_merge(out1, lse1, out2, lse2):
    a, b = torch.exp(lse1), torch.exp(lse2)  # overflows past lse = 88
    return (a * out1 + b * out2) / (a + b), torch.log(a + b)


def _naive_merge_in_float64(out1, lse1, out2, lse2):  # review: passed while the scores stayed in float64's range
    a, b = torch.exp(lse1.double()), torch.exp(lse2.double())  # overflows past lse = 709
    return ((a * out1 + b * out2) / (a + b)).float(), torch.log(a + b).float()


def _shifted_by_a_constant(out1, lse1, out2, lse2):  # neighbour: a fixed shift only moves the range
    a, b = torch.exp(lse1.double() - 500), torch.exp(lse2.double() - 500)
    return ((a * out1 + b * out2) / (a + b)).float(), (torch.log(a + b) + 500).float()


def _relative_to_the_first_block(out1, lse1, out2, lse2):  # neighbour: one difference, unbounded above
    ratio = torch.exp(lse2 - lse1)
    return (out1 + ratio * out2) / (1 + ratio), lse1 + torch.log1p(ratio)


def _right_by_the_maximum(out1, lse1, out2, lse2):  # right, written another way: the larger lse subtracted
    top = torch.maximum(lse1, lse2)
    a, b = torch.exp(lse1 - top), torch.exp(lse2 - top)
    return (a * out1 + b * out2) / (a + b), top + torch.log(a + b)


def _right_by_softmax(out1, lse1, out2, lse2):  # right, written another way: a softmax over the two blocks
    weights = torch.softmax(torch.stack([lse1, lse2]), dim=0)
    return weights[0] * out1 + weights[1] * out2, torch.logsumexp(torch.stack([lse1, lse2]), dim=0)


def _clamped_merge(out1, lse1, out2, lse2):  # review: passed; "keeps exp in float32's range", lse 920 too low
    d = torch.clamp(lse2 - lse1, -80, 80)
    return (1 - torch.sigmoid(d)) * out1 + torch.sigmoid(d) * out2, lse1 + torch.nn.functional.softplus(d)


def _max_lse_merge(out1, lse1, out2, lse2):
    lse = torch.logaddexp(lse1, lse2)
    return torch.exp(lse1 - lse) * out1 + torch.exp(lse2 - lse) * out2, torch.maximum(lse1, lse2)


def _size_weighted_merge(out1, lse1, out2, lse2):
    n1, n2 = 1.0, 1.0  # the keys per block, as a learner might weigh them
    return (n1 * out1 + n2 * out2) / (n1 + n2), torch.logaddexp(lse1, lse2)


def _safe_output_naive_lse(out1, lse1, out2, lse2):  # the output safe, the lse through exp: inf past 709
    lse = torch.logaddexp(lse1, lse2)
    return torch.exp(lse1 - lse) * out1 + torch.exp(lse2 - lse) * out2, torch.log(torch.exp(lse1.double())
                                                                                   + torch.exp(lse2.double())).float()


MERGES = [
    (_right_merge, True, ["a chain of three", "overflows and underflows float64", "logaddexp"]),
    (_right_by_the_maximum, True, []),
    (_right_by_softmax, True, []),
    (lambda *args: tuple(t.double() for t in _right_merge(*(a.double() for a in args))), True, []),  # float64
    (_naive_merge, False, ["scores near 1000", "inf or nan", "float32", "torch.logaddexp(lse1, lse2)"]),
    (_naive_merge_in_float64, False, ["scores near 1000", "inf or nan", "even in float64", "no dtype saves"]),
    (_shifted_by_a_constant, False, ["scores near -1000", "underflows to 0", "0/0 is nan"]),
    (_relative_to_the_first_block, False, ["one block's scores 1000 above the other's", "exp(lse2 - lse1)",
                                           "overflows even float64"]),
    (_safe_output_naive_lse, False, ["your merged lse holds inf or nan"]),
    (_max_lse_merge, False, ["three in a chain do not", "torch.logaddexp(lse1, lse2)"]),
    (_clamped_merge, False, ["With one block's scores 1000 above the other's, your output is right but your lse is "
                             "off by up to 92"]),
    (lambda *args: (*_right_merge(*args), 0), False, ["your merge returned 3 values"]),  # review: "got tuple"
    (_size_weighted_merge, False, ["you averaged the two outputs"]),
    (lambda out1, lse1, out2, lse2: (out1.add_(out2).div_(2), torch.logaddexp(lse1, lse2)), False,
     ["you averaged the two outputs"]),  # in place: the checker's own blocks stay as they were
    (lambda out1, lse1, out2, lse2: _right_merge(out1, lse1, out2, lse2)[0], False, ["Return (out, lse)"]),
    (lambda out1, lse1, out2, lse2: (torch.where(lse1 > lse2, out1, out2), torch.maximum(lse1, lse2)), False,
     ["differs from full attention"]),
    (lambda out1, lse1, out2: None, False, ["raised TypeError"]),
    (lambda *args: (_right_merge(*args)[0].numpy(), _right_merge(*args)[1]), False, ["a torch tensor, got ndarray"]),
    (lambda *args: (_right_merge(*args)[0], _right_merge(*args)[1].squeeze(-1)), False, ["merged lse should be"]),
    ("merge", False, ["Pass your function itself"]),
    (lambda *args: (_right_merge(*args)[0].half(), _right_merge(*args)[1]), False, ["merged output as float16"]),
    (lambda *args: (_right_merge(*args)[0], _right_merge(*args)[1].long()), False, ["merged lse as int64"]),
]


@pytest.mark.parametrize("fn, ok, fragments", MERGES)
def test_softmax_merge(fn, ok, fragments):
    feedback = checks.softmax_merge(fn)
    assert feedback.ok is ok, feedback.message
    for fragment in fragments:
        assert fragment in feedback.message, feedback.message


def test_the_merge_bank_holds_many_kinds_and_its_large_scores_pass_float64s_range():
    from dtlib.checks.attention import MERGE_CASES, _merge_case

    assert sum(ok for _, ok, _ in MERGES) >= 3 and sum(not ok for _, ok, _ in MERGES) >= 8
    lses = [lse for sizes, offsets, _, _ in MERGE_CASES for _, lse in _merge_case(sizes, offsets)[1]]
    assert any(len(sizes) == 3 and max(offsets) - min(offsets) >= 1000 for sizes, offsets, _, _ in MERGE_CASES)
    assert max(float(lse.max()) for lse in lses) > 709.8 and min(float(lse.min()) for lse in lses) < -745.2
