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


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arguments, what", [
    ("allreduce --world-size 0", "argument --world-size: must be >= 1, got 0"),  # was a ZeroDivisionError
    ("fsdp --world-size 3", "world_size=3 cannot split the comparison's global batch of 16 samples evenly: "
                            "use 1, 2, 4, 8 or 16 ranks"),  # was a global_batch the command line does not expose
    ("launch --methods teleport", "unknown methods ['teleport']; choose from forkserver-first, forkserver"),
    ("allreduce --min-bytes 64M --max-bytes 1K", "min_bytes"),
    ("allreduce --min-bytes 5X", "argument --min-bytes: cannot read the size '5X'"),
    ("ddp --model resnet", "unknown model 'resnet'; choose one of mlp"),
    ("ddp --steps 2", "argument --steps: must be >= 3, got 2"),
    ("launch --repeats 2.5", "argument --repeats: expected a whole number, got '2.5'"),
], ids=["allreduce-world-size-0", "fsdp-world-size-3", "launch-unknown-method", "sizes-reversed", "unreadable-size",
        "ddp-unknown-model", "ddp-steps-2", "repeats-2.5"])
def test_command_line_refuses_bad_settings_in_one_line_with_status_2(arguments, what):
    completed = subprocess.run([sys.executable, "-m", "dtlib.bench", *arguments.split()], capture_output=True,
                               text=True, timeout=100)
    assert completed.returncode == 2, completed.stderr
    command = arguments.split()[0]
    assert completed.stderr.startswith(f"python -m dtlib.bench {command}: error: "), completed.stderr
    assert completed.stderr.count("\n") == 1 and completed.stderr.endswith("\n"), completed.stderr  # no traceback
    assert what in completed.stderr
    assert completed.stdout == ""


def test_measure_refuses_an_empty_method_list():
    with pytest.raises(ValueError, match="no method to measure"):
        launch.measure(methods=[])
