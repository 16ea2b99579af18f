"""Fixtures for the browser tests: one JupyterLab server and one headless Chromium for the whole run.

The tests skip, each with the reason, when Playwright or a Chromium binary is missing; ``make test-browser``
(scripts/browser_setup.sh) installs both on Debian or Ubuntu. Set ``CHROMIUM=/path/to/chrome`` to use
another Chromium-based browser.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
SCREENSHOTS = ROOT / "build" / "browser"
# Chromium as root in a container, on a machine without a network: no sandbox (it needs user namespaces),
# no GPU, and none of the background connections that a closed network refuses many times a second.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                 "--disable-background-networking", "--disable-component-update"]


def chromium_path() -> str | None:
    """The browser to drive: $CHROMIUM, else the first of chromium / chromium-browser / google-chrome on PATH."""
    if os.environ.get("CHROMIUM"):
        return os.environ["CHROMIUM"]
    return next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)


def why_skipped() -> str | None:
    """Why the browser tests cannot run here, or None when they can."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright for Python is not installed (make test-browser installs it)"
    path = chromium_path()
    if path is None:
        return "no Chromium found (apt-get install chromium, or set CHROMIUM=/path/to/chrome)"
    if not os.access(path, os.X_OK):
        return f"CHROMIUM={path} is not an executable file"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = why_skipped()
    if reason:
        for item in items:
            if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
                item.add_marker(pytest.mark.skip(reason=f"browser tests skipped: {reason}"))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    reason = why_skipped()
    if reason:
        terminalreporter.write_line(f"browser tests skipped: {reason}", yellow=True, bold=True)
    elif (SCREENSHOTS / "runs.json").exists():
        from screenshots import report

        terminalreporter.write_sep("-", "notebooks run in JupyterLab (make browser-screenshots prints this again)")
        terminalreporter.write_line(report(SCREENSHOTS))


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
        chromium = playwright.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="session")
def notebook_runs(browser: object, lab: object) -> Iterator[object]:
    """Each notebook opened and run once per session (the widget tests reuse the run of the notebook tests)."""
    from labdriver import NotebookRuns

    runs = NotebookRuns(browser, lab, SCREENSHOTS)
    try:
        yield runs
    finally:
        runs.close()
