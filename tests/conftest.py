"""Shared fixtures: check that a test left no processes or shared-memory files behind."""

from __future__ import annotations

import multiprocessing.forkserver
import multiprocessing.process
import multiprocessing.resource_tracker
import os
import time
from collections.abc import Iterable

import psutil
import pytest

SHM = "/dev/shm"


def _multiprocessing_helpers() -> set[int]:
    """Pids of the long-lived helpers multiprocessing starts once per process (not leftovers)."""
    pids = {
        getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None),
        getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None),
    }
    return {pid for pid in pids if pid is not None}


def _children() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)} - _multiprocessing_helpers()


def _shm_entries() -> set[str]:
    return set(os.listdir(SHM)) if os.path.isdir(SHM) else set()


def gone(pid: int) -> bool:
    """True when no process with ``pid`` exists any more (a zombie still exists)."""
    return not psutil.pid_exists(pid)


class Leftovers:
    """Snapshot of this process's children and of /dev/shm, taken when the test starts."""

    def __init__(self) -> None:
        self.children = _children()
        self.shm = _shm_entries()

    def assert_clean(self, worker_pids: Iterable[int] = ()) -> None:
        """No new child process (besides multiprocessing's helpers), no worker alive, no new /dev/shm file."""
        new_children = _children() - self.children
        assert not new_children, f"child processes left behind: {sorted(new_children)}"
        alive = [pid for pid in worker_pids if not gone(pid)]
        assert not alive, f"worker processes still exist: {alive}"
        new_shm = _shm_entries() - self.shm
        assert not new_shm, f"new entries in {SHM}: {sorted(new_shm)}"


@pytest.fixture
def leftovers() -> Leftovers:
    """Snapshot taken before the test; call ``leftovers.assert_clean(pids)`` after the launch."""
    return Leftovers()



_SESSION_STARTED = time.time()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say why the browser tests were skipped, or show this session's notebook runs in JupyterLab.

    Here rather than in tests/browser/conftest.py: under pytest-xdist only this conftest reaches the
    process that prints the summary."""
    from browser import status

    reason = status.why_skipped()
    if reason:
        terminalreporter.write_line(f"browser tests skipped: {reason}", yellow=True, bold=True)
        return
    table = status.report(since=_SESSION_STARTED)
    if not table.startswith("no "):
        terminalreporter.write_sep("-", "notebooks run in JupyterLab (make browser-screenshots shows this again)")
        terminalreporter.write_line(table)


# What opens the rendezvous port (dtlib.compat), for tests that must show nothing started.
STORE_FACTORIES = ("loopback_listener", "store_on", "loopback_store")


@pytest.fixture
def no_process_start(monkeypatch):
    """Make starting a rank or opening the rendezvous store fail the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("dtlib.spawn started a process or a store before rejecting its input")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    import dtlib.compat

    for name in STORE_FACTORIES:
        if hasattr(dtlib.compat, name):
            monkeypatch.setattr(dtlib.compat, name, refuse)
