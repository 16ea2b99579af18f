"""The parent's side of a running job: start the ranks, relay their output, collect
results, failures and stacks, and stop every rank however the job ends.

Used by :func:`dtlib.spawn`; see :mod:`dtlib.launch.worker` for the other end of the pipes.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import selectors
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from dtlib.errors import RankFailure, WorkerError
from dtlib.launch import worker
from dtlib.launch.processes import (
    STORE_VARIABLES,
    HeldInterrupts,
    end_group,
    end_tree,
    forkserver_death,
    forkserver_pid,
    own_temp_dir,
    send,
    torchrun_env,
)
from dtlib.launch.proctree import stopped
from dtlib.launch.relay import Relay

ERROR_GRACE_S = 1.0  # after the first failure, how long other ranks may still report theirs
MAX_SELECT_S = 1.0  # wake at least this often (a far deadline would overflow epoll's timeout)
HAND_OVER_POLL_S = 0.005  # how often stop() looks for ranks that have stopped themselves
REAP_S = 10.0  # how long to wait for SIGKILLed ranks to be reaped before leaving them
#: How long the ranks may take to start (fork, unpickle the call, join the process group) before a job's timeout
#: starts counting: the timeout is the function's, so that a busy machine's slow start is never taken for a hang.
STARTUP_S = 60.0

# Every descriptor a running job holds in this process. A rank started with ``fork`` copies
# them all; it must close the other jobs' ones, or it keeps their pipes (and ports) open.
_fd_lock = threading.Lock()
_job_fds: set[int] = set()


@dataclass(eq=False)
class RankState:
    """The parent's view of one rank."""

    rank: int
    process: Any
    result: Connection
    stdout: Connection
    stderr: Connection
    stacks: Connection
    outcome: tuple[str, Any] | None = None  # ("ok", value) or ("error", RankFailure)
    ready: bool = False  # it joined the process group (if any) and is about to call the function
    exited: bool = False
    server: int | None = None  # the pid of the forkserver that forked it
    channels: list[Connection] = field(default_factory=list)  # this end of the rank's two-way channels

    def started(self) -> bool:
        return self.process.pid is not None


class Job:
    """Starts the ranks, relays their output, and collects results or failures.

    Everything it opens (pipes, processes, the rendezvous socket and store) is recorded the
    moment it exists, so that :meth:`stop` and :meth:`close` release it whenever the job ends.
    """

    def __init__(self, world_size: int, output: str, method: str, channels: int = 0) -> None:
        self.world_size = world_size
        self.method = method
        self.channels = channels  # two-way pipes per rank, beyond the usual ones (live ranks take commands on them)
        self.relay = Relay(output)
        self.ranks: list[RankState] = []
        self.selector = selectors.DefaultSelector()
        self.connections: list[Connection] = []
        self.alive_w: Connection | None = None
        self.listener: socket.socket | None = None
        self.listener_fd = -1  # its number, still in use once the store owns the socket
        self.store: Any = None
        self.store_dir: str | None = None  # the private store's folder (see :meth:`private_store`)
        self.stopped = False

    # -- starting ---------------------------------------------------------------
    def _pipe(self, ctx: Any, duplex: bool = False) -> tuple[Connection, Connection]:
        """A pipe (one-way: reader, writer), recorded for clean-up; call with ``_fd_lock`` and interrupts held."""
        reader, writer = ctx.Pipe(duplex=duplex)
        self.connections += (reader, writer)
        _job_fds.update((reader.fileno(), writer.fileno()))
        return reader, writer

    def _close(self, *connections: Connection) -> None:
        """Close pipe ends; call with ``_fd_lock`` held (a fork elsewhere must not see a reused number)."""
        for connection in connections:
            if not connection.closed:
                _job_fds.discard(connection.fileno())
                connection.close()

    def listen(self, listener: socket.socket) -> None:
        """Own the rendezvous socket (its port goes in MASTER_PORT)."""
        with _fd_lock:
            self.listener, self.listener_fd = listener, listener.fileno()
            _job_fds.add(self.listener_fd)

    def private_store(self) -> None:
        """Join the ranks through a ``FileStore`` in a new folder that only this user can open (mode 0700).

        torch's TCP store admits anyone who can reach its port, so another user of the machine could read and
        plant keys that the ranks then trust. A job whose group dtlib creates needs no port: its ranks get no
        ``MASTER_ADDR`` or ``MASTER_PORT``, and the folder goes when the job closes (or, after a killed kernel,
        with the kernel's temporary folder, see :func:`dtlib.launch.processes.own_temp_dir`).
        """
        self.store_dir = tempfile.mkdtemp(prefix="store-", dir=own_temp_dir())

    def start(self, ctx: Any, payload: bytes | list[bytes], backend: str | None, sources: dict[str, list[str]],
              start: Callable[[Any], None], env: dict[str, str] | None = None) -> None:
        """Start every rank; ``start(process)`` starts one (with SIGINT blocked, say). ``payload`` is the call every
        rank unpickles, or a list of one per rank.

        ``env`` adds variables to every rank's environment; each rank's ``channels`` (this end)
        are in its state's ``channels``, the other end in the rank's :func:`dtlib.launch.worker.channels`.
        """
        assert self.listener is not None or self.store_dir is not None, "listen() or private_store() first"
        port = self.listener.getsockname()[1] if self.listener is not None else None
        with _fd_lock, HeldInterrupts() as held:
            alive_r, self.alive_w = self._pipe(ctx)
        held.deliver()
        base_env = {**os.environ, **(env or {})}
        if port is None:  # no TCP store: a MASTER_PORT inherited from this process would name someone else's
            base_env = {name: value for name, value in base_env.items() if name not in STORE_VARIABLES}
        store_file = os.path.join(self.store_dir, "store") if self.store_dir is not None else ""
        for rank in range(self.world_size):
            with _fd_lock:
                with HeldInterrupts() as held:
                    ends = [self._pipe(ctx) for _ in range(4)]  # result, stdout, stderr, stacks
                    both = [self._pipe(ctx, duplex=True) for _ in range(self.channels)]  # (ours, the rank's)
                    child = worker.WorkerPipes(*[w for _, w in ends], alive=alive_r, channels=[c for _, c in both])
                    keep = {w.fileno() for _, w in ends} | {alive_r.fileno()} | {c.fileno() for _, c in both}
                    config = worker.WorkerConfig(
                        rank=rank,
                        world_size=self.world_size,
                        env={**base_env, **torchrun_env(rank, self.world_size, port)},
                        backend=backend,
                        source_lines=sources,
                        close_fds=sorted(_job_fds - keep) if self.method == "fork" else [],
                        store_file=store_file,
                    )
                    own = payload[rank] if isinstance(payload, list) else payload
                    process = ctx.Process(target=worker.main, args=(own, config, child),
                                          name=f"dtlib-rank-{rank}")
                    state = RankState(rank, process, *[r for r, _ in ends], channels=[ours for ours, _ in both])
                    self.ranks.append(state)
                held.deliver()
                try:
                    start(process)
                    state.server = forkserver_pid() if self.method == "forkserver" else None
                except (EOFError, ConnectionError) as exc:  # what a request to a dead forkserver gets
                    if self.method != "forkserver":
                        raise
                    how = forkserver_death(forkserver_pid(), wait_s=1.0) or "died"
                    raise WorkerError([RankFailure(rank, None, f"could not be started: the forkserver, the "
                                                   f"process that forks every rank, {how}", "")]) from exc
                with HeldInterrupts() as held:
                    self._close(*[w for _, w in ends], *[c for _, c in both])
                    self.selector.register(state.result.fileno(), selectors.EVENT_READ, (state, "result"))
                    self.selector.register(state.stdout.fileno(), selectors.EVENT_READ, (state, "out"))
                    self.selector.register(state.stderr.fileno(), selectors.EVENT_READ, (state, "err"))
                    self.selector.register(process.sentinel, selectors.EVENT_READ, (state, "exit"))
                held.deliver()
        with _fd_lock:
            self._close(alive_r)

    # -- the event loop ---------------------------------------------------------
    def _take_result(self, state: RankState) -> bool:
        """Read one message of the rank's: "ready" (it is about to call the function), then its result. False
        at the end of the pipe."""
        try:
            status, body = pickle.loads(state.result.recv_bytes())
        except (EOFError, OSError):
            return False
        if status == "ready":
            state.ready = True
        elif status == "ok":
            try:
                state.outcome = ("ok", pickle.loads(body))
            except Exception as exc:  # noqa: BLE001 - e.g. a class the parent cannot import
                message = f"its result could not be unpickled here: {worker.describe(exc)}"
                state.outcome = ("error", RankFailure(state.rank, type(exc).__qualname__, message, ""))
        else:
            failure = RankFailure(state.rank, body["type"], body["message"], body["traceback"])
            state.outcome = ("error", failure)
        return True

    def _read(self, state: RankState, stream: str, fd: int) -> bool:
        """Relay one read from a rank's stdout or stderr; False at the end of the pipe."""
        data = os.read(fd, 1 << 16)
        self.relay.feed(state.rank, stream, data)
        if not data:
            self.selector.unregister(fd)
        return bool(data)

    def watch(self, state: RankState, connection: Connection, on_ready: Callable[[RankState], None]) -> None:
        """Call ``on_ready(state)`` from the event loop whenever ``connection`` (a channel) can be read."""
        self.selector.register(connection.fileno(), selectors.EVENT_READ, (state, on_ready))

    def unwatch(self, connection: Connection) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(connection.fileno())

    def step(self, timeout: float) -> None:
        """Run the event loop once: relay output, note exits, call watchers; wait at most ``timeout`` s."""
        self._select(timeout)

    def _handle(self, state: RankState, kind: Any, fd: int) -> None:
        if callable(kind):
            kind(state)
        elif kind in ("out", "err"):
            self._read(state, kind, fd)
        elif kind == "result":
            if not self._take_result(state) or state.outcome is not None:
                self.selector.unregister(fd)
        else:  # the process exited
            self.selector.unregister(fd)
            state.exited = True
            while state.outcome is None and state.result.poll() and self._take_result(state):
                pass
            if state.outcome is None:
                state.outcome = ("error", self._death(state))

    def _death(self, state: RankState) -> RankFailure:
        # The pipes close a moment before the process is reaped; fork and spawn
        # processes report no exit code until joined.
        state.process.join(timeout=1)
        code = state.process.exitcode
        for stream, connection in (("out", state.stdout), ("err", state.stderr)):  # what it said last
            fd = connection.fileno()
            while fd in self.selector.get_map() and connection.poll() and self._read(state, stream, fd):
                pass
        how = f"exited with code {code}"
        if code is not None and code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        server = forkserver_death(state.server, wait_s=1.0) if code == 255 else None
        if server is not None:  # multiprocessing reports 255 for a rank whose forkserver is gone
            how = f"was lost: the forkserver, the process that forks every rank, {server}; the rank"
        said = self.relay.last_words(state.rank)
        message = f"{how} without returning a result" + (f"; it said: {said}" if said else "")
        return RankFailure(state.rank, None, message, self.relay.recent_stderr(state.rank), code)

    def _select(self, timeout: float) -> None:
        registered = self.selector.get_map()
        for key, _ in self.selector.select(max(0.0, min(timeout, self.relay.due_in(), MAX_SELECT_S))):
            if key.fd in registered:  # a rank's exit, handled first, may have read its pipes to the end
                self._handle(*key.data, key.fd)
        self.relay.flush_if_due()

    def wait(self, timeout: float | None) -> str:
        """Run until every rank has reported ('ok'), one failed ('error') or time ran out ('timeout'): ``timeout``
        seconds from the moment every rank was ready to call the function, which the ranks may take up to
        :data:`STARTUP_S` to reach."""
        stop_at = float("inf") if timeout is None else time.monotonic() + STARTUP_S + timeout
        counting = timeout is None
        while not all(state.outcome is not None for state in self.ranks):
            now = time.monotonic()
            if not counting and all(state.ready or state.outcome is not None for state in self.ranks):
                counting, stop_at = True, min(stop_at, now + timeout)
            if now >= stop_at:
                break
            self._select(stop_at - now)
            if self.failures() and stop_at > time.monotonic() + ERROR_GRACE_S:
                stop_at = time.monotonic() + ERROR_GRACE_S  # let other ranks report their own errors
        if self.failures():
            return "error"
        return "ok" if all(state.outcome is not None for state in self.ranks) else "timeout"

    def failures(self) -> list[RankFailure]:
        return [s.outcome[1] for s in self.ranks if s.outcome is not None and s.outcome[0] == "error"]

    # -- stopping ---------------------------------------------------------------
    def running(self) -> list[RankState]:
        return [state for state in self.ranks if state.outcome is None]

    def collect_stacks(self, wait_s: float = 2.0, ranks: list[int] | None = None) -> dict[int, str]:
        """Ask every running rank (or those of ``ranks``) for its Python stack (faulthandler on SIGUSR1)."""
        running = [state for state in self.running() if state.started() and (ranks is None or state.rank in ranks)]
        for state in running:
            send(state.process.pid, worker.STACK_SIGNAL, group=False)
        chunks = {state.rank: b"" for state in running}
        readers = {state.stacks.fileno(): state for state in running}
        quiet_since, deadline = time.monotonic(), time.monotonic() + wait_s
        with selectors.DefaultSelector() as sel:
            for fd in readers:
                sel.register(fd, selectors.EVENT_READ)
            while time.monotonic() < deadline and time.monotonic() - quiet_since < 0.3:
                for key, _ in sel.select(0.05):
                    chunks[readers[key.fd].rank] += os.read(key.fd, 1 << 16)
                    quiet_since = time.monotonic()
        return {rank: _clean_stack(raw.decode("utf-8", "replace")) for rank, raw in chunks.items()}

    def release(self) -> None:
        """Tell lingering ranks to finish; ranks still inside ``fn`` exit at once."""
        if self.alive_w is not None:
            with _fd_lock:
                self._close(self.alive_w)
            self.alive_w = None

    def stop(self, grace_s: float) -> None:
        """Release, wait up to ``grace_s`` for the ranks to exit, then kill what is left.

        Safe to call again after an interruption: it then does its work again in full.
        """
        if self.stopped:
            return
        self.release()
        deadline = time.monotonic() + grace_s
        started = [state for state in self.ranks if state.started()]
        # A rank that finishes stops itself (SIGSTOP) rather than exit, so that what it started cannot leave its
        # tree for init's before the tree is ended here (worker._hand_over).
        while (any(not s.exited and not stopped(s.process.pid) for s in started)
               and time.monotonic() < deadline):
            self._select(min(HAND_OVER_POLL_S, deadline - time.monotonic()))
        for state in started:
            if state.process.exitcode is None:
                end_tree(state.process.pid)  # stopped or not: the rank, its group, new sessions, double forks
            else:  # it died by itself; a process it started may live on in its group: nothing outlives the call
                end_group(state.process.pid)
        reap_by = time.monotonic() + REAP_S  # a process stuck in the kernel (D state) is left, not waited on
        for state in started:
            state.process.join(timeout=max(0.0, reap_by - time.monotonic()))
        self._drain()
        self.stopped = True  # set last: a stop interrupted half-way is done again in full

    def _drain(self, wait_s: float = 0.5) -> None:
        """Relay what is left in the output pipes (a child's own children may hold them open)."""
        def reading() -> bool:
            return any(key.data[1] in ("out", "err") for key in self.selector.get_map().values())

        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and reading():
            for key, _ in self.selector.select(max(0.0, deadline - time.monotonic())):
                state, kind = key.data
                if kind in ("out", "err"):
                    self._read(state, kind, key.fd)
        self.relay.flush(final=True)

    def close(self) -> None:
        """Release every descriptor, process object and socket; never raises, safe to repeat."""
        self.alive_w = None
        with _fd_lock:
            with contextlib.suppress(Exception):
                self.selector.close()
            self._close(*self.connections)
            if self.listener is not None:
                self.listener.close()  # a no-op once the store took it over (detached)
            self.store = None  # deleting the store closes its listening socket
            _job_fds.discard(self.listener_fd)
        if self.store_dir is not None:
            shutil.rmtree(self.store_dir, ignore_errors=True)
        for state in self.ranks:
            with contextlib.suppress(ValueError):  # closed already, or still running (stuck): left to the OS
                if state.started():
                    state.process.close()


def _clean_stack(dump: str) -> str:
    """Keep the user's frames of a faulthandler dump: drop dtlib's watchdog thread and
    the frames below ``fn`` (dtlib's worker and multiprocessing's start-up)."""
    marker = f'{os.sep}dtlib{os.sep}launch{os.sep}worker.py", line'
    live = f'{os.sep}dtlib{os.sep}live{os.sep}server.py", line'  # a live rank's loop, below the cell it runs
    blocks = [b for b in dump.strip().split("\n\n")
              if b.strip() and "_watch_parent" not in b and " in _answer_doctor" not in b]
    kept = []
    for block in blocks:
        lines = block.splitlines()
        cut = next((i for i, line in enumerate(lines)
                    if (marker in line and line.endswith(" in main")) or live in line), len(lines))
        kept.append("\n".join(lines[:cut]))
    return "\n\n".join(kept) or "(no Python stack: the rank had not finished starting)"
