"""The code that runs inside every rank started by :func:`dtlib.spawn`.

Under the ``spawn`` start method this module, and with it dtlib and torch, is imported before the
rank's environment is in place; :func:`main` then makes torch see the final one: CUDA reads
``CUDA_VISIBLE_DEVICES`` only when it starts, and the worker re-applies ``OMP_NUM_THREADS`` and
``TORCH_DISTRIBUTED_DEBUG``, which torch read at import.

The parent talks to a rank through five pipes:

- ``stdout`` and ``stderr``: file descriptors 1 and 2 of the rank, C-level output
  (gloo, NCCL) included, which the parent relays in batches, ``[rank N]`` on each line;
- ``result``: one framed message, ``("ok", value)`` or ``("error", details)``;
- ``stacks``: where :mod:`faulthandler` writes every thread's Python stack when
  the parent sends ``SIGUSR1`` (used for the timeout report);
- ``alive``: the parent holds the write end. End-of-file means either "every
  rank has reported, finish now" or "the parent died"; in both cases the rank
  must not outlive it.
"""

from __future__ import annotations

import ctypes
import faulthandler
import io
import multiprocessing
import os
import signal
import sys
import threading
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from dtlib import compat
from dtlib.launch import pickling, strict
from dtlib.launch.device import gpu_of
from dtlib.launch.proctree import descendants, reap_orphans
from dtlib.launch.shards import local_mesh, local_shard

STACK_SIGNAL = signal.SIGUSR1
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


@dataclass
class WorkerConfig:
    """Everything a rank needs besides the pickled function."""

    rank: int
    world_size: int
    env: dict[str, str]  # the parent's environment plus the torchrun variables
    backend: str | None  # None: the function initialises the process group itself
    source_lines: dict[str, list[str]]  # linecache entries, so tracebacks show cell code
    close_fds: list[int]  # parent-side descriptors a forked child inherits
    store_file: str = ""  # the private FileStore dtlib's own join goes through (see dtlib.launch.job)


@dataclass
class WorkerPipes:
    """The child's ends of the five pipes described in the module docstring."""

    result: Connection
    stdout: Connection
    stderr: Connection
    stacks: Connection
    alive: Connection
    channels: list[Connection] = field(default_factory=list)  # two-way, for a caller that asks for them


_held: list[Any] = []  # objects that must stay alive for the life of the process
_channels: list[Connection] = []


def channels() -> list[Connection]:
    """This rank's ends of the two-way channels its job asked for (``Job(channels=N)``); empty by default."""
    return list(_channels)


def _redirect_output(pipes: WorkerPipes) -> None:
    os.dup2(pipes.stdout.fileno(), 1)
    os.dup2(pipes.stderr.fileno(), 2)
    # Fresh line-buffered streams: under ``fork`` the inherited sys.stdout may be a
    # Jupyter stream object that must not be used from a child process.
    sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(open(2, "wb", closefd=False), line_buffering=True)
    stack_file = open(pipes.stacks.fileno(), "w", closefd=False)
    _held.append(stack_file)
    faulthandler.register(STACK_SIGNAL, file=stack_file, all_threads=True, chain=False)
    faulthandler.enable(file=sys.stderr, all_threads=True)


def _watch_parent(alive: Connection, finished: threading.Event) -> None:
    """Block until the parent closes its end, then make sure this rank ends."""
    try:
        os.read(alive.fileno(), 1)
    except OSError:
        pass
    if not finished.wait(timeout=0.0):
        # The parent went away (or is stopping us) while fn was still running: the parent ends the whole tree.
        _hand_over()


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this rank when its parent dies.

    The watcher thread needs the GIL to notice; a rank inside a long C call that holds
    the GIL would outlive the notebook's kernel without this. Linux sends the signal when
    the thread that started the rank ends: the thread inside ``dtlib.spawn`` (``fork``,
    ``spawn``), which lives as long as the rank, or the forkserver's only thread.
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(75)


def _leave_the_forkserver_alone() -> None:
    """Close this rank's copy of the pipe that keeps multiprocessing's forkserver running.

    The server exits when every holder of that pipe's write end is gone; a rank keeping a
    copy would keep it (and so itself, through ``PR_SET_PDEATHSIG``) alive after the kernel
    died. Only in a rank the forkserver started: there ``_forkserver_pid`` is None.
    """
    forkserver = sys.modules.get("multiprocessing.forkserver")
    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None and getattr(server, "_forkserver_pid", 0) is None:
        try:
            os.close(fd)
        except OSError:
            pass
        server._forkserver_alive_fd = None  # type: ignore[union-attr]


def describe(exc: BaseException) -> str:
    """``str(exc)``, or a note saying it failed: a broken ``__str__`` must not hide the error."""
    try:
        return str(exc)
    except BaseException as inner:  # noqa: BLE001 - whatever __str__ raises
        return f"<str() of this {type(exc).__qualname__} raised {type(inner).__qualname__}>"


def _error_details(exc: BaseException) -> dict[str, str]:
    tb = exc.__traceback__
    if tb is not None and tb.tb_frame.f_code is main.__code__ and tb.tb_next is not None:
        tb = tb.tb_next  # start the remote traceback at the user's code, not at dtlib's
    message = describe(exc)
    try:
        text = "".join(traceback.format_exception(type(exc), exc, tb))
    except BaseException:  # noqa: BLE001 - a broken exception must still be reported
        text = "".join(traceback.format_tb(tb)) + f"{type(exc).__qualname__}: {message}\n"
    return {"type": type(exc).__qualname__, "module": type(exc).__module__, "message": message, "traceback": text}


def dumps_result(value: Any) -> bytes:
    """Pickle a result; CUDA tensors travel as CPU tensors so the parent never touches CUDA, a tensor computed
    with autograd (``model.weight[0]``, a loss) travels detached: its graph cannot leave the rank, a
    functional collective's result is waited for, as its first use in the rank would, and a DTensor travels as
    this rank's :class:`dtlib.launch.shards.LocalShard` and a DeviceMesh as its ``LocalMesh`` (process groups
    cannot leave the rank)."""
    # a functional collective's unwaited result: torch waits for it on first use, and so does sending it back
    unwaited = getattr(sys.modules.get("torch.distributed._functional_collectives"), "AsyncCollectiveTensor", None)

    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    device_mesh = getattr(sys.modules.get("torch.distributed.device_mesh"), "DeviceMesh", None)

    class ResultPickler(cloudpickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if unwaited is not None and isinstance(obj, unwaited):
                return _identity, (obj.wait(),)
            if dtensor is not None and isinstance(obj, dtensor):  # its mesh cannot leave the rank: its part can
                return _identity, (local_shard(obj),)
            if device_mesh is not None and isinstance(obj, device_mesh):  # nor its process groups
                return _identity, (local_mesh(obj),)
            if isinstance(obj, torch.Tensor) and (obj.device.type != "cpu" or obj.grad_fn is not None):
                return _identity, (obj.detach().cpu(),)
            return super().reducer_override(obj)

    buffer = io.BytesIO()
    ResultPickler(buffer).dump(value)
    return buffer.getvalue()


def _identity(value: Any) -> Any:
    return value


def _init_process_group(backend: str, config: WorkerConfig) -> None:
    """Join the default group through the job's private FileStore (a file in a folder only this user can open).

    The store is handed over as an object, not as a ``file://`` URL: a URL would need the path quoted, and torch
    reads a ``#`` or a ``?`` in it as the start of a fragment or a query (the store then lands elsewhere)."""
    join = {"store": dist.FileStore(config.store_file, config.world_size), "rank": config.rank,
            "world_size": config.world_size}
    if backend == "nccl":
        device = torch.device("cuda", gpu_of(int(os.environ["LOCAL_RANK"]), torch.cuda.device_count()))
        torch.cuda.set_device(device)
        dist.init_process_group(backend, device_id=device, **join)
    else:
        dist.init_process_group(backend, **join)


def _hand_over() -> None:
    """End this rank by stopping it (SIGSTOP, every thread at once), for the parent to end it and its whole tree.

    A rank that exited would hand its orphans (a double-forked daemon, a process a timer started a moment
    before) to init, out of the parent's reach; a stopped rank forks nothing more and stays their reaper, so
    the parent's :func:`dtlib.launch.processes.end_tree` finds every one. A thread the function left running
    does not hold the exit up either. If the parent died instead, Linux kills the stopped rank
    (``PR_SET_PDEATHSIG``); elsewhere, with no ``/proc`` to see a stopped rank by, the rank exits.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    if sys.platform.startswith("linux"):
        # Sent to this thread: sent to the process, another thread may take it while this one runs on (to exit)
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
    os._exit(75)  # not Linux, or continued by someone else: leave at once


def _end_escapers() -> list[tuple[int, str]]:
    """SIGKILL every process below this rank in a group or session of its own (``start_new_session=True``, a
    double-forked daemon, which the rank reaps), which ending the rank's group cannot reach; ``(pid, name)`` of
    each one ended."""
    own, ended = os.getpgid(0), []
    for pid, group, name in descendants(os.getpid()):
        if group != own:
            try:
                os.kill(pid, signal.SIGKILL)
                ended.append((pid, name))
            except OSError:
                pass
    return ended


def _end_what_fn_left(rank: int) -> None:
    """End the processes fn started and left running that would escape the rank's end: multiprocessing children
    that are not daemons (Python waits for them before the rank can exit: a silent stall), and processes in
    a group of their own (:func:`_end_escapers`). Processes still in the rank's group, daemons among them, end
    with the group, as before. Each is named on stderr."""
    ended = []
    waiting = [child for child in multiprocessing.active_children() if not child.daemon]
    for child in waiting:
        child.terminate()
        ended.append(f"{child.name} (pid {child.pid}, a multiprocessing child that is not a daemon)")
    for child in waiting:
        child.join(timeout=1.0)
        if child.is_alive():
            child.kill()
            child.join(timeout=1.0)
    ended += [f"{name} (pid {pid}, in a process group of its own)" for pid, name in _end_escapers()]
    if ended:
        print(f"dtlib: rank {rank}'s function returned and left {len(ended)} process(es) running; ended: "
              f"{'; '.join(ended)}. Wait for them (join) before returning, to keep their work.", file=sys.stderr)
    threads = [thread.name for thread in threading.enumerate()
               if thread.is_alive() and not thread.daemon and thread is not threading.main_thread()]
    if threads:
        print(f"dtlib: rank {rank}'s function returned and left {len(threads)} thread(s) running that are not "
              f"daemons: {', '.join(threads)}. They end with the rank; join them before returning, to keep their "
              "work.", file=sys.stderr)


def main(payload: bytes, config: WorkerConfig, pipes: WorkerPipes) -> None:
    """Entry point of one rank: run ``fn(rank, world_size, *args, **kwargs)`` and report."""
    for fd in config.close_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    os.setpgid(0, 0)  # own process group: the parent can stop the rank and its children
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles interrupts
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked while it started; ignored now
    _die_with_parent()
    reap_orphans()  # a double-forked daemon stays below the rank, where its end finds it
    _leave_the_forkserver_alone()
    _redirect_output(pipes)
    _channels[:] = pipes.channels
    finished = threading.Event()
    threading.Thread(target=_watch_parent, args=(pipes.alive, finished), daemon=True).start()

    os.environ.clear()
    os.environ.update(config.env)
    pickling.install_sources(config.source_lines)

    message: tuple[str, Any]
    initialised = False
    try:
        # NCCL's contract on gloo, unless dtlib.spawn(strict=False) or DTLIB_STRICT=0; before the call is unpickled,
        # so that a name a cell imported (from torch.distributed import reduce) comes back held to it too
        if config.backend == "gloo" and strict.wanted():
            strict.install()
        fn, args, kwargs = cloudpickle.loads(payload)
        if "OMP_NUM_THREADS" in os.environ:  # torch was imported before the variable was set
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        dist.set_debug_level_from_env()  # likewise TORCH_DISTRIBUTED_DEBUG, read at import
        if config.backend is not None:
            _init_process_group(config.backend, config)
            initialised = True
        pipes.result.send_bytes(cloudpickle.dumps(("ready", None)))  # the job's timeout counts from here
        value = fn(config.rank, config.world_size, *args, **kwargs)
        try:
            message = ("ok", dumps_result(value))
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            wrapped = TypeError(
                f"rank {config.rank} returned a {type(value).__name__} that cannot be pickled: {describe(exc)}"
            )
            message = ("error", _error_details(wrapped))
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the parent
        message = ("error", _error_details(exc))
    try:
        _end_what_fn_left(config.rank)
    except Exception as exc:  # noqa: BLE001 - the clean-up must not hide fn's result
        print(f"dtlib: rank {config.rank} could not end what its function left running: {describe(exc)}",
              file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    finished.set()  # from here on, end-of-file on ``alive`` means "finish normally"
    pipes.result.send_bytes(cloudpickle.dumps(message))
    # Linger until the parent has heard from every rank: a rank that returned early
    # must keep its connections open, or peers still inside a collective would see
    # "connection closed" instead of the real problem.
    try:
        os.read(pipes.alive.fileno(), 1)
    except OSError:
        pass
    if initialised and message[0] == "ok" and dist.is_initialized():
        compat.destroy_process_group()
    _hand_over()
