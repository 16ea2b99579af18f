"""Start ``torchrun`` from a notebook cell or a test: one node, or several nodes simulated on this machine.

Each call runs ``python -m torch.distributed.run`` (that is ``torchrun``) with this Python, waits
at most ``timeout`` seconds, and returns the command and its output; a hang kills the whole
process group instead of blocking the cell::

    out = dtlib.torchrun.launch(["-m", "dtlib.examples.env"], nproc_per_node=2)
    print(out.command); print(out.output)
    nodes = dtlib.torchrun.simulate_nodes(["-m", "dtlib.examples.env"], nnodes=2)   # two "machines"
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Finished:
    """One torchrun process: the command line, its exit code and its combined output."""

    command: str
    returncode: int
    output: str


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for ``--master_port`` / ``--rdzv_endpoint``)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _command(target: Sequence[str], nproc_per_node: int, options: Sequence[str]) -> list[str]:
    # --tee=3: torchrun relays each rank's stdout and stderr line by line, prefixed [default<LOCAL_RANK>]:
    return [sys.executable, "-m", "torch.distributed.run", *options, f"--nproc_per_node={nproc_per_node}", "--tee=3",
            *target]


def _start(command: list[str]) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # set: torchrun then prints no banner about it
    env.pop("DTLIB_SPAWN", None)
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)  # its own process group: a timeout kills every rank


def _stop(processes: list[subprocess.Popen[str]]) -> None:
    """SIGTERM first: torchrun's agent then stops its ranks, which run in sessions of their own;
    SIGKILL to whatever is left after a grace period."""
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def _finish(processes: list[subprocess.Popen[str]], commands: list[list[str]], timeout: float) -> list[Finished]:
    deadline = time.monotonic() + timeout
    outputs = []
    for process in processes:
        try:
            out, _ = process.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _stop(processes)
            try:
                out, _ = process.communicate(timeout=10)
            except subprocess.TimeoutExpired:  # a rank outlived its agent and holds the pipe: stop reading
                process.stdout.close()
                out = ""
            out += f"\n[dtlib.torchrun] stopped after {timeout:.0f} s"
        outputs.append(out)
    shown = [" ".join(c[1:]).replace("-m torch.distributed.run", "torchrun", 1) for c in commands]
    return [Finished(cmd, p.returncode, out) for cmd, p, out in zip(shown, processes, outputs, strict=True)]


def launch(target: Sequence[str], nproc_per_node: int = 2, *, timeout: float = 60.0) -> Finished:
    """``torchrun --standalone --nproc_per_node=N <target>``: one node, a fresh rendezvous on a free port.

    ``target`` is what follows torchrun's options: ``["train.py", "--steps", "4"]`` or
    ``["-m", "dtlib.train", "ddp"]``.
    """
    command = _command(target, nproc_per_node, ["--standalone"])
    return _finish([_start(command)], [command], timeout)[0]


def simulate_nodes(target: Sequence[str], nnodes: int = 2, nproc_per_node: int = 1, *, rendezvous: str = "c10d",
                   timeout: float = 60.0) -> list[Finished]:
    """``nnodes`` torchrun processes on this machine, each playing one node of a cluster.

    ``rendezvous="c10d"``: every node names the same ``--rdzv_endpoint`` and ``--rdzv_id``; the
    first to arrive hosts the store and ranks are handed out as nodes join (elastic).
    ``rendezvous="static"``: ``--node_rank``, ``--master_addr`` and ``--master_port`` fixed by hand,
    node 0 hosting the store, as with ``torch.distributed.launch`` of old.
    """
    if nnodes < 1:
        raise ValueError(f"nnodes must be >= 1, got {nnodes}")
    if rendezvous not in ("c10d", "static"):
        raise ValueError(f"rendezvous must be 'c10d' or 'static', got {rendezvous!r}")
    port = free_port()
    commands = []
    for node_rank in range(nnodes):
        if rendezvous == "c10d":
            options = [f"--nnodes={nnodes}", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                       f"--rdzv_id=dtlib-{port}"]
        else:
            options = [f"--nnodes={nnodes}", f"--node_rank={node_rank}", "--master_addr=127.0.0.1",
                       f"--master_port={port}"]
        commands.append(_command(target, nproc_per_node, options))
    return _finish([_start(c) for c in commands], commands, timeout)


def env_records(finished: Sequence[Finished]) -> list[dict[str, object]]:
    """The ``DTLIB_ENV {...}`` lines that ``dtlib.examples.env`` prints, parsed, sorted by RANK."""
    records = [json.loads(match) for run in finished for match in re.findall(r"DTLIB_ENV (\{.*?\})", run.output)]
    return sorted(records, key=lambda record: int(record["RANK"]))


def check_command(command: object, *, nnodes: int = 2, nproc_per_node: int = 4, node_rank: int = 1,
                  master_addr: str = "10.0.0.1", master_port: int = 29500) -> object:
    """Notebook 07's exercise: the torchrun line for node ``node_rank`` of a static (hand-numbered) job.

    Example: ``check_command("torchrun --standalone train.py")`` explains why standalone is one node only.
    """
    import shlex

    from dtlib.checks import Feedback

    if not isinstance(command, str) or not command.strip():
        return Feedback(False, "Write the command as one string, e.g. \"torchrun --nnodes=... train.py\".")
    words = shlex.split(command)
    if words[0] not in ("torchrun", "python") or "train.py" not in words:
        return Feedback(False, "Start with torchrun and end with the script, train.py.")
    options = {}
    for word in words[1:words.index("train.py")]:
        if word.startswith("--"):
            name, _, value = word[2:].replace("-", "_").partition("=")
            options[name] = value
    wanted = {"nnodes": str(nnodes), "nproc_per_node": str(nproc_per_node), "node_rank": str(node_rank),
              "master_addr": master_addr, "master_port": str(master_port)}
    if "standalone" in options:
        return Feedback(False, "--standalone starts a private rendezvous on this machine: one node only. "
                               "Several nodes must name the same --master_addr and --master_port.")
    for name, value in wanted.items():
        if name not in options:
            return Feedback(False, f"--{name} is missing (every node needs it, and needs it as --{name}=VALUE).")
        if options[name] != value:
            hint = " (node ranks count from 0)" if name == "node_rank" else ""
            return Feedback(False, f"--{name}={options[name]} should be {value}{hint}.")
    return Feedback(True, f"Right: {nnodes * nproc_per_node} ranks; this node's get RANK "
                          f"{node_rank * nproc_per_node}..{(node_rank + 1) * nproc_per_node - 1} and LOCAL_RANK "
                          f"0..{nproc_per_node - 1}; node 0 hosts the store at {master_addr}:{master_port}.")
