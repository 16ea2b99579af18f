"""``python -m dtlib.bench <what> [options]``; ``--help`` lists what can be measured.

A setting that cannot work is refused before any rank starts, in one line on stderr
(``python -m dtlib.bench allreduce: error: ...``), with exit status 2, as argparse does.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from dtlib.bench import bandwidth, checkpoint, ddp, fsdp, live, startup, targets


class _Parser(argparse.ArgumentParser):
    """argparse, with every refusal on one line: ``<prog>: error: <what is wrong>``, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def _count(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= ``minimum``."""

    def whole_number(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return whole_number


def _size(text: str) -> int:
    """An argparse type: a message size such as 1K or 64M (bandwidth.parse_size)."""
    try:
        return bandwidth.parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m dtlib.bench", description=__doc__)
    commands = parser.add_subparsers(dest="what", required=True)
    launch_parser = commands.add_parser("launch", help="time from dtlib.spawn's call to its results")
    launch_parser.add_argument("--world-size", type=_count(1), default=2)
    launch_parser.add_argument("--repeats", type=_count(1), default=5, help="timed launches per method")
    launch_parser.add_argument("--methods", default=",".join(startup.default_methods()),
                               help=f"comma-separated subset of {','.join(startup.METHODS)} "
                                    "(accelerate only where it is installed)")
    launch_parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    for op in bandwidth.OPS:
        sweep_parser = commands.add_parser(op, help=f"nccl-tests-style {op} sweep over message sizes")
        sweep_parser.add_argument("--world-size", type=_count(1), default=2)
        sweep_parser.add_argument("--min-bytes", type=_size, default="1K",
                                  help="smallest S, e.g. 1K (K, M, G = 1024^1..3)")
        sweep_parser.add_argument("--max-bytes", type=_size, default="64M", help="largest S, e.g. 64M")
        sweep_parser.add_argument("--iters", type=_count(1), default=20, help="timed iterations per size")
        sweep_parser.add_argument("--warmup", type=_count(0), default=5, help="untimed iterations per size first")
        sweep_parser.add_argument("--algo", choices=["library", "ring"], default="library",
                                  help="ring: dtlib's send/recv ring all-reduce (allreduce only)")
        sweep_parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ddp_parser = commands.add_parser("ddp", help="DDP step time on 1 rank against N, buckets, overlap")
    ddp_parser.add_argument("--world-size", type=_count(1), default=2)
    ddp_parser.add_argument("--model", default="wide_mlp", help="a name from dtlib.train.models.MODELS")
    ddp_parser.add_argument("--global-batch", type=_count(1), default=2048)
    ddp_parser.add_argument("--steps", type=_count(3), default=12, help="step 0 builds buckets and is not timed")
    ddp_parser.add_argument("--threads", type=_count(1), default=1, help="torch threads per rank")
    ddp_parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    fsdp_parser = commands.add_parser("fsdp", help="DDP against FSDP strategies: memory, traffic, time")
    fsdp_parser.add_argument("--world-size", type=_count(1), default=2,
                             help=f"a divisor of the {fsdp.GLOBAL_BATCH}-sample global batch")
    fsdp_parser.add_argument("--steps", type=_count(1), default=6)
    fsdp_parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    live_parser = commands.add_parser("live", help="live ranks: a start against a warm spawn, a cell's round trip")
    live_parser.add_argument("--world-size", type=_count(1), default=2)
    live_parser.add_argument("--samples", type=_count(1), default=50, help="round trips timed (the median counts)")
    live_parser.add_argument("--starts", type=_count(1), default=5, help="starts and spawns timed")
    live_parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    save_parser = commands.add_parser("checkpoint", help="what a DCP save takes from its step: blocking and async")
    save_parser.add_argument("--world-size", type=_count(1), default=2)
    save_parser.add_argument("--steps", type=_count(1), default=12, help="timed training steps per run")
    save_parser.add_argument("--every", type=_count(1), default=4, help="a checkpoint every this many steps")
    save_parser.add_argument("--layers", type=_count(1), default=8, help="Linear(1024, 1024) layers of the model")
    save_parser.add_argument("--repeats", type=_count(1), default=3, help="runs of each kind of save, alternating")
    save_parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    check_parser = commands.add_parser("check", help="every speed target against its limit; exit 1 on a miss")
    check_parser.add_argument("--only", default=",".join(targets.TARGETS),
                              help=f"comma-separated subset of {','.join(targets.TARGETS)}")
    check_parser.add_argument("--repeats", type=_count(1), default=3, help="attempts per target; the best counts")
    check_parser.add_argument("--notebooks", type=Path, default=Path("notebooks"),
                              help="the folder of the notebooks to time (default: ./notebooks)")
    options = parser.parse_args(argv)
    try:
        if options.what == "check":
            results = targets.run([n.strip() for n in options.only.split(",") if n.strip()], options.repeats,
                                options.notebooks)
            print(targets.format_table(results))
            return 0 if all(r.met for r in results) else 1
        print(_measure(options))
    except (ValueError, FileNotFoundError) as error:  # refused before any rank starts
        commands.choices[options.what].error(str(error))
    return 0


def _measure(options: argparse.Namespace) -> str:
    """Run the chosen benchmark; its table, or JSON records with ``--json``."""
    if options.what == "launch":
        methods = [m.strip() for m in options.methods.split(",") if m.strip()]
        timings = startup.measure(options.world_size, options.repeats, methods)
        if options.json:
            return json.dumps(startup.as_records(timings, options.world_size), indent=2)
        return startup.format_table(timings, options.world_size)
    if options.what == "live":
        rows = live.measure(options.world_size, options.samples, options.starts)
        return json.dumps(live.as_records(rows), indent=2) if options.json else live.format_table(rows)
    if options.what == "checkpoint":
        rows = checkpoint.measure(options.world_size, options.steps, options.every, options.layers, options.repeats)
        return json.dumps(checkpoint.as_records(rows), indent=2) if options.json else checkpoint.format_table(rows)
    if options.what == "fsdp":
        bench, rows = fsdp, fsdp.measure(options.world_size, options.steps)
    elif options.what == "ddp":
        bench, rows = ddp, ddp.measure(options.world_size, model=options.model, global_batch=options.global_batch,
                                       steps=options.steps, threads=options.threads)
    else:
        bench, rows = bandwidth, bandwidth.sweep(options.what, options.world_size, options.min_bytes,
                                                 options.max_bytes, iters=options.iters, warmup=options.warmup,
                                                 algo=options.algo)
    return json.dumps(bench.as_records(rows), indent=2) if options.json else bench.format_table(rows)


if __name__ == "__main__":
    sys.exit(main())
