"""Benchmarks, run as ``python -m dtlib.bench <what>``; each prints a table (or JSON).

- ``launch``: how long a one-all-reduce job takes from the call to the results,
  per start method, beside plain ``torch.multiprocessing.spawn``.
- ``allreduce``, ``allgather``, ``reducescatter``, ``broadcast``: nccl-tests-style
  sweeps over message sizes with algbw and busbw (``--algo ring`` for the send/recv ring).
- ``ddp``, ``fsdp``: the runners' step times, memory and traffic, strategy against strategy.
- ``check``: every speed target against its limit, with repeats; exits 1 on a miss (see ``dtlib.bench.check``).
"""
