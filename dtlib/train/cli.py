"""The command line for the course's runners: ``python -m dtlib.train ddp|fsdp [options]``.

The same command starts its own ranks from a shell, or runs on the ranks torchrun started, on one
machine or many::

    python -m dtlib.train ddp --world-size 2 --steps 8             # spawns 2 ranks itself
    torchrun --standalone --nproc_per_node=2 -m dtlib.train fsdp --api fsdp2
    srun torchrun --nnodes=$SLURM_NNODES --nproc_per_node=8 --rdzv_backend=c10d \\
        --rdzv_endpoint=$HEAD:29500 --rdzv_id=$SLURM_JOB_ID -m dtlib.train fsdp

Under torchrun the job's size is torchrun's ``WORLD_SIZE`` (``--world-size`` is ignored), and the
settings are checked against it. Rank 0 prints its losses and its traffic per step.
"""

from __future__ import annotations

import argparse
import os
import sys

from dtlib import arguments
from dtlib.launch.entry import under_torchrun
from dtlib.train import ddp, fsdp


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dtlib.train", description="Train a toy model on N ranks.")
    runners = parser.add_subparsers(dest="runner", required=True, metavar="{ddp,fsdp}")
    for name, text in (("ddp", "DDP (torch's, or dtlib's from scratch) on a toy model"),
                       ("fsdp", "a tiny transformer under FSDP2, FSDP1 or DDP")):
        runner = runners.add_parser(name, help=text, description=f"Train {text}.")
        runner.add_argument("--world-size", type=int, default=2, help="ranks to start (ignored under torchrun)")
        runner.add_argument("--timeout", type=_seconds, default=3600.0, metavar="SECONDS",
                            help="stop the ranks and show where each waits if the job runs longer (default 3600; "
                                 "'none': no limit; ignored under torchrun, which has its own)")
    ddp_options = runners.choices["ddp"]
    for name in ("model", "steps", "global_batch", "wrapper", "bucket_cap_mb"):
        default = getattr(ddp.TrainConfig, name)
        ddp_options.add_argument(f"--{name.replace('_', '-')}", default=default,
                                 type=type(default) if default is not None else float)
    fsdp_options = runners.choices["fsdp"]
    fsdp_options.add_argument("--api", default="fsdp2", choices=fsdp.APIS)
    fsdp_options.add_argument("--strategy", default="full_shard", choices=fsdp.STRATEGIES)
    fsdp_options.add_argument("--steps", type=int, default=4)
    fsdp_options.add_argument("--mixed-precision", action="store_true")
    fsdp_options.add_argument("--shard-group-size", type=int, default=2,
                              help="hybrid strategies: ranks per shard group (the GPUs of one node, say); the groups "
                                   "replicate")
    return parser


def _seconds(text: str) -> float | None:
    """An argparse type: a positive number of seconds, or ``none``."""
    if text.lower() == "none":
        return None
    try:
        return arguments.seconds("timeout", float(text))
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{error}; or 'none' for no limit") from None


def _losses(values: list[float]) -> str:
    return " ".join(f"{v:.4f}" for v in values)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (``sys.argv[1:]`` by default), train, print rank 0's view; return the exit status.

    Example: ``main(["ddp", "--steps", "3"])``.
    """
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in ("ddp", "fsdp"):  # argparse would exit; say how instead, with status 2
        print("usage: python -m dtlib.train {ddp|fsdp} [options]   (--help after the runner's name)", file=sys.stderr)
        return 2
    parser = _parser()
    options = vars(parser.parse_args(args))
    runner, world_size, timeout = options.pop("runner"), options.pop("world_size"), options.pop("timeout")
    if under_torchrun():
        world_size = int(os.environ["WORLD_SIZE"])
    module, config = (ddp, ddp.TrainConfig(**options)) if runner == "ddp" else (fsdp, fsdp.FSDPConfig(**options))
    try:
        module.validate(config, world_size)  # a bad setting is a usage error, not a traceback
    except ValueError as error:
        parser.error(f"{runner}: {error}")
    spawn_options = {} if under_torchrun() else {"timeout": timeout}
    if runner == "ddp":
        results = ddp.run(config, world_size, **spawn_options)
        first = results[0]
        lines = [f"DDP on {first.world_size} rank(s), {first.backend}: losses {_losses(first.losses)}",
                 f"all-reduce calls per step: {first.comm_calls[-1]}, bytes per step: {first.comm_bytes[-1]}"]
    else:
        results = fsdp.run(config, world_size, **spawn_options)
        first = results[0]
        lines = [f"{first.api} {options['strategy']} on {first.world_size} ranks: losses {_losses(first.losses)}",
                 f"model state on rank 0: {sum(first.memory_at_rest.values())} bytes "
                 f"(formula {sum(first.estimate.values()):.0f}); collectives per step: {first.comm[-1]}"]
    if int(os.environ.get("RANK", 0)) == 0:
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
