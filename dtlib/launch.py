"""``dtlib.spawn``: start ranks from a notebook cell, get their results, never hang.

Example::

    import dtlib, torch, torch.distributed as dist

    def total(rank, world_size):
        t = torch.tensor([rank])
        dist.all_reduce(t)            # the process group is already initialised
        return t.item()

    dtlib.spawn(total, world_size=2)  # -> [1, 1]
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from dtlib import compat
from dtlib._job import Job
from dtlib.errors import WorkerError, WorkerTimeout

BACKENDS = ("auto", "gloo", "nccl", "mpi")
START_METHODS = ("auto", "spawn", "forkserver", "fork")
OUTPUT_MODES = ("all", "rank0", "none")
FINISH_GRACE_S = 10.0  # after the last result, how long ranks may take to tear down and exit
# torch._dynamo: every torch.optim optimizer imports it on construction (about 1 s per rank here);
# importing it once in the server makes a rank that builds an optimizer start in 0.1 s, not 1.1 s.
FORKSERVER_PRELOAD = ["cloudpickle", "torch", "torch.distributed", "torch._dynamo", "dtlib._worker"]


def resolve_backend(backend: str, world_size: int) -> str:
    """The backend a job of ``world_size`` ranks gets: ``auto`` means NCCL with one GPU per rank, else gloo.

    Example: ``resolve_backend("auto", 2)`` is ``"gloo"`` on a laptop without GPUs.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    gpus = torch.cuda.device_count()  # NVML-based: does not initialise CUDA in this process
    if backend == "auto":
        return "nccl" if dist.is_nccl_available() and gpus >= world_size else "gloo"
    if backend == "nccl" and (not dist.is_nccl_available() or gpus < world_size):
        raise ValueError(
            f"backend='nccl' needs one CUDA GPU per rank (NCCL refuses two ranks on one GPU): "
            f"world_size={world_size}, but this machine has {gpus} GPU(s)"
            f"{'' if dist.is_nccl_available() else ' and this torch has no NCCL'}. "
            "Use backend='gloo' (CPU) or backend='auto'."
        )
    if backend == "mpi" and not dist.is_mpi_available():
        raise ValueError("backend='mpi' needs a torch built with MPI; this one is not")
    return backend


def resolve_start_method(start_method: str) -> str:
    """``auto`` is ``forkserver`` where the platform has it (fast and CUDA-safe), else ``spawn``."""
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}")
    available = mp.get_all_start_methods()
    if start_method == "auto":
        return "forkserver" if "forkserver" in available else "spawn"
    if start_method not in available:
        raise ValueError(f"start_method={start_method!r} is not available here; use one of {available}")
    if start_method == "fork" and torch.cuda.is_initialized():
        raise RuntimeError(
            "start_method='fork' is unsafe once CUDA is initialised in this process "
            "(a forked child cannot use CUDA). Use start_method='forkserver' or 'spawn', "
            "or restart the kernel and avoid touching CUDA before forking."
        )
    return start_method


def _payload(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> bytes:
    """Pickle the call by value, naming the part that cannot be pickled."""
    try:
        return cloudpickle.dumps((fn, tuple(args), kwargs))
    except Exception as exc:  # noqa: BLE001 - re-raised with the culprit named
        parts = [("fn", fn)] + [(f"args[{i}]", a) for i, a in enumerate(args)]
        parts += [(f"kwargs[{k!r}]", v) for k, v in kwargs.items()]
        culprit = "the call"
        for name, value in parts:
            try:
                cloudpickle.dumps(value)
            except Exception:  # noqa: BLE001
                culprit = f"{name} ({type(value).__name__})"
                break
        raise TypeError(f"dtlib.spawn cannot send {culprit} to the ranks: it cannot be pickled: {exc}") from exc


def spawn(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    backend: str = "auto",
    start_method: str = "auto",
    timeout: float | None = 120.0,
    init_process_group: bool = True,
    output: str = "all",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` in ``world_size`` new processes.

    Returns the ranks' return values as a list indexed by rank. ``fn`` may be a
    function defined in a notebook cell, a lambda or a closure (it is shipped
    by value). Each rank gets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` as torchrun sets them.

    Args:
        backend: ``auto`` (NCCL with one GPU per rank, else gloo on CPU), ``gloo``,
            ``nccl`` or ``mpi``.
        start_method: ``auto`` (``forkserver`` where available, else ``spawn``),
            ``spawn``, ``forkserver`` or ``fork``.
        timeout: seconds before every rank is stopped and :class:`WorkerTimeout`
            is raised with each running rank's stack; ``None`` waits for ever.
        init_process_group: initialise the default process group before ``fn``
            and destroy it after; ``False`` leaves both to ``fn``.
        output: ``all`` relays every rank's output prefixed ``[rank N]``,
            ``rank0`` only rank 0's, ``none`` nothing.

    Raises:
        WorkerError: a rank raised or died; every failed rank is reported.
        WorkerTimeout: ranks were still running after ``timeout`` seconds.

    Example::

        dtlib.spawn(lambda rank, world_size: rank * 10, world_size=3)  # [0, 10, 20]
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    if output not in OUTPUT_MODES:
        raise ValueError(f"output must be one of {OUTPUT_MODES}, got {output!r}")
    kwargs = dict(kwargs or {})
    resolved_backend = resolve_backend(backend, world_size)
    method = resolve_start_method(start_method)
    payload = _payload(fn, args, kwargs)

    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # no effect once the server runs
    listener = compat.loopback_listener(world_size)
    store = None
    job = Job(world_size, output)
    try:
        job.start(ctx, method, payload, resolved_backend if init_process_group else None, listener)
        # The store starts after the ranks: it runs a thread, and forking a process while
        # one of its threads holds a lock can deadlock the child. Ranks that connect
        # earlier wait in the socket's backlog.
        store = compat.store_on(listener)
        outcome = job.wait(timeout)
        if outcome == "ok":
            job.stop(grace_s=FINISH_GRACE_S)
            return [state.outcome[1] for state in job.ranks]
        if outcome == "timeout":
            stacks = job.collect_stacks()
            finished = [s.rank for s in job.ranks if s.outcome is not None]
            job.stop(grace_s=0.0)
            raise WorkerTimeout(timeout or 0.0, stacks, finished)
        failures = job.failures()
        job.stop(grace_s=0.0)
        raise WorkerError(failures)
    except BaseException:
        job.stop(grace_s=0.0)  # a KeyboardInterrupt lands here too: no rank outlives the call
        raise
    finally:
        job.close()
        if store is None:
            listener.close()
        del store
