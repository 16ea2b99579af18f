"""Hello, ranks: every rank adds its rank number with one all-reduce.

Run it either way; the output is the same::

    python -m dtlib.examples.hello --world-size 2
    torchrun --standalone --nproc_per_node=2 -m dtlib.examples.hello
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import dtlib


def sum_of_ranks(rank: int, world_size: int) -> dict[str, int]:
    """All-reduce each rank's number; every rank ends with 0 + 1 + ... + (world_size - 1)."""
    value = torch.tensor([float(rank)], device=dtlib.rank_device())  # the CPU under gloo, GPU LOCAL_RANK under NCCL
    dist.all_reduce(value)  # SUM by default, in place
    return {"rank": rank, "world_size": world_size, "local_rank": int(os.environ["LOCAL_RANK"]),
            "pid": os.getpid(), "sum": int(value.item())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="ranks to start (ignored under torchrun)")
    options = parser.parse_args()
    results = dtlib.run(sum_of_ranks, world_size=options.world_size)
    if not dtlib.under_torchrun() or int(os.environ["RANK"]) == 0:
        for result in results:
            print(f"rank {result['rank']} of {result['world_size']}: sum of ranks = {result['sum']}")


if __name__ == "__main__":
    main()
