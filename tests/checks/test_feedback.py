"""dtlib.checks.feedback: the verdict every checker returns."""

from __future__ import annotations

from dtlib import checks


def test_feedback_shows_a_mark_and_is_truthy_only_when_ok():
    assert repr(checks.Feedback(True, "fine")) == "✓ fine"
    assert repr(checks.Feedback(False, "nope")) == "✗ nope"
    assert checks.Feedback(True, "") and not checks.Feedback(False, "")
