"""Sum pytest's ``--durations=0`` lines per test file: where the gate's time goes.

    CI=true PYTEST_ADDOPTS=--durations=0 make test 2>&1 | tee gate.log
    python scripts/durations.py gate.log            # a Markdown table, longest file first

Each line pytest prints (``12.34s call     tests/launch/test_launch.py::test_x``) is one phase of one test; a
file's figure is the sum of its phases (setup, call and teardown), so it is the time its worker spent on it.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict

LINE = re.compile(r"^(\d+\.\d+)s (setup|call|teardown)\s+(\S+?)(?:::|$)")


def per_file(lines: list[str]) -> dict[str, float]:
    """Seconds per test file from ``--durations`` lines. Example: ``per_file(["1.50s call  tests/a.py::t"])``."""
    totals: dict[str, float] = defaultdict(float)
    for line in lines:
        found = LINE.match(line.strip())
        if found:
            totals[found[3]] += float(found[1])
    return dict(totals)


def main(path: str, top: int = 25) -> None:
    with open(path, errors="replace") as log:
        totals = per_file(log.readlines())
    print("| file | s |\n|---|---:|")
    for name, seconds in sorted(totals.items(), key=lambda item: -item[1])[:top]:
        print(f"| `{name}` | {seconds:.0f} |")
    print(f"| all {len(totals)} files | {sum(totals.values()):.0f} |")


if __name__ == "__main__":
    main(sys.argv[1], *(int(arg) for arg in sys.argv[2:3]))
