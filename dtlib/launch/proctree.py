"""The processes below a process, read from ``/proc`` (Linux; elsewhere none), making a rank their reaper, and
ending a whole tree with nothing escaping.

Kept to the standard library: a rank imports it as it starts. Example: ``descendants(os.getpid())``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time

PR_SET_CHILD_SUBREAPER = 36  # from <linux/prctl.h>


def descendants(root: int) -> list[tuple[int, int, str]]:
    """``(pid, process group, name)`` of every living process below ``root``, parents before children. A process
    that left for a session or group of its own is still found here, by its parent; one whose parent exited (a
    double fork) only where ``root`` is its reaper (:func:`reap_orphans`)."""
    children: dict[int, list[int]] = {}
    about: dict[int, tuple[int, str]] = {}
    try:
        entries = [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return []
    for pid in entries:
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat_file:
                stat = stat_file.read().decode("utf-8", "replace")
        except OSError:  # gone meanwhile
            continue
        name, fields = stat[stat.find("(") + 1:stat.rfind(")")], stat[stat.rfind(")") + 2:].split()
        if len(fields) > 2 and fields[0] != "Z":  # a zombie is only a name waiting to be reaped
            children.setdefault(int(fields[1]), []).append(pid)
            about[pid] = (int(fields[2]), name)
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append((child, *about[child]))
            todo.append(child)
    return found


def reap_orphans() -> bool:
    """Make this process the reaper of its descendants' orphans (``PR_SET_CHILD_SUBREAPER``): a daemon that
    double-forked away from a rank becomes the rank's child instead of init's, so it can be found and ended.
    True where Linux granted it."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def running(pid: int) -> bool:
    """Whether a process ``pid`` exists on this machine; another user's counts as running (not ours to judge).
    Example: ``running(os.getpid())`` is True."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def state(pid: int) -> str | None:
    """The state letter ``/proc`` gives ``pid`` (``"R"``, ``"S"``, ``"T"`` stopped, ``"Z"`` zombie), or None where
    it is gone or unknown (not Linux). Example: ``state(os.getpid()) == "R"``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            stat = stat_file.read().decode("utf-8", "replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    return fields[0] if fields else None


def stopped(pid: int) -> bool:
    """True while ``pid`` is stopped (SIGSTOP): it runs no code and forks nothing until it is continued or killed."""
    return state(pid) in ("T", "t")


FREEZE_S = 2.0  # how long to wait for a SIGSTOPped process to stop (one stuck in the kernel never does)


def freeze(root: int, *, include_root: bool, wait_s: float = FREEZE_S) -> list[int]:
    """SIGSTOP every process below ``root`` (and ``root`` with ``include_root``) until a reading of the tree finds
    none new and each is stopped; the pids stopped, parents before children.

    A stopped process forks nothing and a process whose parent is stopped is not orphaned, so once the reading is
    stable no process of the tree can escape it before it is killed. Example: ``freeze(rank_pid, include_root=True)``.
    """
    if include_root:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(root, signal.SIGSTOP)
    frozen: list[int] = []
    deadline = time.monotonic() + wait_s
    while True:
        new = [pid for pid, _group, _name in descendants(root) if pid not in frozen]
        for pid in new:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGSTOP)
        frozen += new
        running = [pid for pid in ([root] if include_root else []) + frozen if state(pid) not in (None, "T", "t", "Z")]
        if (not new and not running) or time.monotonic() >= deadline:
            return frozen
        time.sleep(0.001)


def end_below(root: int, *, include_root: bool) -> list[int]:
    """SIGKILL every process below ``root`` (and ``root`` itself with ``include_root``), frozen first
    (:func:`freeze`), so that none forked meanwhile escapes; the pids killed below ``root``.
    Example: ``end_below(rank_pid, include_root=True)``."""
    frozen = freeze(root, include_root=include_root)
    for pid in frozen:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    if include_root:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(root, signal.SIGKILL)
    return frozen
