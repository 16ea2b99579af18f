"""dtlib.bench.startup (``python -m dtlib.bench launch``): the measurements, the table and the JSON."""

from __future__ import annotations

import json
import time

import pytest

from dtlib.bench import startup
from dtlib.bench.__main__ import main


@pytest.mark.timeout(60)
def test_measure_times_each_method_the_asked_number_of_times_within_the_calls_own_time():
    """Oracle: the clock around the whole call. The launches it times run one after another inside it, so
    together they take no longer than the call; a time in the wrong unit (ms) or counted twice breaks that."""
    start = time.perf_counter()
    timings = startup.measure(world_size=2, repeats=2, methods=["forkserver", "fork"])
    elapsed = time.perf_counter() - start
    assert [t.method for t in timings] == ["forkserver", "fork"]
    assert [len(t.seconds) for t in timings] == [2, 2]
    assert 0 < sum(s for t in timings for s in t.seconds) <= elapsed


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
def test_command_line_prints_json_of_one_real_launch_per_method(capsys):
    start = time.perf_counter()
    assert main(["launch", "--repeats", "1", "--methods", "forkserver,fork", "--json"]) == 0
    elapsed = time.perf_counter() - start
    records = json.loads(capsys.readouterr().out)
    assert [r["method"] for r in records] == ["forkserver", "fork"]
    assert all(r["world_size"] == 2 and r["seconds"] == [r["median_s"]] for r in records)  # one launch each
    assert 0 < sum(r["median_s"] for r in records) <= elapsed


def test_command_line_refuses_bad_settings_in_one_line_before_any_launch(capsys, no_process_start):
    for argv, message in [(["launch", "--repeats", "0"], "--repeats: must be >= 1, got 0"),
                          (["launch", "--world-size", "two"], "--world-size: expected a whole number, got 'two'")]:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert capsys.readouterr().err == f"python -m dtlib.bench launch: error: argument {message}\n"


def test_measure_refuses_an_empty_method_list():
    with pytest.raises(ValueError, match="no method to measure"):
        startup.measure(methods=[])
