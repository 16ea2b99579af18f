"""The browser tests' state: which Chromium they drive (or why they skip), and where they left their
screenshots, with each notebook's Run All time.

    python tests/browser/status.py        # or: make browser-screenshots

For each notebook the tests write ``NN_topic.png`` (the whole notebook after Run All) and ``NN_topic.json``
(its time and budget) into build/browser/; neither is committed. One file per notebook, so that
pytest-xdist workers never write the same file.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

FOLDER = Path(__file__).resolve().parents[2] / "build" / "browser"
#: Set to 1, the browser tests take no picture of each notebook (make test sets it: a picture of a tall notebook
#: costs seconds of the gate, and nothing checks it; make test-browser takes them).
NO_SCREENSHOTS = "DTLIB_NO_SCREENSHOTS"


def _starts(path: str) -> bool:
    """True when ``path --version`` works (Ubuntu's chromium-browser can be a stub that asks for snap)."""
    try:
        return subprocess.run([path, "--version"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@functools.cache
def chromium_path() -> str | None:
    """The browser to drive: $CHROMIUM, else the first of chromium / chromium-browser / google-chrome on PATH
    that starts (the same choice as scripts/browser_setup.sh)."""
    if os.environ.get("CHROMIUM"):
        return os.environ["CHROMIUM"]
    found = filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome")))
    return next(filter(_starts, found), None)


def why_skipped() -> str | None:
    """Why the browser tests cannot run here, or None when they can."""
    if os.environ.get("DTLIB_NO_BROWSER"):
        return "DTLIB_NO_BROWSER is set (make test-torch: nbval runs the notebooks instead)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright for Python is not installed (make setup installs it, with the dev extra)"
    path = chromium_path()
    if path is None:
        return "no Chromium found (apt-get install chromium, or set CHROMIUM=/path/to/chrome)"
    if not _starts(path):
        return f"CHROMIUM={path} does not start ('{path} --version' fails)"
    return None


def _shows_widget(cell: Any) -> bool:
    return cell.cell_type == "code" and any(
        "application/vnd.jupyter.widget-view+json" in output.get("data", {}) for output in cell.outputs)


def prediction_cells(notebook: Any) -> list[int]:
    """Indices of the cells that show a prediction widget (``dtlib.checks.predict(...)``)."""
    return [index for index, cell in enumerate(notebook.cells)
            if _shows_widget(cell) and "dtlib.checks.predict(" in cell.source]


def widget_cells(notebook: Any) -> list[int]:
    """Indices of the cells whose stored outputs include an ipywidgets view other than a prediction: sliders
    beside a figure."""
    predicting = set(prediction_cells(notebook))
    return [index for index, cell in enumerate(notebook.cells) if _shows_widget(cell) and index not in predicting]


def forget(folder: Path, notebook: str) -> None:
    """Remove ``notebook``'s picture and record from an earlier run (they would pass for this run's)."""
    for suffix in (".png", ".json"):
        (folder / f"{Path(notebook).stem}{suffix}").unlink(missing_ok=True)


def record(folder: Path, notebook: str, seconds: float, budget_s: float, screenshot: Path | None) -> None:
    """Write ``notebook``'s run: Run All seconds, its budget, its screenshot (None: none taken), when it finished."""
    folder.mkdir(parents=True, exist_ok=True)
    shown = str(screenshot) if screenshot is not None else f"none: {NO_SCREENSHOTS}=1 (make test-browser takes one)"
    entry = {"notebook": notebook, "seconds": round(seconds, 1), "budget_s": budget_s,
             "screenshot": shown, "finished": time.time()}
    (folder / f"{Path(notebook).stem}.json").write_text(json.dumps(entry, indent=1))


def report(folder: Path = FOLDER, since: float = 0.0) -> str:
    """A table of the runs recorded in ``folder`` (those finished after ``since``, a time.time()), or a hint."""
    runs = [json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))] if folder.is_dir() else []
    runs = [run for run in runs if run["finished"] >= since]
    if not runs:
        return f"no notebook screenshots in {folder}: run make test-browser"
    lines = [f"{'notebook':30} {'Run All':>8} {'budget':>7}  screenshot"]
    for run in runs:
        lines.append(f"{run['notebook']:30} {run['seconds']:>7.1f}s {run['budget_s']:>6}s  {run['screenshot']}")
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(max(run["finished"] for run in runs)))
    lines.append(f"{'sum':30} {sum(run['seconds'] for run in runs):>7.1f}s          (last run finished {when})")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(Path(sys.argv[1]) if len(sys.argv) > 1 else FOLDER))
