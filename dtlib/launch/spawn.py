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
import os
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dtlib import arguments, compat
from dtlib.errors import WorkerError, WorkerTimeout
from dtlib.launch import joblog, pickling
from dtlib.launch.device import why_gpus_cannot_be_shared
from dtlib.launch.job import Job
from dtlib.launch.processes import HeldInterrupts, start_forkserver, start_rank
from dtlib.launch.strict import STRICT_ENV

BACKENDS = ("auto", "gloo", "nccl", "mpi")
#: Set to a backend, it is what ``backend="auto"`` means in this process and its children: the CPU test suite
#: sets ``gloo`` so that it runs as written on a GPU machine (tests/conftest.py), and the GPU suite leaves it unset.
BACKEND_OVERRIDE = "DTLIB_BACKEND"
START_METHODS = ("auto", "spawn", "forkserver", "fork")
OUTPUT_MODES = ("all", "rank0", "none")
FINISH_GRACE_S = 10.0  # after the last result, how long ranks may take to tear down and exit
# torch._dynamo: every torch.optim optimizer imports it on construction (about 1 s per rank here);
# importing it once in the server makes a rank that builds an optimizer start in 0.1 s, not 1.1 s.
FORKSERVER_PRELOAD = ["cloudpickle", "torch", "torch.distributed", "torch._dynamo", "dtlib.launch.worker"]
RANKS_PER_CORE_WARNING = 4  # more ranks than this per core: warn (each rank is a process that imports torch)
FDS_PER_RANK = 12  # descriptors held here per rank: 7 measured (6 pipe ends, a store connection), and room
FDS_KEPT_FREE = 64  # for everything else the caller has open
MAX_PROCESSES = 1 << 22  # Linux's largest possible pid_max


def resolve_backend(backend: str, world_size: int) -> str:
    """The backend a job of ``world_size`` ranks gets: ``auto`` means NCCL with one GPU per rank, else gloo
    (or what :data:`BACKEND_OVERRIDE` names, where it is set).

    Example: ``resolve_backend("auto", 2)`` is ``"gloo"`` on a laptop without GPUs.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    gpus = torch.cuda.device_count()  # NVML-based: does not initialise CUDA in this process
    if backend == "auto":
        forced = os.environ.get(BACKEND_OVERRIDE, "")
        if forced:
            if forced not in BACKENDS or forced == "auto":
                raise ValueError(f"{BACKEND_OVERRIDE}={forced!r}: it must name one of {BACKENDS[1:]} (or be unset)")
            return resolve_backend(forced, world_size)
        return "nccl" if dist.is_nccl_available() and gpus >= world_size else "gloo"
    if backend == "nccl" and (not dist.is_nccl_available() or gpus < world_size):
        shared = why_gpus_cannot_be_shared() if dist.is_nccl_available() and gpus else ""
        if shared is None:
            return backend  # opted in, and NCCL shares a GPU among ranks (device.gpu_of deals them out)
        raise ValueError(
            f"backend='nccl' needs one CUDA GPU per rank: world_size={world_size}, but this machine has {gpus} "
            f"GPU(s){'' if dist.is_nccl_available() else ' and this torch has no NCCL'}. "
            f"Use backend='gloo' (CPU) or backend='auto'.{' ' + shared if shared else ''}"
        )
    if backend == "mpi" and not dist.is_mpi_available():
        raise ValueError("backend='mpi' needs a torch built with MPI; this one is not")
    return backend


def _valid_env(env: Mapping[str, str] | None) -> dict[str, str]:
    """``spawn``'s ``env``, checked: names and values are strings, a name has no ``=`` and neither has a NUL."""
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise TypeError(f"env must be a dict of variable names to values, got {type(env).__name__}")
    for name, value in env.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise TypeError(f"env's names and values must be strings, got {name!r}: {value!r}")
        if not name or "=" in name or "\0" in name + value:
            raise ValueError(f"env has a name or value no environment can hold: {name!r}: {value!r}")
    return dict(env)


#: NCCL's once-per-process warning that an unbatched send or recv is serialised with the group's other calls
#: (dtlib's NCCL ranks initialise eagerly, with ``device_id``). The course teaches the same in its own words
#: (notebooks 02 and 03, strict mode's note), and torch's text would land in the stderr of checked cells.
NCCL_P2P_WARNING = "TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING"


def rank_environment(requested: str, resolved: str) -> dict[str, str]:
    """Variables every rank gets for this choice of backend: where ``backend="auto"`` chose gloo on a machine
    with GPUs (fewer than ranks), the ranks compute on the CPU and see no GPU (``CUDA_VISIBLE_DEVICES=""``), so
    torch's own defaults agree with them: ``fully_shard``'s default mesh would otherwise be a CUDA mesh that
    sets GPU ``LOCAL_RANK`` (absent on rank 1 of a one-GPU machine), and PowerSGD's hook would synchronise a
    GPU for CPU tensors. A job that names ``backend="gloo"`` keeps the GPUs (gloo reduces CUDA tensors too).
    NCCL ranks get :data:`NCCL_P2P_WARNING` off, unless the caller's environment sets it.

    Example: ``rank_environment("auto", "gloo")`` is ``{"CUDA_VISIBLE_DEVICES": ""}`` on a one-GPU machine.
    """
    if requested == "auto" and resolved == "gloo" and torch.cuda.device_count() > 0:
        return {"CUDA_VISIBLE_DEVICES": ""}
    if resolved == "nccl" and NCCL_P2P_WARNING not in os.environ:
        # GPU run must confirm: with this set, 02's send/recv cells on NCCL ranks print nothing on stderr
        return {NCCL_P2P_WARNING: "false"}
    return {}


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


def _payload(fn: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> tuple[bytes, dict[str, list[str]]]:
    """Pickle the call by value, naming the part that cannot be pickled.

    Also returns the source lines of the notebook cells whose code travels in it, so that
    a remote traceback shows them; every other cell's source (the whole history) stays here.
    """
    parts = [("fn", fn)] + [(f"args[{i}]", a) for i, a in enumerate(args)]
    parts += [(f"kwargs[{k!r}]", v) for k, v in kwargs.items()]
    return pickling.dumps((fn, args, kwargs), parts=parts, refusal="dtlib.spawn cannot send {part} to the ranks")


def _payloads(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], world_size: int,
              rank_args: Sequence[Any] | None) -> tuple[bytes | list[bytes], dict[str, list[str]]]:
    """One payload for every rank, or, with ``rank_args``, one per rank holding that rank's value alone."""
    if rank_args is None:
        return _payload(fn, args, kwargs)
    if isinstance(rank_args, (str, bytes, bytearray)) or not isinstance(rank_args, Sequence) or \
            len(rank_args) != world_size:
        raise TypeError(f"rank_args must be a list of one value per rank ({world_size}), got {rank_args!r:.60}")
    payloads, sources = [], {}
    for value in rank_args:
        payload, more = _payload(fn, (*args, value), kwargs)
        payloads.append(payload)
        sources |= more
    return payloads, sources


def usable_cores() -> int:
    """CPU cores this process may run on. Example: ``usable_cores()`` is 2 on a two-core laptop."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def max_world_size() -> int:
    """The most ranks this process can hold pipes for, given its open-file limit (``ulimit -n``).

    Example: with ``ulimit -n`` at 1024, ``max_world_size()`` is (1024 - 64) // 12 = 80.
    """
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError):
        return MAX_PROCESSES
    if soft == resource.RLIM_INFINITY:
        return MAX_PROCESSES
    return max(1, min(MAX_PROCESSES, (soft - FDS_KEPT_FREE) // FDS_PER_RANK))


def valid_world_size(world_size: Any) -> int:
    count = arguments.count("world_size", world_size, 1)  # any integral number: int, numpy.int64, ...
    limit = max_world_size()
    if count > limit:
        raise ValueError(
            f"world_size={count} is more ranks than dtlib.spawn can start here: at most {limit}, since "
            f"this process holds about {FDS_PER_RANK} file descriptors per rank and may open "
            "as many as `ulimit -n` allows"
        )
    cores = usable_cores()
    if count > RANKS_PER_CORE_WARNING * cores:
        warnings.warn(
            f"world_size={count} starts {count} processes on {cores} CPU core(s); each one imports torch "
            f"and takes memory, so more than {RANKS_PER_CORE_WARNING * cores} may exhaust this machine",
            RuntimeWarning,
            stacklevel=3,
        )
    return count


def valid_call_arguments(args: Any, kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` as a tuple and ``kwargs`` as a dict, or a TypeError naming the one that is neither.

    Example: ``valid_call_arguments([1], None) == ((1,), {})``; ``valid_call_arguments(5, None)`` raises.
    """
    if isinstance(args, (str, bytes, bytearray)) or not isinstance(args, Sequence):
        raise TypeError(
            f"args must be a tuple or list of fn's extra positional arguments, got {type(args).__name__} "
            f"{args!r:.60}; for a single argument write args=({args!r:.60},)"
        )
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(key, str) for key in kwargs):
        raise TypeError(f"kwargs must be a dict of fn's keyword arguments (str keys), got {kwargs!r:.60}")
    return tuple(args), dict(kwargs)


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
    strict: bool | None = None,
    env: Mapping[str, str] | None = None,
    rank_args: Sequence[Any] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` in ``world_size`` new processes.

    Returns the ranks' return values as a list indexed by rank. ``fn`` may be a
    function defined in a notebook cell, a lambda or a closure (it is shipped
    by value). Each rank gets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and
    ``LOCAL_WORLD_SIZE`` as torchrun sets them, and gloo's and NCCL's sockets stay on the
    loopback interface (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``) unless you set those
    variables yourself. dtlib joins the ranks through a file only your user can open; with
    ``init_process_group=False``, ``fn`` joins them itself, so the ranks also get ``MASTER_ADDR`` and ``MASTER_PORT``,
    the address of a TCP store on 127.0.0.1 that this process holds, as torchrun's is.

    Args:
        world_size: the number of ranks, any whole number (a warning above 4 per CPU core).
        backend: ``auto`` (NCCL with one GPU per rank, else gloo on CPU), ``gloo``,
            ``nccl`` or ``mpi``.
        start_method: ``auto`` (``forkserver`` where available, else ``spawn``),
            ``spawn``, ``forkserver`` or ``fork``.
        timeout: seconds ``fn`` may run, counted from the moment every rank is ready to call it
            (started, and in the process group): then every rank is stopped and :class:`WorkerTimeout`
            is raised with each running rank's stack. Starting may take up to
            ``dtlib.launch.job.STARTUP_S`` (60 s) more, so a busy machine's slow start is not taken for a
            hang. ``None`` (or ``inf``) waits for ever.
        init_process_group: initialise the default process group before ``fn``
            and destroy it after (unless ``fn`` did); ``False`` leaves both to ``fn``
            (``init_method="env://"``, the default, finds the TCP store).
        output: ``all`` relays every rank's output prefixed ``[rank N]``,
            ``rank0`` only rank 0's, ``none`` nothing. Lines come a few times a
            second in batches; a line without its newline (a progress bar) too.
        strict: hold gloo ranks to what NCCL promises (:mod:`dtlib.launch.strict`: a reduce's other ranks
            read NaN, an async collective's tensors read NaN until ``wait()``, ...), so that code that works
            only on gloo fails here; ``False`` shows gloo's own behaviour; ``None`` (the default) means on,
            unless ``DTLIB_STRICT=0`` is in the environment.
        env: more environment variables for every rank, set before torch starts there, over dtlib's own:
            ``{"NCCL_DEBUG": "INFO"}``, or ``{"CUDA_VISIBLE_DEVICES": ""}`` for CPU ranks that must not see
            a GPU (the checkers' ranks: a ``fully_shard`` without a mesh would otherwise build a CUDA one).
        rank_args: one value per rank: rank ``r`` gets ``rank_args[r]`` as one more positional argument, after
            ``args``, and only its own, sent to it alone (the checkers hand each rank its own input this way, so
            no rank can find another's in what it was sent).

    Raises:
        WorkerError: a rank raised or died; every failed rank is reported.
        WorkerTimeout: ranks were still running after ``timeout`` seconds.
        KeyboardInterrupt: you interrupted; every rank was stopped first, and
            further interrupts during that clean-up wait until it is done.

    Example::

        dtlib.spawn(lambda rank, world_size: rank * 10, world_size=3)  # [0, 10, 20]
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    world_size = valid_world_size(world_size)
    args, kwargs = valid_call_arguments(args, kwargs)
    timeout = arguments.seconds("timeout", timeout)
    if output not in OUTPUT_MODES:
        raise ValueError(f"output must be one of {OUTPUT_MODES}, got {output!r}")
    resolved_backend = resolve_backend(backend, world_size)
    method = resolve_start_method(start_method)
    payload, sources = _payloads(fn, args, kwargs, world_size, rank_args)

    if strict is not None and not isinstance(strict, bool):
        raise TypeError(f"strict must be True, False or None, got {strict!r}")
    wanted_env = _valid_env(env)
    env = rank_environment(backend, resolved_backend)
    if strict is not None:
        env[STRICT_ENV] = "1" if strict else "0"
    env |= wanted_env

    job = Job(world_size, output, method)
    joblog.record("spawn", world_size, backend, resolved_backend)
    try:
        results = _run(job, method, payload, sources, resolved_backend if init_process_group else None, timeout,
                       env or None)
    except BaseException as exc:
        finish(job)  # a KeyboardInterrupt lands here too: no rank outlives the call
        traceback.clear_frames(exc.__traceback__)  # what dtlib's frames held (half-started processes) goes now
        raise
    finish(job).deliver()
    return results


def start_job(job: Job, method: str, payload: bytes | list[bytes], sources: dict[str, list[str]], backend: str | None,
              env: dict[str, str] | None = None) -> None:
    """Start ``job``'s ranks with ``method`` and serve their rendezvous store (used by :class:`dtlib.LiveRanks` too)."""
    ctx = mp.get_context(method)
    if backend is None:  # the ranks' own code joins, through env:// as under torchrun: it needs a TCP store
        job.listen(compat.loopback_listener(min(job.world_size, 1 << 16)))
    else:  # dtlib joins them, through a file only this user can open
        job.private_store()
    if method == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # no effect once the server runs
        start_forkserver()
    job.start(ctx, payload, backend, sources, start=lambda process: start_rank(process, method), env=env)
    # The store starts after the ranks: it runs a thread, and forking a process while
    # one of its threads holds a lock can deadlock the child. Ranks that connect
    # earlier wait in the socket's backlog.
    if job.listener is not None:
        job.store = compat.store_on(job.listener)


def _run(job: Job, method: str, payload: bytes | list[bytes], sources: dict[str, list[str]], backend: str | None,
         timeout: float | None, env: dict[str, str] | None = None) -> list[Any]:
    start_job(job, method, payload, sources, backend, env)
    outcome = job.wait(timeout)
    if outcome == "ok":
        job.stop(grace_s=FINISH_GRACE_S)
        return [state.outcome[1] for state in job.ranks]
    if outcome == "timeout":
        stacks = job.collect_stacks()
        finished = [s.rank for s in job.ranks if s.outcome is not None]
        raise WorkerTimeout(timeout or 0.0, stacks, finished)
    raise WorkerError(job.failures())


def finish(job: Job) -> HeldInterrupts:
    """Stop every rank and release everything, with Ctrl-C held back until it is done.

    A second (or third) interrupt during clean-up would otherwise cut it short and leave
    ranks, pipes and a listening store behind. Returns the held interrupts, for the caller
    to deliver when no exception is on its way already.
    """
    with HeldInterrupts() as held:
        try:
            job.stop(grace_s=0.0)
        finally:
            job.close()
    return held
