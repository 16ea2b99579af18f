"""``python -m dtlib.bench <what> [options]``; ``--help`` lists what can be measured."""

from __future__ import annotations

import argparse
import json
import sys

from dtlib.bench import collective, ddp, fsdp, launch


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
    for op in collective.OPS:
        sweep_parser = commands.add_parser(op, help=f"nccl-tests-style {op} sweep over message sizes")
        sweep_parser.add_argument("--world-size", type=int, default=2)
        sweep_parser.add_argument("--min-bytes", default="1K", help="smallest S, e.g. 1K (K, M, G = 1024^1..3)")
        sweep_parser.add_argument("--max-bytes", default="64M", help="largest S, e.g. 64M")
        sweep_parser.add_argument("--iters", type=int, default=20, help="timed iterations per size")
        sweep_parser.add_argument("--warmup", type=int, default=5, help="untimed iterations per size first")
        sweep_parser.add_argument("--algo", choices=["library", "ring"], default="library",
                                  help="ring: dtlib's send/recv ring all-reduce (allreduce only)")
        sweep_parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ddp_parser = commands.add_parser("ddp", help="DDP step time on 1 rank against N, buckets, overlap")
    ddp_parser.add_argument("--world-size", type=int, default=2)
    ddp_parser.add_argument("--model", default="wide_mlp", help="a name from dtlib.models.MODELS")
    ddp_parser.add_argument("--global-batch", type=int, default=2048)
    ddp_parser.add_argument("--steps", type=int, default=12)
    ddp_parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ddp_parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    fsdp_parser = commands.add_parser("fsdp", help="DDP against FSDP strategies: memory, traffic, time")
    fsdp_parser.add_argument("--world-size", type=int, default=2)
    fsdp_parser.add_argument("--steps", type=int, default=6)
    fsdp_parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    options = parser.parse_args(argv)

    if options.what == "launch":
        methods = [m.strip() for m in options.methods.split(",") if m.strip()]
        timings = launch.measure(options.world_size, options.repeats, methods)
        if options.json:
            print(json.dumps(launch.as_records(timings, options.world_size), indent=2))
        else:
            print(launch.format_table(timings, options.world_size))
    elif options.what == "fsdp":
        fsdp_rows = fsdp.measure(options.world_size, options.steps)
        print(json.dumps(fsdp.as_records(fsdp_rows), indent=2) if options.json else fsdp.format_table(fsdp_rows))
    elif options.what == "ddp":
        ddp_rows = ddp.measure(options.world_size, model=options.model, global_batch=options.global_batch,
                               steps=options.steps, threads=options.threads)
        print(json.dumps(ddp.as_records(ddp_rows), indent=2) if options.json else ddp.format_table(ddp_rows))
    else:
        rows = collective.sweep(options.what, options.world_size, options.min_bytes, options.max_bytes,
                                iters=options.iters, warmup=options.warmup, algo=options.algo)
        print(json.dumps(collective.as_records(rows), indent=2) if options.json else collective.format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
