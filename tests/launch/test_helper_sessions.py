"""multiprocessing's helpers that dtlib starts (the resource tracker, the forkserver) run in a session of their
own, so that a Jupyter kernel's shutdown does not wait for them, keep no descriptor they were not given, and
still end with the process that started them. Oracle: the kernel's own accounts (``os.getsid``, ``os.getpgid``,
``/proc/<pid>/fd``) against ipykernel's rule for the children it waits for at shutdown: those in its process
group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

STARTER = """
import json, os, multiprocessing.forkserver as forkserver, multiprocessing.resource_tracker as tracker


def links(pid):  # what each descriptor of pid is; one it closes meanwhile (the server while it starts) is left out
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            found.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:
            pass
    return found


read, write = os.pipe()
os.set_inheritable(write, True)   # an inheritable descriptor the helpers were not given
from dtlib.launch.processes import start_forkserver
start_forkserver()
pids = {"tracker": tracker._resource_tracker._pid, "server": forkserver._forkserver._forkserver_pid}
print(json.dumps({"pids": pids, "sid": os.getsid(0), "pgrp": os.getpgrp(),
                  "pipe": os.readlink(f"/proc/self/fd/{write}"),
                  "sids": {name: os.getsid(pid) for name, pid in pids.items()},
                  "pgrps": {name: os.getpgid(pid) for name, pid in pids.items()},
                  "fds": {name: links(pid) for name, pid in pids.items()}}))
"""


def _ended(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # a zombie has ended, unreaped
    except psutil.NoSuchProcess:
        return True


@pytest.mark.skipif(not hasattr(os, "POSIX_SPAWN_CLOSE"), reason="posix_spawn's file actions: Linux")
@pytest.mark.timeout(90)
def test_the_tracker_and_the_forkserver_run_in_sessions_of_their_own_and_end_with_their_starter():
    done = subprocess.run([sys.executable, "-c", STARTER], capture_output=True, text=True, timeout=60,
                          start_new_session=True)  # a process group of its own, as a kernel has
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    for name, pid in seen["pids"].items():
        assert seen["sids"][name] == pid != seen["sid"], name  # a session of its own, which it leads
        assert seen["pgrps"][name] != seen["pgrp"], name  # so ipykernel, which waits for its group, does not wait
        assert seen["pipe"] not in seen["fds"][name], f"{name} kept a descriptor it was not given"
    deadline = time.monotonic() + 30  # a guard: each ends as soon as its pipe from the starter closes
    while not all(_ended(pid) for pid in seen["pids"].values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_ended(pid) for pid in seen["pids"].values()), f"outlived their starter: {seen['pids']}"
