"""Where the browser tests left their screenshots, with each notebook's Run All time.

    python tests/browser/screenshots.py        # or: make browser-screenshots

The tests write one PNG per notebook (the whole notebook after Run All) and ``runs.json`` into
build/browser/; neither is committed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

FOLDER = Path(__file__).resolve().parents[2] / "build" / "browser"
RECORD = "runs.json"


def record(folder: Path, notebook: str, seconds: float, budget_s: float, screenshot: Path) -> None:
    """Add one notebook's run to ``folder/runs.json`` (created, or updated in place)."""
    path = folder / RECORD
    runs = json.loads(path.read_text()) if path.exists() else {}
    runs[notebook] = {"seconds": round(seconds, 1), "budget_s": budget_s, "screenshot": str(screenshot)}
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(runs, indent=1, sort_keys=True))


def report(folder: Path = FOLDER) -> str:
    """A table: notebook, Run All seconds against its budget, and the screenshot's path."""
    path = folder / RECORD
    if not path.exists():
        return f"no screenshots in {folder} yet: run make test-browser"
    runs = json.loads(path.read_text())
    lines = [f"{'notebook':30} {'Run All':>8} {'budget':>7}  screenshot"]
    for notebook, run in sorted(runs.items()):
        lines.append(f"{notebook:30} {run['seconds']:>7.1f}s {run['budget_s']:>6}s  {run['screenshot']}")
    total = sum(run["seconds"] for run in runs.values())
    lines.append(f"{'all notebooks':30} {total:>7.1f}s")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(Path(sys.argv[1]) if len(sys.argv) > 1 else FOLDER))
