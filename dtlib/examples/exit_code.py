"""One rank fails with an exit code of its own: torchrun stops the others, names each rank's code in its
summary, and exits with 1.

    torchrun --standalone --nproc_per_node=2 -m dtlib.examples.exit_code --rank 1 --code 3; echo $?
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=1, help="the rank that fails")
    parser.add_argument("--code", type=int, default=3, help="the exit code it fails with")
    parser.add_argument("--wait", type=float, default=30.0, help="seconds the other ranks work before they finish")
    options = parser.parse_args(argv)
    rank = int(os.environ["RANK"])  # set by torchrun
    if rank == options.rank:
        print(f"rank {rank}: exiting with code {options.code}", flush=True)
        sys.exit(options.code)
    time.sleep(options.wait)  # still working when the failure comes: torchrun stops it (SIGTERM)
    print(f"rank {rank}: done", flush=True)


if __name__ == "__main__":
    main()
