"""Helpers the launch tests share."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

import dtlib.launch.job


@pytest.fixture
def clock_starts_when(monkeypatch) -> Callable[..., None]:
    """``clock_starts_when(*paths)``: spawn's timeout counts from when every one of ``paths`` exists (or a rank
    has exited, or 60 s passed): a test of the timeout then waits only as long as its assertion needs, however
    slowly the ranks started. Job.wait starts the clock when it is called."""
    real_wait = dtlib.launch.job.Job.wait

    def start(*paths: Path, limit_s: float = 60.0) -> None:
        def wait_when_ready(self, timeout):
            deadline = time.monotonic() + limit_s
            while not all(path.exists() for path in paths) and time.monotonic() < deadline:
                if any(not state.process.is_alive() for state in self.ranks):
                    break  # a rank died before it got there: let wait report it
                time.sleep(0.01)
            return real_wait(self, timeout)

        monkeypatch.setattr(dtlib.launch.job.Job, "wait", wait_when_ready)

    return start
