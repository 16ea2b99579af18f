"""Benchmarks, run as ``python -m dtlib.bench <what>``; each prints a table (or JSON), and each module
below declares only its columns (``dtlib.bench._table`` writes every table and every JSON record).

- ``launch`` (``dtlib.bench.startup``): how long a one-all-reduce job takes from the call to the
  results, per start method, beside plain ``torch.multiprocessing.spawn``.
- ``allreduce``, ``allgather``, ``reducescatter``, ``broadcast`` (``dtlib.bench.bandwidth``): nccl-tests-style
  sweeps over message sizes with algbw and busbw (``--algo ring`` for the send/recv ring).
- ``ddp``, ``fsdp`` (``dtlib.bench.ddp``, ``dtlib.bench.fsdp``): the runners' step times, memory and traffic,
  strategy against strategy.
- ``check`` (``dtlib.bench.targets``): every speed target against its limit, with repeats; exits 1 on a miss.
"""

from types import ModuleType

from dtlib._lazy import submodule


def __getattr__(name: str) -> ModuleType:
    return submodule(__name__, name)  # dtlib.bench.ddp in a cell, beside dtlib.train.ddp, without importing it first
