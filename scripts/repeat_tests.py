"""A pytest plugin that runs every collected test N times in one session: ``-p repeat_tests --repeat N``.

For stress runs (scripts/stress.sh), not the gate: each run is a parameter of its own, ``[...-repeat-K]`` in the
test's id, so a failure names the run it happened in. Load it with ``PYTHONPATH=scripts``.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--repeat", type=int, default=1, help="run each collected test this many times")


@pytest.fixture
def repeat_run(request: pytest.FixtureRequest) -> int:
    """Which run of the test this is (1 to --repeat)."""
    return int(request.param)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    times = metafunc.config.getoption("--repeat")
    if times < 1:
        raise pytest.UsageError(f"--repeat must be 1 or more, got {times}")
    if times > 1:
        metafunc.fixturenames.append("repeat_run")
        metafunc.parametrize("repeat_run", range(1, times + 1), indirect=True, ids=lambda run: f"repeat-{run}")
