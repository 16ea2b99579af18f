"""``python -m dtlib.bench live``'s rows for the collective check: measured on live ranks, checked and not."""

from __future__ import annotations

import pytest

from dtlib.bench import live


@pytest.mark.timeout(120)
def test_the_collective_check_is_timed_with_and_without_it():
    checked, unchecked = live._collective_check(2, samples=30)
    assert checked.what == "all_reduce, collectives checked" and unchecked.what == "all_reduce, --no-check"
    assert checked.samples == unchecked.samples == 300  # 3 cells of 100 all-reduces each
    assert checked.median_ms > 0 and unchecked.median_ms > 0
    assert checked.note == f"{checked.median_ms / unchecked.median_ms:.1f}x unchecked"
    assert "all_reduce, collectives checked" in live.format_table([checked, unchecked])
