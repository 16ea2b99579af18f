"""One entry point for the course's runners: ``python -m dtlib.train ddp|fsdp [options]``.

The same command runs under torchrun on one machine or many::

    python -m dtlib.train ddp --world-size 2 --steps 8             # spawns 2 ranks itself
    torchrun --standalone --nproc_per_node=2 -m dtlib.train fsdp --api fsdp2
    srun torchrun --nnodes=$SLURM_NNODES --nproc_per_node=8 --rdzv_backend=c10d \\
        --rdzv_endpoint=$HEAD:29500 --rdzv_id=$SLURM_JOB_ID -m dtlib.train fsdp
"""

from __future__ import annotations

import sys

from dtlib import ddp, fsdp

RUNNERS = {"ddp": ddp.main, "fsdp": fsdp.main}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in RUNNERS:
        print(f"usage: python -m dtlib.train {{{'|'.join(RUNNERS)}}} [options]   (--help after the runner's name)",
              file=sys.stderr)
        return 2
    RUNNERS[args[0]](args[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
