"""Where a rank finds its local rank: torchrun sets ``LOCAL_RANK``; the deprecated ``torch.distributed.launch``
also appends ``--local-rank=N`` to the script's arguments, which the script must accept.

    torchrun --standalone --nproc_per_node=2 -m dtlib.examples.local_rank --lr 0.1
    python -m torch.distributed.launch --nproc_per_node=2 -m dtlib.examples.local_rank --lr 0.1   # deprecated
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> None:
    arguments = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lr", type=float, default=0.1)
    # Only for the old launcher: without this line its --local-rank=N is an "unrecognized argument"
    parser.add_argument("--local-rank", "--local_rank", type=int, default=None)
    options = parser.parse_args(arguments)
    local_rank = int(os.environ["LOCAL_RANK"])  # what to use: both launchers set it
    line = f"LOCAL_RANK={local_rank}, arguments {arguments}, --local-rank {options.local_rank}\n"
    sys.stdout.write(line)  # one write: print() may write the text and its newline apart, and torchrun's
    sys.stdout.flush()  # --tee, reading the file as it grows, then prefixed half a line (seen in a gate run)


if __name__ == "__main__":
    main()
