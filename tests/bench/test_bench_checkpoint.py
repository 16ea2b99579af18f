"""``python -m dtlib.bench checkpoint``: both kinds of save run, save where they should, and are tabled."""

from __future__ import annotations

import json

import pytest

from dtlib.bench import checkpoint
from dtlib.bench.__main__ import main


@pytest.mark.timeout(120)
def test_each_kind_of_save_is_timed_over_its_saving_steps_and_the_others(capsys):
    assert main(["checkpoint", "--steps", "4", "--every", "2", "--layers", "1", "--repeats", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["kind"] for row in rows] == ["blocking", "async"]
    for row in rows:
        assert row["saves"] == 2 and row["saving_step_ms"] > 0 and row["other_step_ms"] > 0 and row["total_s"] > 0
        assert row["stall_ms"] == pytest.approx(row["saving_step_ms"] - row["other_step_ms"])


def test_the_table_ends_with_the_stalls_ratio():
    rows = [checkpoint.SaveTiming("blocking", 300.0, 100.0, 200.0, 2.0, 3),
            checkpoint.SaveTiming("async", 150.0, 110.0, 40.0, 1.8, 3)]
    table = checkpoint.format_table(rows)
    assert table.splitlines()[-1] == "# async's stall / blocking's: 0.20" and "blocking" in table


def test_a_run_with_no_saving_step_is_refused_before_any_rank_starts(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["checkpoint", "--steps", "3", "--every", "4"])
    assert stopped.value.code == 2 and "every (4) must be at most steps (3)" in capsys.readouterr().err
