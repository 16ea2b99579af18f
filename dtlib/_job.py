"""The parent's side of a running job: start the ranks, relay their output, collect
results, failures and stacks, and stop every rank however the job ends.

Used by :func:`dtlib.spawn`; see :mod:`dtlib._worker` for the other end of the pipes.
"""

from __future__ import annotations

import collections
import contextlib
import linecache
import os
import pickle
import selectors
import signal
import socket
import sys
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from dtlib import _worker
from dtlib.errors import RankFailure

ERROR_GRACE_S = 1.0  # after the first failure, how long other ranks may still report theirs


def _cell_sources() -> dict[str, list[str]]:
    """Source lines of code that lives only in memory (notebook cells), for remote tracebacks."""
    return {
        name: entry[2]
        for name, entry in list(linecache.cache.items())
        if len(entry) == 4 and entry[1] is None and not os.path.exists(name)
    }


def torchrun_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun gives one rank on a single node, with the store on ``127.0.0.1:port``."""
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
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        # The parent hosts the store, as torchrun's agent does: every rank is a client.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "DTLIB_SPAWN": "1",
    }
    if world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"  # what torchrun does: ranks would fight over cores
    return env


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Stop multiprocessing from re-running the caller's script in every rank.

    ``spawn`` and ``forkserver`` normally import the ``__main__`` script again in each
    child, so a script without an ``if __name__ == "__main__":`` guard would start
    ranks recursively. dtlib ships ``fn`` by value, so the children never need it.
    """
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


@dataclass(eq=False)
class RankState:
    """The parent's view of one rank."""

    rank: int
    process: Any
    result: Connection
    stdout: Connection
    stderr: Connection
    stacks: Connection
    partial: dict[str, bytes] = field(default_factory=lambda: {"out": b"", "err": b""})
    recent_stderr: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=20))
    outcome: tuple[str, Any] | None = None  # ("ok", value) or ("error", RankFailure)
    exited: bool = False

    def fds(self) -> list[int]:
        return [c.fileno() for c in (self.result, self.stdout, self.stderr, self.stacks)]


class Job:
    """Starts the ranks, relays their output, and collects results or failures."""

    def __init__(self, world_size: int, output: str) -> None:
        self.world_size = world_size
        self.output = output
        self.ranks: list[RankState] = []
        self.selector = selectors.DefaultSelector()
        self.alive_w: Connection | None = None
        self.stopped = False

    # -- starting ---------------------------------------------------------------
    def start(self, ctx: Any, method: str, payload: bytes, backend: str | None, listener: socket.socket) -> None:
        """Start every rank; ``listener`` is the rendezvous socket (its port goes in MASTER_PORT)."""
        port = listener.getsockname()[1]
        alive_r, self.alive_w = ctx.Pipe(duplex=False)
        sources = _cell_sources() if method != "fork" else {}
        base_env = dict(os.environ)
        for rank in range(self.world_size):
            ends = [ctx.Pipe(duplex=False) for _ in range(4)]  # result, stdout, stderr, stacks
            parent_ends = [r for r, _ in ends]
            child = _worker.WorkerPipes(*[w for _, w in ends], alive=alive_r)
            close_fds = []
            if method == "fork":  # a forked child inherits every descriptor the parent holds
                close_fds = [c.fileno() for c in parent_ends] + [self.alive_w.fileno(), listener.fileno()]
                close_fds += [fd for other in self.ranks for fd in other.fds()]
            config = _worker.WorkerConfig(
                rank=rank,
                world_size=self.world_size,
                env={**base_env, **torchrun_env(rank, self.world_size, port)},
                backend=backend,
                source_lines=sources,
                close_fds=close_fds,
            )
            process = ctx.Process(target=_worker.main, args=(payload, config, child), name=f"dtlib-rank-{rank}")
            with _main_module_hidden():
                process.start()
            for _, w in ends:
                w.close()
            state = RankState(rank, process, *parent_ends)
            self.ranks.append(state)
            self.selector.register(state.result.fileno(), selectors.EVENT_READ, (state, "result"))
            self.selector.register(state.stdout.fileno(), selectors.EVENT_READ, (state, "out"))
            self.selector.register(state.stderr.fileno(), selectors.EVENT_READ, (state, "err"))
            self.selector.register(process.sentinel, selectors.EVENT_READ, (state, "exit"))
        alive_r.close()

    # -- the event loop ---------------------------------------------------------
    def _relay(self, state: RankState, stream: str, data: bytes) -> None:
        buffered = state.partial[stream] + data
        *lines, state.partial[stream] = buffered.split(b"\n")
        if not data and state.partial[stream]:  # end of file: flush a last unterminated line
            lines.append(state.partial[stream])
            state.partial[stream] = b""
        for raw in lines:
            line = raw.decode("utf-8", errors="replace")
            if stream == "err":
                state.recent_stderr.append(line)
            if self.output == "all" or (self.output == "rank0" and state.rank == 0):
                print(f"[rank {state.rank}] {line}", file=sys.stdout if stream == "out" else sys.stderr, flush=True)

    def _take_result(self, state: RankState) -> None:
        try:
            status, body = pickle.loads(state.result.recv_bytes())
        except (EOFError, OSError):
            return
        if status == "ok":
            try:
                state.outcome = ("ok", pickle.loads(body))
            except Exception as exc:  # noqa: BLE001 - e.g. a class the parent cannot import
                message = f"its result could not be unpickled here: {exc}"
                state.outcome = ("error", RankFailure(state.rank, type(exc).__qualname__, message, ""))
        else:
            failure = RankFailure(state.rank, body["type"], body["message"], body["traceback"])
            state.outcome = ("error", failure)

    def _handle(self, state: RankState, kind: str, fd: int) -> None:
        if kind in ("out", "err"):
            data = os.read(fd, 1 << 16)
            self._relay(state, kind, data)
            if not data:
                self.selector.unregister(fd)
        elif kind == "result":
            self.selector.unregister(fd)
            self._take_result(state)
        else:  # the process exited
            self.selector.unregister(fd)
            state.exited = True
            if state.outcome is None and state.result.poll():
                self._take_result(state)
            if state.outcome is None:
                state.outcome = ("error", self._death(state))

    def _death(self, state: RankState) -> RankFailure:
        # The pipes close a moment before the process is reaped; fork and spawn
        # processes report no exit code until joined.
        state.process.join(timeout=1)
        code = state.process.exitcode
        how = f"exited with code {code}"
        if code is not None and code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        return RankFailure(state.rank, None, f"{how} without returning a result", "\n".join(state.recent_stderr), code)

    def wait(self, timeout: float | None) -> str:
        """Run until every rank has reported ('ok'), one failed ('error') or time ran out ('timeout')."""
        deadline = None if timeout is None else time.monotonic() + timeout
        stop_at = deadline
        while not all(state.outcome is not None for state in self.ranks):
            now = time.monotonic()
            if stop_at is not None and now >= stop_at:
                break
            for key, _ in self.selector.select(None if stop_at is None else stop_at - now):
                state, kind = key.data
                self._handle(state, kind, key.fd)
            if self.failures() and (stop_at is None or stop_at > time.monotonic() + ERROR_GRACE_S):
                stop_at = time.monotonic() + ERROR_GRACE_S  # let other ranks report their own errors
        if self.failures():
            return "error"
        return "ok" if all(state.outcome is not None for state in self.ranks) else "timeout"

    def failures(self) -> list[RankFailure]:
        return [s.outcome[1] for s in self.ranks if s.outcome is not None and s.outcome[0] == "error"]

    # -- stopping ---------------------------------------------------------------
    def running(self) -> list[RankState]:
        return [state for state in self.ranks if state.outcome is None]

    def collect_stacks(self, wait_s: float = 2.0) -> dict[int, str]:
        """Ask every running rank for its Python stack (faulthandler on SIGUSR1)."""
        running = self.running()
        for state in running:
            _signal(state.process.pid, _worker.STACK_SIGNAL, group=False)
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
            self.alive_w.close()
            self.alive_w = None

    def stop(self, grace_s: float) -> None:
        """Release, wait up to ``grace_s`` for the ranks to exit, then kill what is left."""
        if self.stopped:
            return
        self.release()
        deadline = time.monotonic() + grace_s
        while any(not s.exited for s in self.ranks) and time.monotonic() < deadline:
            for key, _ in self.selector.select(max(0.0, deadline - time.monotonic())):
                state, kind = key.data
                if kind == "exit":
                    self.selector.unregister(key.fd)
                    state.exited = True
                else:
                    self._handle(state, kind, key.fd)
        for state in self.ranks:
            if state.process.exitcode is None:
                _signal(state.process.pid, signal.SIGKILL, group=True)
        for state in self.ranks:
            state.process.join()
        self._drain()
        self.stopped = True  # set last: a stop interrupted half-way is done again in full

    def _drain(self, wait_s: float = 0.5) -> None:
        """Relay what is left in the output pipes (a child's own children may hold them open)."""
        deadline = time.monotonic() + wait_s
        keys = [k for k in self.selector.get_map().values() if k.data[1] in ("out", "err")]
        while keys and time.monotonic() < deadline:
            for key, _ in self.selector.select(max(0.0, deadline - time.monotonic())):
                state, kind = key.data
                if kind in ("out", "err"):
                    self._handle(state, kind, key.fd)
            keys = [k for k in self.selector.get_map().values() if k.data[1] in ("out", "err")]
        for state in self.ranks:
            for stream in ("out", "err"):
                if state.partial[stream]:
                    self._relay(state, stream, b"")

    def close(self) -> None:
        self.selector.close()
        self.release()
        for state in self.ranks:
            for conn in (state.result, state.stdout, state.stderr, state.stacks):
                conn.close()
            state.process.close()


def _signal(pid: int, signum: int, *, group: bool) -> None:
    """Signal a rank (and with ``group``, the children it started); gone is fine."""
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


def _clean_stack(dump: str) -> str:
    """Keep the user's frames of a faulthandler dump: drop dtlib's watchdog thread and
    the frames below ``fn`` (dtlib's worker and multiprocessing's start-up)."""
    marker = f'{os.sep}dtlib{os.sep}_worker.py", line'
    blocks = [b for b in dump.strip().split("\n\n") if b.strip() and "_watch_parent" not in b]
    kept = []
    for block in blocks:
        lines = block.splitlines()
        cut = next((i for i, line in enumerate(lines) if marker in line and line.endswith(" in main")), len(lines))
        kept.append("\n".join(lines[:cut]))
    return "\n\n".join(kept) or "(no Python stack: the rank had not finished starting)"
