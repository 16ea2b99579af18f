"""Two pieces of work at once on two cores: one in a forked copy of this process, one here. The simulator runs its
two depths so (:func:`dtlib.sim.step.simulate`): on fake tensors each is a long run of Python on one core, and a
laptop has two or more.

A forked copy starts with everything this process holds (a notebook's own functions, torch's warm caches), where a
new process would import and warm up again. It runs only ``there``, with no output, and sends back its result. The
guarantees are those of running both here, one after the other:

- the result is the same: where fork is unavailable (not Linux; one core), the copy fails, dies, or is not done
  within ``patience`` after this process's own work, ``there`` runs here after ``here``;
- an exception is the caller's own: ``here``'s, raised here, or ``there``'s, raised by running it here again;
- nothing outlives the call: the copy is killed and reaped whatever happens (an exception, Ctrl-C).

Example::

    low, high = alongside(lambda: simulate_depth(3), lambda: simulate_depth(4))
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

There = TypeVar("There")
Here = TypeVar("Here")

#: Seconds the copy may still take after this process finished its own work, at the least, and as a multiple of
#: that work's time; past them the copy is killed and its work done here (a deadlocked copy costs time, never a hang).
PATIENCE_S, PATIENCE_X = 10.0, 2.0


def can_fork() -> bool:
    """Whether :func:`alongside` forks here: on Linux (fork elsewhere is unsafe in a process with threads, a
    notebook's kernel among them), with two cores or more for this process."""
    return sys.platform == "linux" and hasattr(os, "fork") and len(os.sched_getaffinity(0)) >= 2


def alongside(there: Callable[[], There], here: Callable[[], Here]) -> tuple[There, Here]:
    """``(there(), here())``, ``there`` run in a forked copy of this process while this one runs ``here``, where
    that is possible (:func:`can_fork`); each must need nothing of the other. ``there``'s result must pickle."""
    if not can_fork():
        return there(), here()
    read, write = os.pipe()
    with warnings.catch_warnings():  # Python 3.12 on: fork with threads running warns; the copy uses none of them
        warnings.filterwarnings("ignore", message=r".*multi-threaded, use of fork\(\)", category=DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        _copy(there, read, write)  # never returns
    os.close(write)
    done = False
    try:
        started = time.monotonic()
        mine = here()
        answer = _answer(pid, read, PATIENCE_S + PATIENCE_X * (time.monotonic() - started))
        done = True
    finally:
        os.close(read)
        if not done:
            _end(pid)
    if answer is _NONE:
        return there(), mine
    return answer, mine


_NONE = object()  # no answer from the copy


def _copy(there: Callable[[], Any], read: int, write: int) -> None:
    """The forked copy: run ``there`` without output and without Ctrl-C (the caller's), write its pickled result,
    and leave at once (``os._exit``: the caller's atexit handlers, threads and sockets are not the copy's)."""
    status = 1
    try:
        os.close(read)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        quiet = os.open(os.devnull, os.O_WRONLY)
        os.dup2(quiet, 1)
        os.dup2(quiet, 2)
        sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 (the copy leaves with os._exit)
        data = pickle.dumps(there())
        view = memoryview(data)
        while view:
            view = view[os.write(write, view):]
        status = 0
    finally:
        os._exit(status)


def _answer(pid: int, read: int, patience: float) -> Any:
    """The copy's result, read within ``patience`` seconds, or :data:`_NONE` (it failed, died, or took too long);
    the copy is reaped either way."""
    chunks, deadline = [], time.monotonic() + patience
    try:
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([read], [], [], left)[0]:
                continue
            chunk = os.read(read, 1 << 20)
            if not chunk:  # the copy closed its end: it has left
                _, status = os.waitpid(pid, 0)
                if os.waitstatus_to_exitcode(status) != 0:
                    return _NONE
                try:
                    return pickle.loads(b"".join(chunks))
                except Exception:  # a result that pickles but does not load back (rare): done here instead
                    return _NONE
            chunks.append(chunk)
        _end(pid)
        return _NONE
    except BaseException:
        _end(pid)
        raise


def _end(pid: int) -> None:
    """Kill the copy if it still runs, and reap it."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:  # reaped already
        pass
