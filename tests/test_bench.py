"""dtlib.bench launch: the measurements, the command line, and the issue's targets."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dtlib.bench import launch


@pytest.mark.timeout(60)
def test_measure_times_each_method_the_asked_number_of_times():
    timings = launch.measure(world_size=2, repeats=2, methods=["forkserver", "fork"])
    assert [t.method for t in timings] == ["forkserver", "fork"]
    for timing in timings:
        assert len(timing.seconds) == 2 and all(s > 0 for s in timing.seconds)


def test_measure_refuses_unknown_methods_and_bad_counts():
    with pytest.raises(ValueError, match="unknown methods"):
        launch.measure(methods=["teleport"])
    with pytest.raises(ValueError):
        launch.measure(repeats=0, methods=["fork"])


def test_table_reports_the_ratio_to_mp_spawn():
    timings = [launch.LaunchTiming("spawn", [1.1, 1.2, 1.3]), launch.LaunchTiming("mp.spawn", [1.0, 1.0, 1.0])]
    table = launch.format_table(timings, world_size=2)
    assert "1.20x" in table and "1.00x" in table and "dtlib spawn" in table


@pytest.mark.timeout(120)
def test_command_line_prints_json():
    command = [sys.executable, "-m", "dtlib.bench", "launch", "--repeats", "1", "--methods", "forkserver,fork",
               "--json"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=100, check=True).stdout
    records = json.loads(out)
    assert [r["method"] for r in records] == ["forkserver", "fork"]
    assert all(r["world_size"] == 2 and r["median_s"] > 0 for r in records)
