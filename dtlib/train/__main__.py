"""``python -m dtlib.train ddp|fsdp ...``: the runners' command line (:mod:`dtlib.train.cli`)."""

import sys

from dtlib.train.cli import main

sys.exit(main())
