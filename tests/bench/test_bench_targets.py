"""``python -m dtlib.bench check``: the speed targets outside the gate. These tests check that the targets are
measured and reported; they never assert a time (the check itself does, on a quiet machine)."""

from __future__ import annotations

import time

import nbformat
import pytest

from dtlib.bench import targets
from dtlib.bench.__main__ import main


def test_the_best_attempt_counts_against_the_limit():
    result = targets.best_of("spawn", "a ratio", 1.15, "x", [1.4, 1.1, 1.3])
    assert result.measured == 1.1 and result.met and result.attempts == (1.4, 1.1, 1.3)
    assert not targets.best_of("forkserver", "seconds", 0.15, "s", [0.2, 0.16]).met
    with pytest.raises(ValueError, match="no attempt"):
        targets.best_of("ring", "a ratio", 2.0, "x", [])


def test_the_table_prints_every_target_and_names_the_misses():
    results = [targets.best_of("spawn", "ratio", 1.15, "x", [1.1]),
               targets.best_of("forkserver", "s", 0.15, "s", [0.2])]
    table = targets.format_table(results)
    assert "spawn" in table and "1.1x" in table and "met" in table
    assert "MISSED" in table and table.endswith("1 of 2 targets met; missed: forkserver")


def test_bad_choices_are_refused_before_anything_runs():
    with pytest.raises(ValueError, match="unknown target.*bogus"):
        targets.run(["bogus"])
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        targets.run(["simulator"], repeats=0)
    with pytest.raises(FileNotFoundError, match="no notebooks"):
        targets.run(["notebooks"], notebooks=targets.Path("/nonexistent"))


@pytest.mark.timeout(120)
def test_the_simulator_target_is_measured_with_its_repeats_within_the_calls_own_time():
    """Oracle: the clock around the call; its attempts run one after another inside it."""
    start = time.perf_counter()
    (result,) = targets.run(["simulator"], repeats=2)
    elapsed = time.perf_counter() - start
    assert result.name == "simulator" and len(result.attempts) == 2 and result.limit == 2.0
    assert result.measured == min(result.attempts) and 0 < sum(result.attempts) <= elapsed


@pytest.mark.timeout(120)
def test_a_notebook_is_timed_in_a_fresh_kernel_in_its_folder(tmp_path):
    """Oracles: a cell that sleeps 0.5 s (the time can be no less) and the clock around the call (nor more)."""
    (tmp_path / "data.txt").write_text("42")
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("assert open('data.txt').read() == '42'"),
                                               nbformat.v4.new_code_cell("import time; time.sleep(0.5)")])
    nbformat.write(notebook, tmp_path / "nb.ipynb")
    start = time.perf_counter()
    seconds = targets.notebook_seconds(tmp_path / "nb.ipynb")
    assert 0.5 <= seconds <= time.perf_counter() - start


def test_a_measurement_that_gives_two_targets_runs_once_and_only_the_asked_ones_are_reported(monkeypatch):
    calls = []

    def fake(repeats):
        calls.append(repeats)
        return [targets.best_of("overhead", "x", 1.05, "x", [1.0]), targets.best_of("ring", "x", 2.0, "x", [1.5])]

    monkeypatch.setitem(targets.TARGETS, "overhead", fake)
    monkeypatch.setitem(targets.TARGETS, "ring", fake)
    assert [r.name for r in targets.run(["overhead", "ring"], repeats=2)] == ["overhead", "ring"]
    assert [r.name for r in targets.run(["ring"])] == ["ring"]
    assert calls == [2, 3]


@pytest.mark.timeout(120)
def test_the_command_line_prints_the_table_and_refuses_unknown_targets_in_one_line(capsys, no_process_start):
    with pytest.raises(SystemExit) as refused:
        main(["check", "--only", "bogus"])
    assert refused.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip().splitlines() == [
        "python -m dtlib.bench check: error: unknown target(s) bogus; "
        "choose from spawn, forkserver, overhead, ring, simulator, notebooks"]
    assert main(["check", "--only", "simulator", "--repeats", "1"]) in (0, 1)  # met or missed: speed is not judged
    out = capsys.readouterr().out
    assert "simulator" in out and out.rstrip().endswith(("1 of 1 targets met", "missed: simulator"))
