"""What torchrun tells each rank: the environment variables, and one all-reduce to prove they connect.

    torchrun --standalone --nproc_per_node=2 -m dtlib.examples.env
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
         "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")


def main() -> None:
    dist.init_process_group("gloo")  # reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from the environment
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    seen = {name: os.environ.get(name) for name in NAMES}
    sys.stdout.write("DTLIB_ENV " + json.dumps({**seen, "sum_of_ranks": int(total.item())}) + "\n")  # one write
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
