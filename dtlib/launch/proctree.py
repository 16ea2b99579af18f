"""The processes below a process, read from ``/proc`` (Linux; elsewhere none), and making a rank their reaper.

Kept to the standard library: a rank imports it as it starts. Example: ``descendants(os.getpid())``.
"""

from __future__ import annotations

import ctypes
import os
import sys

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
