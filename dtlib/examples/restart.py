"""One rank fails on the first attempts, and torchrun's ``--max_restarts`` starts every rank again: each attempt
joins a new process group, all-reduces, and says which attempt it is.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=2 --max_restarts=1 \\
        -m dtlib.examples.restart --rank 1 --failures 1

``TORCHELASTIC_RESTART_COUNT`` numbers the attempt (0 first), counted by each node's agent.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=1, help="the rank that fails")
    parser.add_argument("--failures", type=int, default=1, help="how many attempts it fails in, the first ones")
    parser.add_argument("--code", type=int, default=3, help="the exit code it fails with")
    options = parser.parse_args(argv)
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])  # set by torchrun's agent: 0, then 1, 2, ...
    dist.init_process_group("gloo")  # a new group each attempt, through the agent's rendezvous
    rank = dist.get_rank()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    print(f"attempt {attempt}: rank {rank} of {dist.get_world_size()} all-reduced {total.item():g}", flush=True)
    if rank == options.rank and attempt < options.failures:
        print(f"attempt {attempt}: rank {rank} exits with code {options.code}", flush=True)
        sys.exit(options.code)
    dist.barrier()  # the others wait here: the failure ends their attempt too
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
