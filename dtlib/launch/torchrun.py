"""Start ``torchrun`` from a notebook cell or a test: one node, or several nodes simulated on this machine.

Each call runs ``python -m torch.distributed.run`` (that is ``torchrun``) with this Python, waits
at most ``timeout`` seconds, and returns the command and its output; a hang kills the whole
process group instead of blocking the cell::

    out = dtlib.launch.torchrun.single_node(["-m", "dtlib.examples.env"], nproc_per_node=2)
    print(out.command); print(out.output)
    nodes = dtlib.launch.torchrun.simulate_nodes(["-m", "dtlib.examples.env"], nnodes=2)   # two "machines"
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from dtlib import arguments
from dtlib.launch.job import STARTUP_S
from dtlib.launch.processes import SOCKET_PATH_MAX, end_tree, free_port, temp_base
from dtlib.launch.proctree import end_below


@dataclass
class Finished:
    """One torchrun process: the command line, its exit code, its combined output, and the seconds from its
    start to its end as the caller saw them (Python and torch imported by the agent and by every rank included)."""

    command: str
    returncode: int
    output: str
    seconds: float = 0.0


def _checked(target: Sequence[str], nproc_per_node: int, timeout: float) -> tuple[list[str], int, float]:
    """The arguments every helper takes, checked before anything starts."""
    if isinstance(target, str) or not isinstance(target, Sequence) or not target or \
            not all(isinstance(part, str) for part in target):
        raise ValueError(f"target must be a non-empty list of strings, as after torchrun's options on a command line "
                         f"(['train.py', '--steps', '4'] or ['-m', 'dtlib.train', 'ddp']), got {target!r:.80}")
    seconds = arguments.seconds("timeout", timeout)
    if seconds is None:
        raise ValueError("timeout must be a number of seconds: a torchrun job that hangs would hang the caller")
    return list(target), arguments.count("nproc_per_node", nproc_per_node, 1), seconds


def _command(target: Sequence[str], nproc_per_node: int, options: Sequence[str],
             module: str = "torch.distributed.run") -> list[str]:
    # --tee=3: torchrun relays each rank's stdout and stderr line by line, prefixed [default<LOCAL_RANK>]:
    return [sys.executable, "-m", module, *options, f"--nproc_per_node={nproc_per_node}", "--tee=3", *target]


#: Set where torchrun may restart its ranks. torch 2.13's agent keeps one rendezvous store, under one prefix,
#: across attempts, while the ranks assume a new one: a restarted gloo rank that reads a peer's key before the
#: peer rewrites it gets a dead rank's address, and fails with "Connection refused" or hangs (pytorch issue
#: 167288). With this variable each attempt of the c10d rendezvous
#: (``--standalone``'s) gets its own store. The static rendezvous keeps its one store whatever it says: there,
#: only a script that joins under a prefix of its attempt (``TORCHELASTIC_RESTART_COUNT``) restarts (notebook 16).
RESTART_FIX = ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
_SET_BY_DTLIB = ("nproc_per_node", "tee", "standalone", "nnodes", "node_rank", "master_addr", "master_port",
                 "rdzv_backend", "rdzv_endpoint", "rdzv_id")


def _torchrun_options(options: Sequence[str], restart_fix: bool = True) -> tuple[list[str], dict[str, str]]:
    """``options`` checked by torchrun's own parser, and the environment they need: :data:`RESTART_FIX` where
    they allow restarts (unless this environment sets it already, or ``restart_fix`` is False)."""
    if isinstance(options, str) or not all(isinstance(option, str) for option in options):
        raise ValueError(f"options must be a list of torchrun's options, as strings (['--max_restarts=1']), "
                         f"got {options!r:.80}")
    parsed, complaint = parse_options([*options, "train.py"])
    if parsed is None:
        raise ValueError(f"torchrun refuses the options {list(options)}: {complaint}")
    if parsed.get("training_script") != "train.py" or parsed.get("training_script_args"):
        raise ValueError(f"options must hold torchrun's options only, not the script or its arguments (those go in "
                         f"target): {list(options)}")
    ours = [name for name in _SET_BY_DTLIB if parsed.get(name) is not NOT_GIVEN]
    if ours:
        raise ValueError(f"--{ours[0]} is set by this helper itself; pass the others only")
    restarts = parsed.get("max_restarts")
    env = {}
    if restart_fix is not True and restart_fix is not False:
        raise ValueError(f"restart_fix must be True or False, got {restart_fix!r}")
    if restart_fix and restarts is not NOT_GIVEN and int(restarts) > 0 and RESTART_FIX[0] not in os.environ:  # type: ignore[call-overload]
        env[RESTART_FIX[0]] = RESTART_FIX[1]
    return list(options), env


#: What a rank's multiprocessing adds to its temporary folder for a socket: /pymp-12345678/listener-12345678
_RANK_SOCKET_SUFFIX = len("/pymp-12345678/listener-12345678")


@contextlib.contextmanager
def _private_temp() -> Iterator[dict[str, str]]:
    """A temporary folder private to one job, removed with it, and the environment that sends the job's litter
    there: torchrun's logs (``PET_LOG_DIR``, which its parser reads for ``--log-dir``; left to itself, each
    torchrun leaves a ``torchelastic_*`` folder, 22 of them per Run All of notebooks 07 and 16) and the ranks'
    own temporary files (``TMPDIR``: a DataLoader's workers leave multiprocessing's ``pymp-*`` folders when
    their rank ends). The command shown stays the one a learner would type. A ``--log-dir`` in the options, or
    a ``PET_LOG_DIR`` already set, wins, and what is there stays; ``TMPDIR`` is left alone where the folder's
    path would make a rank's socket path too long."""
    folder = tempfile.mkdtemp(prefix="dtlib-run-", dir=temp_base())
    env = {} if "PET_LOG_DIR" in os.environ else {"PET_LOG_DIR": folder}
    if len(os.fsencode(folder)) + _RANK_SOCKET_SUFFIX <= SOCKET_PATH_MAX:
        env["TMPDIR"] = folder
    try:
        yield env
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _start(command: list[str], extra_env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(extra_env or {})}  # OMP set: torchrun prints no banner about it
    env.pop("DTLIB_SPAWN", None)
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)  # its own process group: a timeout kills every rank


def _stop(processes: list[subprocess.Popen[str]]) -> None:
    """SIGTERM first: torchrun's agent then stops its ranks, which run in sessions of their own;
    SIGKILL to whatever is left after a grace period, the agent and every process below it
    (:func:`dtlib.launch.processes.end_tree`: the ranks' own sessions too)."""
    for process in processes:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            end_tree(process.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5)


def _finish(processes: list[subprocess.Popen[str]], commands: list[list[str]], timeout: float,
            env: dict[str, str] | None = None, silence: float | None = None,
            kill: tuple[int | str, str] | None = None, port: int | None = None) -> list[Finished]:
    """Wait for every process, reading their output as it comes. Stop them all at ``timeout`` seconds, or,
    once they have printed a first line, when none has printed another for ``silence`` seconds (the imports
    before a first line are slow on a busy machine); say so at the end of the output of each process that
    was still running. ``kill=(index, text)``: SIGKILL process ``index`` and everything below it, once, as soon
    as it prints a line holding ``text``, and say so in its output; ``kill=("host", text)``: the process that
    listens on ``port``."""
    started = time.monotonic()  # a moment after they started: Popen returns once each has been exec'd
    lines: list[list[str]] = [[] for _ in processes]
    last_line: list[float] = []  # when the latest line came, once one has
    said: set[int] = set()  # the processes that printed kill's text

    def read(index: int, process: subprocess.Popen[str]) -> None:
        for line in process.stdout:  # type: ignore[union-attr]
            lines[index].append(line)
            last_line[:] = [time.monotonic()]
            if kill is not None and kill[1] in line:
                said.add(index)

    readers = [threading.Thread(target=read, args=pair, daemon=True) for pair in enumerate(processes)]
    for reader in readers:
        reader.start()
    ended: list[float | None] = [None] * len(processes)
    why = ""
    try:
        while not why:
            now = time.monotonic()
            ended = [took if took is not None or process.poll() is None else now - started
                     for took, process in zip(ended, processes, strict=True)]
            if all(took is not None for took in ended):
                break
            if kill is not None and said:
                doomed = _store_host(port, processes) if kill[0] == "host" and port is not None else kill[0]
                if isinstance(doomed, int) and doomed in said:
                    _kill_node(processes[doomed], lines[doomed], kill[1], now - started, kill[0] == "host")
                    kill = None
            if now - started >= timeout:
                why = f"stopped after {timeout:.0f} s"
            elif silence is not None and last_line and now - last_line[0] >= silence:
                why = f"stopped after {now - started:.0f} s, {silence:.0f} s without a line of output"
            else:
                time.sleep(0.05)
    except BaseException:  # an interrupt (the notebook's stop button): the job ends with the cell, not after it
        _stop(processes)
        raise
    stopped = [took is None for took in ended]
    if why:
        _stop(processes)
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5)
    for reader in readers:  # a rank that outlived its agent holds the pipe: stop waiting for it
        reader.join(timeout=10)
    outputs = ["".join(list(got)) + (f"\n[dtlib.launch.torchrun] {why}" if stop else "")
               for got, stop in zip(lines, stopped, strict=True)]
    seconds = [took if took is not None else time.monotonic() - started for took in ended]
    shown = [" ".join(c[1:]).replace("-m torch.distributed.run", "torchrun", 1) if "torch.distributed.run" in c
             else " ".join(["python", *c[1:]]) for c in commands]
    shown = [" ".join(f"{name}={value}" for name, value in (env or {}).items()) + " " * bool(env) + command
             for command in shown]
    return [Finished(cmd, p.returncode if p.returncode is not None else -9, out, took)
            for cmd, p, out, took in zip(shown, processes, outputs, seconds, strict=True)]


def _kill_node(process: subprocess.Popen[str], lines: list[str], text: str, at: float, host: bool) -> None:
    """SIGKILL a node whole, as when a machine is lost: its agent and every rank below it, with no warning."""
    below = end_below(process.pid, include_root=True)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    lines.append(f"[dtlib.launch.torchrun] {at:.1f} s: killed this node{' (it served the rendezvous store)' * host}, "
                 f"its agent and the {len(below)} process{'es' * (len(below) != 1)} below it, with SIGKILL, after a "
                 f"line holding {text!r}\n")


def single_node(target: Sequence[str], nproc_per_node: int = 2, *, options: Sequence[str] = (),
                timeout: float = 60.0, silence: float | None = None, legacy: bool = False,
                restart_fix: bool = True) -> Finished:
    """``torchrun --standalone --nproc_per_node=N [options] <target>``: one node, a fresh rendezvous on a free port.

    ``target`` is what follows torchrun's options: ``["train.py", "--steps", "4"]`` or
    ``["-m", "dtlib.train", "ddp"]``. ``options`` are more of torchrun's own (``["--max_restarts=1"]``), checked
    by its parser; where they allow restarts, :data:`RESTART_FIX` is set too, and shown in ``command``
    (``restart_fix=False`` leaves it out, to show what torch does without it). ``legacy=True`` runs the
    deprecated ``python -m torch.distributed.launch`` instead, which also passes
    ``--local-rank=N`` to the script. ``silence``: stop the job sooner, when it has printed a line and then
    no other for this many seconds: a hang, found without a ``timeout`` long enough for a busy machine's run.
    """
    target, nproc_per_node, timeout = _checked(target, nproc_per_node, timeout)
    silence = arguments.seconds("silence", silence)
    options, env = _torchrun_options(options, restart_fix)
    module = "torch.distributed.launch" if legacy else "torch.distributed.run"
    command = _command(target, nproc_per_node, ["--standalone", *options], module)
    with _private_temp() as private:
        return _finish([_start(command, {**env, **private})], [command], timeout, env, silence)[0]


def exit_codes(finished: Finished) -> dict[int, int]:
    """The exit code of each failed rank, by global rank, from the failure summary torchrun prints
    (torchrun itself exits with 1 whatever they were). Example: ``{0: -15, 1: 3}`` (rank 1 exited with 3,
    then the agent stopped rank 0 with SIGTERM); ``{}`` when none failed."""
    found = re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", finished.output)
    return {int(rank): int(code) for rank, code in found}


def simulate_nodes(target: Sequence[str], nnodes: int = 2, nproc_per_node: int = 1, *, rendezvous: str = "c10d",
                   min_nodes: int | None = None, store: str = "agent", kill: tuple[int | str, str] | None = None,
                   absent: int = 0, options: Sequence[str] = (), timeout: float = 60.0, silence: float | None = None,
                   restart_fix: bool = True) -> list[Finished]:
    """``nnodes`` torchrun processes on this machine, each playing one node of a cluster; one ``Finished`` per
    node started, in the order they were started (node 0 first).

    ``rendezvous="c10d"``: every node names the same ``--rdzv_endpoint`` and ``--rdzv_id``, and node ranks
    are given out when the rendezvous completes, not in order of arrival. With ``store="agent"`` the agent that
    binds the endpoint's port first serves the rendezvous store, as the agent on the endpoint's machine does on a
    cluster (here every node is on 127.0.0.1). ``store="apart"``: a process of its own serves it, as a store on a
    machine that runs no training would (its start is not counted in ``timeout``); pass
    ``--rdzv_conf=is_host=false`` in ``options`` to say so to torchrun.
    ``min_nodes``: an elastic job, ``--nnodes=min_nodes:nnodes``, which carries on with any number of nodes in
    that range. ``rendezvous="static"``: ``--node_rank``, ``--master_addr`` and ``--master_port`` fixed by
    hand, node 0 hosting the store, as with ``torch.distributed.launch`` of old.

    ``kill=(node, text)``: once node ``node`` prints a line holding ``text``, SIGKILL it whole, its agent and
    every rank below it, as when a machine is lost; its output says when. ``kill=("host", text)``: the node whose
    agent serves the store (``store="agent"``). ``absent``: that many nodes, the last ones, are never started,
    as machines that never came up: the others wait for them until the rendezvous gives up (its
    ``join_timeout``, 600 s unless ``--rdzv_conf`` says otherwise). ``options``: more of torchrun's own,
    given to every node, and ``silence`` and ``restart_fix``, as in :func:`single_node`. Example, a job that
    loses one of its two nodes and goes on with the other::

        simulate_nodes(["train.py"], 2, min_nodes=1, store="apart", kill=(0, '"step": 6'),
                       options=["--max_restarts=1", "--rdzv_conf=is_host=false"])
    """
    target, nproc_per_node, timeout = _checked(target, nproc_per_node, timeout)
    silence = arguments.seconds("silence", silence)
    extra, env = _torchrun_options(options, restart_fix)
    nnodes = arguments.count("nnodes", nnodes, 1)
    if rendezvous not in ("c10d", "static"):
        raise ValueError(f"rendezvous must be 'c10d' or 'static', got {rendezvous!r}")
    if store not in ("agent", "apart"):
        raise ValueError(f"store must be 'agent' (a node's agent serves it) or 'apart' (a process of its own), "
                         f"got {store!r}")
    if rendezvous == "static" and (min_nodes is not None or store != "agent"):
        raise ValueError("min_nodes and store='apart' need rendezvous='c10d': the static rendezvous has a fixed "
                         "number of nodes, and node 0 serves its store")
    smallest = nnodes if min_nodes is None else arguments.count("min_nodes", min_nodes, 1)
    if smallest > nnodes:
        raise ValueError(f"min_nodes must be at most nnodes ({nnodes}), got {min_nodes}")
    absent = arguments.count("absent", absent, 0)
    if absent >= nnodes:
        raise ValueError(f"absent must be less than nnodes ({nnodes}): at least one node starts; got {absent}")
    kill = _checked_kill(kill, nnodes - absent, store)
    port = free_port()
    sizes = f"{smallest}:{nnodes}" if min_nodes is not None else str(nnodes)
    commands = []
    for node_rank in range(nnodes):
        if rendezvous == "c10d":
            options = [f"--nnodes={sizes}", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                       f"--rdzv_id=dtlib-{port}"]
        else:
            options = [f"--nnodes={nnodes}", f"--node_rank={node_rank}", "--master_addr=127.0.0.1",
                       f"--master_port={port}"]
        commands.append(_command(target, nproc_per_node, [*options, *extra]))
    server = _store_server(port) if store == "apart" else None
    processes: list[subprocess.Popen[str]] = []
    with _private_temp() as private:
        try:
            processes += [_start(command, {**env, **private}) for command in commands[:nnodes - absent]]
            return _finish(processes, commands[:nnodes - absent], timeout, env, silence, kill, port)
        except BaseException:
            _stop(processes)
            raise
        finally:
            if server is not None:
                end_tree(server.pid)
                server.communicate()  # reaped, and its pipes closed


def _checked_kill(kill: object, nnodes: int, store: str) -> tuple[int | str, str] | None:
    if kill is None:
        return None
    node = kill[0] if isinstance(kill, tuple) and len(kill) == 2 else None
    if not (isinstance(kill, tuple) and len(kill) == 2 and isinstance(kill[1], str) and kill[1]
            and (node == "host" or isinstance(node, int) and not isinstance(node, bool) and 0 <= node < nnodes)):
        raise ValueError(f"kill must be (node, text): a node from 0 to {nnodes - 1}, or 'host' (the node whose agent "
                         f"serves the rendezvous store), and the text of a line after which it dies, e.g. "
                         f"(1, '\"step\": 6'); got {kill!r:.80}")
    if node == "host" and store != "agent":
        raise ValueError("kill=('host', ...) needs store='agent': with store='apart' no node serves the store")
    return kill  # type: ignore[return-value]


def _listening(port: int) -> list[str]:
    """The socket inodes listening on TCP ``port`` on this machine, read from ``/proc/net`` (connecting to
    nothing: a store sent a connection it cannot parse logs a warning); none where that cannot be read."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    found.append(fields[9])
    return found


def _store_host(port: int, processes: list[subprocess.Popen[str]]) -> int | None:
    """The index of the process that listens on ``port`` (a torchrun agent serving the rendezvous store)."""
    sockets = {f"socket:[{inode}]" for inode in _listening(port)}
    for index, process in enumerate(processes):
        with contextlib.suppress(OSError):
            folder = f"/proc/{process.pid}/fd"
            if any(os.readlink(f"{folder}/{fd}") in sockets for fd in os.listdir(folder)):
                return index
    return None


def _store_server(port: int, start_s: float = STARTUP_S) -> subprocess.Popen[str]:
    """A TCPStore server on 127.0.0.1:``port`` in a process of its own, which lives until it is killed or its
    caller dies (it exits when its stdin, a pipe from the caller, closes); returned once it listens. Its start
    (Python and torch imported) may take ``start_s``, outside the job's timeout, as a rank's start does in
    :func:`dtlib.spawn`: a busy machine's slow start is not the job's fault."""
    code = ("import sys, torch.distributed as dist; "
            f"store = dist.TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False); "
            "sys.stdin.read()")
    server = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + start_s
    try:
        while _store_host(port, [server]) != 0 and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    except BaseException:  # an interrupt while it starts: it ends with the call
        end_tree(server.pid)
        server.communicate()
        raise
    if _store_host(port, [server]) != 0:
        end_tree(server.pid)
        said = [line for line in server.communicate()[1].splitlines() if line.strip()]
        raise RuntimeError(f"the rendezvous store could not start on port {port}"
                           + (f": {said[-1].strip()[:300]}" if said else f" within {start_s:.0f} s"))
    return server


def env_records(finished: Sequence[Finished]) -> list[dict[str, object]]:
    """The ``DTLIB_ENV {...}`` lines that ``dtlib.examples.env`` prints, parsed, sorted by RANK."""
    records = [json.loads(match) for run in finished for match in re.findall(r"DTLIB_ENV (\{.*?\})", run.output)]
    return sorted(records, key=lambda record: int(record["RANK"]))


def json_records(finished: Finished | Sequence[Finished]) -> list[dict[str, Any]]:
    """Every line a rank printed that holds one JSON object (``print(json.dumps(record))``), parsed, in the order
    each node's torchrun relayed them (``[default<LOCAL_RANK>]:`` removed); lines of anything else are skipped.
    Example: ``json_records(single_node(["train.py"]))`` -> ``[{"rank": 0, "step": 1, ...}, ...]``."""
    runs = [finished] if isinstance(finished, Finished) else list(finished)
    records = []
    for run in runs:
        for line in run.output.splitlines():
            text = re.sub(r"^\[[a-z]*\d+\]:", "", line).strip()
            if text.startswith("{") and text.endswith("}"):
                try:
                    value = json.loads(text)
                except json.JSONDecodeError:
                    continue
                if isinstance(value, dict):
                    records.append(value)
    return records


NOT_GIVEN = object()  # parse_options: marks the options a command line leaves to torchrun's defaults


def option_defaults() -> dict[str, object]:
    """Every option of torchrun's parser with its default: what a bare ``torchrun train.py`` gets."""
    from torch.distributed.run import get_args_parser

    return vars(get_args_parser().parse_args(["train.py"]))


def parse_options(arguments: list[str]) -> tuple[dict[str, object] | None, str]:
    """torchrun's own parser on ``arguments``: ({option: value, ``NOT_GIVEN`` where unset}, "") or
    (None, argparse's complaint in one line)."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    unset = argparse.Namespace(**dict.fromkeys(option_defaults(), NOT_GIVEN))  # argparse keeps what is set
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
            return vars(parser.parse_args(arguments, namespace=unset)), ""
    except SystemExit:
        complaint = [line for line in said.getvalue().splitlines() if "error:" in line]
        return None, complaint[-1].split("error:", 1)[1].strip() if complaint else "it prints torchrun's help"
