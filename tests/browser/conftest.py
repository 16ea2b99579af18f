"""Fixtures for the browser tests: one JupyterLab server and one headless Chromium for the whole run.

The tests skip, each with the reason, when Playwright or a Chromium binary is missing. Set-up installs
Playwright (the dev extra); ``make test-browser`` (scripts/browser_setup.sh) installs Chromium on Debian
or Ubuntu. Set ``CHROMIUM=/path/to/chrome`` to use another Chromium-based browser.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import status

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
# Chromium as root in a container, on a machine without a network: no sandbox (it needs user namespaces),
# no GPU, and none of the background connections that a closed network refuses many times a second.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                 "--disable-background-networking", "--disable-component-update"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip this folder's tests, with the reason, when no browser can be driven (the summary repeats it)."""
    reason = status.why_skipped()
    if reason:
        for item in items:
            if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
                item.add_marker(pytest.mark.skip(reason=f"browser tests skipped: {reason}"))


@pytest.fixture(scope="session")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A JupyterLab server on a temporary copy of notebooks/, stopped at the end of the run."""
    from labdriver import LabServer

    with LabServer(NOTEBOOKS, tmp_path_factory.mktemp("lab")) as server:
        yield server


@pytest.fixture(scope="session")
def browser() -> Iterator[object]:
    """Headless Chromium driven by Playwright, closed at the end of the run."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=status.chromium_path(), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="session")
def notebook_runs(browser: object, lab: object) -> Iterator[object]:
    """Each notebook opened and run once per session (the widget tests reuse the run of the notebook tests)."""
    from labdriver import NotebookRuns

    runs = NotebookRuns(browser, lab, status.FOLDER, take_screenshots=os.environ.get(status.NO_SCREENSHOTS) != "1")
    try:
        yield runs
    finally:
        runs.close()
