"""dtlib.sim.forked: two pieces of work at once, one in a forked copy; the same results, the caller's own
exceptions, and no copy left, as if both had run here one after the other."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from dtlib.sim import forked, step
from dtlib.sim.forked import alongside, can_fork
from dtlib.sim.llama import LLAMA
from dtlib.sim.step import simulate

needs_fork = pytest.mark.skipif(not can_fork(), reason="forks only on Linux with two cores or more")


def _gone(pid: int) -> bool:
    """Whether process ``pid`` neither runs nor waits to be reaped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@needs_fork
def test_the_work_there_runs_in_a_copy_of_this_process_whose_result_comes_back_and_which_is_reaped():
    here = os.getpid()
    found = {"notebook's": [1, 2, 3]}  # what this process holds, the copy holds too
    there, mine = alongside(lambda: (os.getpid(), os.getppid(), found), lambda: os.getpid())
    assert mine == here and there[1] == here and there[0] != here and there[2] == found
    assert _gone(there[0])
    with pytest.raises(ChildProcessError):
        os.waitpid(there[0], os.WNOHANG)


def test_where_it_cannot_fork_both_run_here_one_after_the_other(monkeypatch):
    monkeypatch.setattr(forked, "can_fork", lambda: False)
    order: list[str] = []
    assert alongside(lambda: order.append("there") or os.getpid(), lambda: order.append("here") or 2) == \
        (os.getpid(), 2)
    assert order == ["there", "here"]


@needs_fork
def test_an_exception_here_is_raised_as_it_is_and_the_copy_is_killed(tmp_path: Path):
    pid_file = tmp_path / "copy"

    def there() -> None:
        pid_file.write_text(str(os.getpid()))
        time.sleep(120)

    def here() -> None:
        while not pid_file.exists() or not pid_file.read_text():
            time.sleep(0.01)
        raise KeyboardInterrupt  # Ctrl-C in the cell

    with pytest.raises(KeyboardInterrupt):
        alongside(there, here)
    assert _gone(int(pid_file.read_text()))


@needs_fork
def test_work_that_fails_in_the_copy_runs_here_again_and_raises_its_own_exception(capfd):
    """Printing nothing from the copy: what the work prints comes once, from its run here."""
    def there() -> None:
        print("there")
        raise ValueError("the learner's own error")

    with pytest.raises(ValueError, match="the learner's own error"):
        alongside(there, lambda: 1)
    assert capfd.readouterr().out == "there\n"


@needs_fork
def test_a_result_that_does_not_pickle_is_made_here():
    there, _ = alongside(lambda: (lambda: "made here"), lambda: 1)
    assert there() == "made here"


@needs_fork
@pytest.mark.timeout(60)
def test_a_copy_that_does_not_answer_in_time_is_killed_and_its_work_done_here(monkeypatch, tmp_path: Path):
    monkeypatch.setattr(forked, "PATIENCE_S", 0.5)
    monkeypatch.setattr(forked, "PATIENCE_X", 0.0)
    parent, pid_file = os.getpid(), tmp_path / "copy"

    def there() -> int:
        if os.getpid() != parent:  # the copy hangs (a deadlock, say)
            pid_file.write_text(str(os.getpid()))
            time.sleep(120)
        return 7

    assert alongside(there, lambda: 1) == (7, 1)
    assert _gone(int(pid_file.read_text()))


@pytest.mark.timeout(300)
def test_the_simulator_answers_the_same_with_its_depths_at_once_or_one_after_the_other(monkeypatch):
    job = {"dp": 8, "tp": 2, "seq_len": 512, "checkpointing": True, "kernels": "cpu"}
    at_once = simulate(LLAMA["7B"], **job)
    monkeypatch.setattr(forked, "can_fork", lambda: False)
    monkeypatch.setattr(step, "_ANSWERED", {})  # asked again, not answered from the first run
    one_then_other = simulate(LLAMA["7B"], **job)
    assert (at_once.memory, at_once.traffic, at_once.depths, at_once.before_step) == \
        (one_then_other.memory, one_then_other.traffic, one_then_other.depths, one_then_other.before_step)
