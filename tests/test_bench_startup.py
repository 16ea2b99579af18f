"""dtlib.bench.startup (``python -m dtlib.bench launch``): the measurements, the table and the JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dtlib.bench import startup


@pytest.mark.timeout(60)
def test_measure_times_each_method_the_asked_number_of_times():
    timings = startup.measure(world_size=2, repeats=2, methods=["forkserver", "fork"])
    assert [t.method for t in timings] == ["forkserver", "fork"]
    for timing in timings:
        assert len(timing.seconds) == 2 and all(s > 0 for s in timing.seconds)


def test_measure_refuses_unknown_methods_and_bad_counts():
    with pytest.raises(ValueError, match="unknown methods"):
        startup.measure(methods=["teleport"])
    with pytest.raises(ValueError):
        startup.measure(repeats=0, methods=["fork"])


TIMINGS = [startup.LaunchTiming("spawn", [1.1, 1.2, 1.3]), startup.LaunchTiming("mp.spawn", [1.0, 1.0, 1.0])]


def test_table_reports_the_ratio_to_mp_spawn():
    title, header, *lines = startup.format_table(TIMINGS, world_size=2).splitlines()
    assert title.startswith("# dtlib.bench launch: world_size=2, one gloo all-reduce per job")
    assert header.split() == ["#", "method", "n", "median_s", "min_s", "max_s", "vs", "mp.spawn"]
    assert lines == [f"  {'dtlib spawn':<50}   3     1.200    1.100    1.300        1.20x",
                     f"  {'torch.multiprocessing.spawn (floor)':<50}   3     1.000    1.000    1.000        1.00x"]
    without_floor = startup.format_table(TIMINGS[:1], world_size=2).splitlines()[-1]
    assert without_floor.split()[-1] == "-"  # no mp.spawn measured: no ratio


def test_records_hold_every_time_and_its_summary():
    (record, _) = startup.as_records(TIMINGS, world_size=2)
    assert record == {"method": "spawn", "label": "dtlib spawn", "world_size": 2, "median_s": 1.2, "min_s": 1.1,
                      "max_s": 1.3, "seconds": [1.1, 1.2, 1.3]}
    assert list(record) == ["method", "label", "world_size", "median_s", "min_s", "max_s", "seconds"]


@pytest.mark.timeout(120)
def test_command_line_prints_json():
    command = [sys.executable, "-m", "dtlib.bench", "launch", "--repeats", "1", "--methods", "forkserver,fork",
               "--json"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=100, check=True).stdout
    records = json.loads(out)
    assert [r["method"] for r in records] == ["forkserver", "fork"]
    assert all(r["world_size"] == 2 and r["median_s"] > 0 for r in records)


def test_measure_refuses_an_empty_method_list():
    with pytest.raises(ValueError, match="no method to measure"):
        startup.measure(methods=[])
