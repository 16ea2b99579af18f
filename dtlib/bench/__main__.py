"""``python -m dtlib.bench <what> [options]``; ``--help`` lists what can be measured."""

from __future__ import annotations

import argparse
import json
import sys

from dtlib.bench import launch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtlib.bench", description=__doc__)
    commands = parser.add_subparsers(dest="what", required=True)
    launch_parser = commands.add_parser("launch", help="time from dtlib.spawn's call to its results")
    launch_parser.add_argument("--world-size", type=int, default=2)
    launch_parser.add_argument("--repeats", type=int, default=5, help="timed launches per method")
    launch_parser.add_argument("--methods", default=",".join(launch.default_methods()),
                               help=f"comma-separated subset of {','.join(launch.METHODS)} "
                                    "(accelerate only where it is installed)")
    launch_parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    options = parser.parse_args(argv)

    if options.what == "launch":
        methods = [m.strip() for m in options.methods.split(",") if m.strip()]
        timings = launch.measure(options.world_size, options.repeats, methods)
        if options.json:
            print(json.dumps(launch.as_records(timings, options.world_size), indent=2))
        else:
            print(launch.format_table(timings, options.world_size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
