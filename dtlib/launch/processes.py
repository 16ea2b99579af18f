"""How dtlib starts and signals its processes: each rank's environment, multiprocessing's
forkserver and the ranks started without re-running ``__main__`` and safe from Ctrl-C, Ctrl-C
held back while a step must finish, ranks killed, a dead forkserver recognised.

Used by :func:`dtlib.spawn` and :class:`dtlib.launch.job.Job`.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing.forkserver
import multiprocessing.process
import multiprocessing.resource_tracker
import multiprocessing.spawn
import multiprocessing.util
import os
import random
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

from dtlib.launch.proctree import end_below, running

_launching = threading.local()  # .active: this thread is starting a rank right now
_stdlib_preparation_data = multiprocessing.spawn.get_preparation_data


STORE_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")  # where a TCP store is


def torchrun_env(rank: int, world_size: int, port: int | None) -> dict[str, str]:
    """The variables torchrun gives one rank on a single node, with the store on ``127.0.0.1:port``.

    ``port=None``: the job has no TCP store (dtlib joins its ranks through a private file), so the
    :data:`STORE_VARIABLES` are left out. Example: ``torchrun_env(1, 2, 29500)["RANK"] == "1"``.
    """
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world_size),
        "ROLE_NAME": "default",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "DTLIB_SPAWN": "1",
    }
    if port is not None:
        env |= {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            # The parent hosts the store, as torchrun's agent does: every rank is a client.
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }
    if world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"  # what torchrun does: ranks would fight over cores
    # gloo listens on the address the hostname resolves to, which may be the network's, and NCCL's bootstrap on
    # the first interface that is not loopback (it leaves out "lo" unless told): a job on one machine keeps its
    # rank-to-rank sockets on loopback unless the user chose. (NCCL's data between GPUs of one machine goes
    # through NVLink, PCIe or shared memory, not through these sockets.)
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if variable not in os.environ and loopback_interface():
            env[variable] = loopback_interface()
    return env


@functools.cache
def loopback_interface() -> str:
    """The name of the loopback network interface, or ``""``. Example: ``loopback_interface()`` is ``"lo"`` on Linux."""
    iff_loopback = 0x8  # from <net/if.h>
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir("/sys/class/net")):
            with open(f"/sys/class/net/{name}/flags") as flags:
                if int(flags.read(), 16) & iff_loopback:
                    return name
    with contextlib.suppress(OSError, AttributeError):
        return next((name for _, name in socket.if_nameindex() if name in ("lo", "lo0")), "")
    return ""


class HeldInterrupts:
    """Hold Ctrl-C (SIGINT) back while a step that must not be cut in half runs.

    Only the main thread receives SIGINT in Python, so elsewhere this does nothing.
    Example: ``with HeldInterrupts() as held: close_everything()`` then ``held.deliver()``.
    """

    def __init__(self) -> None:
        self.count = 0
        self._previous: Any = None

    def __enter__(self) -> HeldInterrupts:
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            if callable(previous):  # not SIG_IGN, SIG_DFL, or a handler set outside Python
                signal.signal(signal.SIGINT, self._hold)
                self._previous = previous
        return self

    def _hold(self, signum: int, frame: Any) -> None:
        self.count += 1

    def __exit__(self, *exc_info: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def deliver(self) -> None:
        """Act on a held interrupt now, as the handler it replaced would have."""
        if self.count and self._previous is not None:
            self.count = 0
            if self._previous is signal.default_int_handler:
                raise KeyboardInterrupt
            self._previous(signal.SIGINT, sys._getframe())


@contextlib.contextmanager
def sigint_blocked(active: bool = True) -> Iterator[None]:
    """Block SIGINT in this thread: a process started meanwhile starts with it blocked.

    Jupyter interrupts by signalling the kernel's whole process group; a child still
    importing torch (a new rank, the forkserver) would die of it with a traceback.
    Example: ``with sigint_blocked(): process.start()``.
    """
    if not active or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        if signal.SIGINT not in before:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def forkserver_pid() -> int | None:
    """The pid of multiprocessing's forkserver in this process, or None before it starts.

    Example: ``forkserver_death(forkserver_pid())`` is None while the server runs.
    """
    return getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)


def forkserver_death(pid: int | None, wait_s: float = 0.0) -> str | None:
    """How the forkserver ``pid`` ended (``"was killed by SIGKILL"``), or None while it runs.

    Waits up to ``wait_s`` for it to end: its pipes close a moment before it can be waited on.
    Peeks at the exit status without reaping, so that multiprocessing still restarts the server.
    """
    if pid is None or not hasattr(os, "waitid"):
        return None
    deadline = time.monotonic() + wait_s
    while True:
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped already: multiprocessing found it dead and started another
            return "died"
        except OSError:
            return None
        if info is not None and info.si_pid != 0:
            break
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.01)
    if info.si_code == os.CLD_EXITED:
        return f"exited with code {info.si_status}"
    how = f"was killed by {signal.Signals(info.si_status).name}"
    return how + (" (the Linux out-of-memory killer sends SIGKILL)" if info.si_status == signal.SIGKILL else "")


def send(pid: int, signum: int, *, group: bool) -> None:
    """Signal a rank (and with ``group``, the children it started); gone is fine.

    Example: ``send(pid, signal.SIGKILL, group=True)``.
    """
    try:
        if group:
            try:
                os.killpg(pid, signum)
                return
            except ProcessLookupError:
                pass  # the rank had not made its own group yet
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def end_tree(pid: int) -> None:
    """SIGKILL a rank, its process group, and every process below it in groups or sessions of their own
    (``start_new_session=True``, double-forked daemons, which the rank reaps): nothing it started outlives it.
    The rank and its tree are stopped first (SIGSTOP) until a reading of the tree is stable, so that no process
    forked meanwhile, or orphaned by another's death, escapes (:func:`dtlib.launch.proctree.end_below`).
    Example: ``end_tree(rank_pid)``."""
    end_below(pid, include_root=True)
    send(pid, signal.SIGKILL, group=True)


def _ephemeral_ports() -> range:
    """The ports the kernel hands out by itself (``bind`` to port 0, and every outgoing ``connect``), from
    ``/proc/sys/net/ipv4/ip_local_port_range``; Linux's default, 32768 to 60999, where it cannot be read."""
    try:
        low, high = (int(word) for word in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


_handed_out: set[int] = set()  # free_port's earlier answers in this process
_port_choice = random.SystemRandom()  # not the global generator: processes that seed it alike still differ


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, for a launcher that must be told one (torchrun's
    ``--master_port``, ``mp.spawn``'s ``MASTER_PORT``, ``init_method="tcp://..."``). dtlib.spawn needs none:
    it holds its own listener.

    The port is chosen at random *outside* the kernel's ephemeral range, never one this process handed out
    before, and never 29500 (torchrun's default). Between the choice and the store's own ``bind`` the port is
    held by nobody, and an ephemeral one can be taken meanwhile by any process's outgoing connection or
    ``bind(0)`` (gloo's pairs, store clients, another test's ``free_port``): on a busy machine that happens,
    and two jobs then share one store. A port outside the range is taken only by someone who names it.

    Example: ``free_port()`` -> ``23121``.
    """
    ephemeral = _ephemeral_ports()
    quiet = [port for port in (*range(20000, ephemeral.start), *range(ephemeral.stop, 65536))
             if port != 29500 and port not in _handed_out]
    for port in _port_choice.sample(quiet, min(200, len(quiet))):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as sock:  # a machine whose ephemeral range covers everything: the kernel's choice
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def end_group(pgid: int) -> None:
    """Kill what is left of the process group ``pgid``: the processes that a finished rank started.

    Each rank leads a group of its own (``os.setpgid(0, 0)`` as it starts), and Linux gives no new
    process a PID that is still the ID of a group with members, so this reaches the rank's descendants
    (those that kept its group); an empty group is fine. Example: ``end_group(rank_pid)``.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _preparation_data(name: str) -> dict[str, Any]:
    """multiprocessing's start-up data for a child, without the caller's script while dtlib starts a rank.

    ``spawn`` and ``forkserver`` normally import the ``__main__`` script again in each child, so
    a script without an ``if __name__ == "__main__":`` guard would start ranks recursively.
    dtlib ships ``fn`` by value, so its ranks never need it. Other callers get the usual data.
    """
    data = _stdlib_preparation_data(name)
    if getattr(_launching, "active", False):
        for key in ("init_main_from_name", "init_main_from_path", "main_path"):
            data.pop(key, None)
    return data


@contextlib.contextmanager
def _main_not_rerun() -> Iterator[None]:
    """While this thread starts a process, that child does not re-run ``__main__``.

    No module is swapped: the filter above, installed once, changes nothing for other threads or callers.
    """
    if multiprocessing.spawn.get_preparation_data is _stdlib_preparation_data:
        multiprocessing.spawn.get_preparation_data = _preparation_data
    _launching.active = True
    try:
        yield
    finally:
        _launching.active = False


def _spawnv_passfds_in_own_session(path: str, args: list[str], passfds: Any) -> int:
    """``multiprocessing.util.spawnv_passfds``, the child in a session of its own: it keeps ``passfds`` and
    stdin, stdout and stderr, as the original does, and no other descriptor; it inherits the signal mask."""
    keep = sorted({int(fd) for fd in passfds})
    was = {fd: os.get_inheritable(fd) for fd in keep}
    others = [int(name) for name in os.listdir("/proc/self/fd") if int(name) > 2 and int(name) not in keep]
    close = [(os.POSIX_SPAWN_CLOSE, fd) for fd in others if _inheritable(fd)]
    try:
        for fd in keep:
            os.set_inheritable(fd, True)
        return os.posix_spawn(path, args, os.environ, file_actions=close, setsid=True)
    finally:
        for fd, inheritable in was.items():
            os.set_inheritable(fd, inheritable)


def _inheritable(fd: int) -> bool:
    try:
        return os.get_inheritable(fd)
    except OSError:  # closed since the listing (the listing's own descriptor among them)
        return False


_helper_start = threading.local()  # .active: this thread starts multiprocessing's helpers right now
_session_spawn_lock = threading.Lock()
_stdlib_spawnv_passfds = multiprocessing.util.spawnv_passfds


def _spawnv_passfds(path: str, args: list[str], passfds: Any) -> int:
    """``multiprocessing.util.spawnv_passfds`` as dtlib installs it: a helper that this thread starts inside
    :func:`_helpers_in_own_session` starts in a session of its own; any other process (a rank another thread
    starts meanwhile with start method "spawn") starts as multiprocessing starts it. A rank must not lead a
    session: it puts itself in a process group of its own, which a session leader cannot do (EPERM)."""
    if getattr(_helper_start, "active", False):
        try:
            return _spawnv_passfds_in_own_session(path, args, passfds)
        except NotImplementedError:  # posix_spawn without setsid in this C library
            pass
    return _stdlib_spawnv_passfds(path, args, passfds)


@contextlib.contextmanager
def _helpers_in_own_session() -> Iterator[None]:
    """While it runs, the helper processes that this thread makes multiprocessing start (its resource tracker,
    its forkserver) start in a session of their own (:func:`_spawnv_passfds_in_own_session`), where
    ``posix_spawn`` can start one. Processes other threads start meanwhile do not (:func:`_spawnv_passfds`).

    Both helpers end when the process that started them exits: the tracker when its pipe closes, the server when
    its "alive" pipe does. In the kernel's process group they held every kernel shutdown 2.6 s: ipykernel sends
    SIGTERM to each child in its group and waits until none is left, the tracker ignores SIGTERM, and the server,
    which dies of it, stays listed as a child until the kernel reaps it, which it never does; so the wait ran
    until jupyter_client, at half its grace period, terminated the kernel itself (3 runs of a kernel that had
    called ``dtlib.spawn``: 2.61 s each, against 0.11 s for a kernel that had not). Outside the group, ipykernel
    leaves them alone. Not on Linux, or on a C library without ``POSIX_SPAWN_SETSID``, they start as
    multiprocessing starts them."""
    if not hasattr(os, "POSIX_SPAWN_CLOSE") or not os.path.isdir("/proc/self/fd"):
        yield
        return
    with _session_spawn_lock:  # installed once, for good: two threads swapping it in and out could leave theirs
        if multiprocessing.util.spawnv_passfds is not _spawnv_passfds:
            multiprocessing.util.spawnv_passfds = _spawnv_passfds
    was = getattr(_helper_start, "active", False)
    _helper_start.active = True
    try:
        yield
    finally:
        _helper_start.active = was


def start_forkserver() -> None:
    """Start multiprocessing's forkserver (if it is not running) with SIGINT blocked.

    It inherits the block, so an interrupt sent to the kernel's process group while the server
    imports torch cannot kill it; it ignores SIGINT once it serves. A server that died is restarted.
    Example: ``start_forkserver()`` before the first ``forkserver`` rank starts.
    """
    with _helpers_in_own_session():
        multiprocessing.resource_tracker.ensure_running()  # first: starting it unblocks SIGINT again
    own_temp_dir()
    with _main_not_rerun(), sigint_blocked(), HeldInterrupts() as held, _helpers_in_own_session():
        multiprocessing.forkserver.ensure_running()
    held.deliver()


TEMP_PREFIX = "dtlib-pymp-"  # then this process's pid and a dash: dtlib-pymp-4242-x1y2z3
SOCKET_PATH_MAX = 107  # the longest path an AF_UNIX socket can have on Linux (108 bytes with the final NUL)
# what the forkserver's socket path adds to the base folder: /dtlib-pymp-<pid>-<8>/listener-<8>
_SOCKET_SUFFIX = len(f"/{TEMP_PREFIX}{2**22}-12345678/listener-12345678")


def temp_base() -> str:
    """The folder that holds this process's temporary folder: ``$TMPDIR`` (Python's ``tempfile.gettempdir()``), or,
    where that is too long for the forkserver's socket path (107 characters on Linux), the first of ``/tmp``,
    ``/var/tmp`` and ``/dev/shm`` that this user can write to, as Python 3.12's multiprocessing does.
    Raises OSError, naming ``TMPDIR`` and the limit, where none fits. Example: ``temp_base()`` -> ``"/tmp"``."""
    base = tempfile.gettempdir()
    if len(os.fsencode(base)) + _SOCKET_SUFFIX <= SOCKET_PATH_MAX:
        return base
    for fallback in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(fallback) and os.access(fallback, os.W_OK | os.X_OK):
            return fallback
    raise OSError(f"the temporary folder {base!r} ({len(base)} characters) is too long for the forkserver's socket "
                  f"(a path of at most {SOCKET_PATH_MAX} characters, {_SOCKET_SUFFIX} of them dtlib's), and none of "
                  "/tmp, /var/tmp, /dev/shm can be written to: set TMPDIR to a folder of at most "
                  f"{SOCKET_PATH_MAX - _SOCKET_SUFFIX} characters, or pass start_method='spawn'")


def own_temp_dir() -> str:
    """multiprocessing's temporary folder for this process (where the forkserver's socket lives), named after
    this process's pid, made once; folders of earlier processes that no longer run are removed first.

    multiprocessing removes its folder at a normal exit only, so a kernel that was killed (a restart, a
    shutdown that timed out) left a ``pymp-*`` folder behind for good. Example: ``own_temp_dir()`` ->
    ``/tmp/dtlib-pymp-4242-x1y2z3``.
    """
    config = multiprocessing.process.current_process()._config
    if config.get("tempdir"):
        return config["tempdir"]
    base = temp_base()
    for name in os.listdir(base):
        found = re.fullmatch(rf"{re.escape(TEMP_PREFIX)}(\d+)-\w+", name)
        if found and not running(int(found[1])):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
    folder = tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-", dir=base)
    config["tempdir"] = folder  # what multiprocessing.util.get_temp_dir would have made, and removes at exit
    multiprocessing.util.Finalize(None, shutil.rmtree, args=(folder, True), exitpriority=-100)
    return folder


def start_rank(process: Any, method: str) -> None:
    """Start one rank, whole: Ctrl-C waits until it is done.

    A request to the forkserver cut off between connecting and sending its descriptors kills
    the server (its ``recvfds`` raises EOFError), so an interrupt while the first rank waits for
    the server's imports takes effect once they are done. A forkserver rank starts with SIGINT
    blocked by inheritance; a ``spawn`` or ``fork`` rank gets the block from this thread.
    Example: ``start_rank(ctx.Process(target=...), "forkserver")``.
    """
    multiprocessing.resource_tracker.ensure_running()  # first: starting it unblocks SIGINT again
    with HeldInterrupts() as held, _main_not_rerun(), sigint_blocked(method != "forkserver"):
        process.start()
    held.deliver()
