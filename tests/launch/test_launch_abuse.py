"""``dtlib.spawn`` under abuse, in this process: interrupts during clean-up, calls from two
threads, broken exceptions, odd arguments, a dying forkserver. Real-kernel cases are in
test_launch_kernel.py; the output relay's own tests are in test_launch_relay.py.
"""

from __future__ import annotations

import contextlib
import ipaddress
import multiprocessing.forkserver
import multiprocessing.process
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import cloudpickle
import numpy as np
import psutil
import pytest
import torch
import torch.distributed as dist

import dtlib
import dtlib.compat
import dtlib.launch.job
import dtlib.launch.processes
import dtlib.launch.spawn
from dtlib.launch.processes import forkserver_pid, loopback_interface

cloudpickle.register_pickle_by_value(sys.modules[__name__])



# -- functions the ranks run -----------------------------------------------------------------


def own_rank(rank, world_size):
    return rank


def note_pid_and_port_then_sleep(rank, world_size, folder):
    path = os.path.join(folder, str(rank))
    with open(path + ".tmp", "w") as file:
        file.write(f"{os.getpid()} {os.environ['MASTER_PORT']}")
    os.replace(path + ".tmp", path)
    time.sleep(120)


def wait_for_file(path, timeout_s):
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)
    return os.path.exists(path)


def job_a(rank, world_size, folder):
    open(os.path.join(folder, f"a{rank}"), "w").close()
    return wait_for_file(os.path.join(folder, "b_started"), 60)


def job_b(rank, world_size, folder):
    open(os.path.join(folder, "b_started"), "w").close()
    return wait_for_file(os.path.join(folder, "a_done"), 30)  # a_done: job A's call has returned


class BrokenMessage(Exception):
    def __str__(self):
        raise RuntimeError("no message for you")


def raise_broken_message(rank, world_size):
    raise BrokenMessage()


def destroy_the_group_at_the_end(rank, world_size):
    value = torch.tensor([rank + 1])
    dist.all_reduce(value)
    dist.destroy_process_group()  # as a torchrun script ends
    return value.item()


def gloo_interface_and_addresses(rank, world_size):
    value = torch.ones(1)
    dist.all_reduce(value)
    addresses = {ipaddress.ip_address(c.laddr.ip) for c in psutil.Process().net_connections(kind="tcp")}
    on_loopback = all((a.ipv4_mapped or a).is_loopback if a.version == 6 else a.is_loopback for a in addresses)
    return os.environ.get("GLOO_SOCKET_IFNAME"), bool(addresses) and on_loopback


def read_gloo_variable(rank, world_size):
    return os.environ.get("GLOO_SOCKET_IFNAME")


def kill_the_parent_on_rank_0(rank, world_size, folder):
    path = os.path.join(folder, f"{rank}.pid")
    with open(path + ".tmp", "w") as file:
        file.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    if rank == 0 and all(wait_for_file(os.path.join(folder, f"{r}.pid"), 60) for r in range(world_size)):
        os.kill(os.getppid(), signal.SIGKILL)  # a forkserver rank's parent is the forkserver
    time.sleep(60)


# -- helpers ---------------------------------------------------------------------------------


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def listening_on(port: int) -> list[str]:
    return [c.laddr.ip for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port]


def exited(pid: int) -> bool:
    """Gone, or a zombie: the process itself has ended."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def interrupt_main_thread() -> None:
    """A real SIGINT, sent to this process's main thread only (never to other processes)."""
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


# -- interrupts ------------------------------------------------------------------------------


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
@pytest.mark.timeout(120)
def test_second_and_third_interrupt_during_clean_up_are_held(monkeypatch, tmp_path, leftovers):
    """Ctrl-C while the ranks run, then twice more while they are being stopped: the call ends in
    KeyboardInterrupt (not "ValueError: Cannot close a process while it is still running"),
    every rank is gone, the store no longer listens, and no descriptor is left open."""
    # The forkserver and resource tracker run from here on, and so does libuv: the first TCP store in a process
    # opens libuv's one pipe for signals (uv__signal_global_init), kept for the process's life.
    dtlib.spawn(own_rank, 2, output="none", init_process_group=False)
    before = open_fds()
    during_clean_up = []
    join = multiprocessing.process.BaseProcess.join

    def join_interrupted(self, timeout=None):
        if len(during_clean_up) < 2:
            during_clean_up.append(self.pid)
            interrupt_main_thread()
            time.sleep(0.05)  # the interrupt arrives here, half-way through the clean-up
        return join(self, timeout)

    def first_interrupt():
        if all(wait_for_file(tmp_path / str(rank), 60) for rank in range(2)):
            monkeypatch.setattr(multiprocessing.process.BaseProcess, "join", join_interrupted)
            interrupt_main_thread()

    interrupter = threading.Thread(target=first_interrupt)
    interrupter.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            dtlib.spawn(note_pid_and_port_then_sleep, 2, args=(str(tmp_path),), output="none", timeout=100,
                        init_process_group=False)
    finally:
        interrupter.join()
    assert len(during_clean_up) == 2
    pids, ports = zip(*[(int(a), int(b)) for a, b in ((tmp_path / str(r)).read_text().split() for r in range(2))],
                      strict=True)
    leftovers.assert_clean(pids)
    assert listening_on(ports[0]) == []
    assert open_fds() == before


# -- threads ---------------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_calls_from_two_threads_never_touch_main_module(monkeypatch):
    """Two threads calling dtlib.spawn at once (forkserver and spawn): every rank starts while
    sys.modules['__main__'] is the real one, and it is still the real one afterwards.

    Both threads start their first call together (a barrier), so the spawn job's ranks start while the
    forkserver thread starts its own. One spawn job, not three: its later calls would run alone anyway
    (the forkserver thread's three calls end within a second), at 4 s a rank."""
    main = sys.modules["__main__"]
    seen = []
    start = multiprocessing.process.BaseProcess.start

    def start_and_look(self):
        seen.append(sys.modules["__main__"] is main)
        return start(self)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", start_and_look)
    results, errors = [], []
    together = threading.Barrier(2, timeout=60)

    def calls(method):
        try:
            together.wait()
            for _ in range(3 if method == "forkserver" else 1):
                results.append(dtlib.spawn(own_rank, 2, start_method=method, output="none"))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=calls, args=(method,)) for method in ("forkserver", "spawn")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert results == [[0, 1]] * 4
    assert seen and all(seen)
    assert sys.modules["__main__"] is main


@pytest.mark.timeout(120)
def test_ranks_another_thread_starts_while_the_helpers_start_are_not_put_in_a_session_of_their_own():
    """While one thread starts multiprocessing's helpers in a session of their own, a "spawn" rank that another
    thread starts goes through the same ``spawnv_passfds``. It must start as any rank does: a session leader
    cannot put itself in a process group of its own, so the rank died with EPERM (a fresh clone's gate, stop 66).
    The helpers' window is held open here, so the other thread's ranks start inside it every time."""
    inside, done = threading.Event(), threading.Event()

    def helpers_starting():
        with dtlib.launch.processes._helpers_in_own_session():
            inside.set()
            done.wait(90)

    holder = threading.Thread(target=helpers_starting)
    holder.start()
    try:
        assert inside.wait(30)
        assert dtlib.spawn(own_rank, 2, start_method="spawn", output="none") == [0, 1]
    finally:
        done.set()
        holder.join()


@pytest.mark.timeout(180)
def test_fork_jobs_in_two_threads_do_not_hold_each_others_pipes(monkeypatch, tmp_path):
    """Job B forks its ranks while job A runs. B's ranks must not keep A's end-of-job pipe open,
    or A's ranks never see the end of the job: A's call would wait for B's ranks to exit, and
    B's ranks (which wait for A's call to return) would give up waiting and return False."""
    monkeypatch.setattr(dtlib.launch.spawn, "FINISH_GRACE_S", 120.0)  # A would wait, not kill, on a held pipe
    outcome = {}

    def run_a():
        outcome["a"] = dtlib.spawn(job_a, 2, args=(str(tmp_path),), start_method="fork", output="none")
        (tmp_path / "a_done").touch()

    def run_b():
        if all(wait_for_file(tmp_path / f"a{rank}", 60) for rank in range(2)):
            outcome["b"] = dtlib.spawn(job_b, 2, args=(str(tmp_path),), start_method="fork", output="none")

    threads = [threading.Thread(target=run_a), threading.Thread(target=run_b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outcome == {"a": [True, True], "b": [True, True]}


# -- what the ranks report -------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_exception_whose_str_raises_is_reported_with_its_type():
    """An exception whose __str__ raises is still reported: its type, a note, its traceback."""
    with pytest.raises(dtlib.WorkerError) as info:
        dtlib.spawn(raise_broken_message, 1, output="none")
    [failure] = info.value.failures
    assert failure.exc_type == "BrokenMessage"
    assert "str() of this BrokenMessage raised RuntimeError" in failure.message
    assert "raise_broken_message" in failure.traceback and "BrokenMessage" in failure.traceback


@pytest.mark.timeout(60)
def test_fn_may_destroy_the_process_group_itself(capsys):
    """fn ending with dist.destroy_process_group() (as torchrun scripts do): right results, no traceback."""
    assert dtlib.spawn(destroy_the_group_at_the_end, 2) == [3, 3]
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "AssertionError" not in captured.err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("timeout", [float("inf"), 1e10])
def test_infinite_or_huge_timeout_means_no_timeout(timeout):
    """timeout=inf or 1e10 waits as long as it takes (no OverflowError once the ranks run)."""
    assert dtlib.spawn(own_rank, 2, timeout=timeout, output="none") == [0, 1]


@pytest.mark.timeout(60)
def test_gloo_stays_on_the_loopback_interface(monkeypatch):
    """Ranks get GLOO_SOCKET_IFNAME set to the loopback interface, and all their sockets are on loopback."""
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    loopback = loopback_interface()
    if not loopback:
        pytest.skip("no loopback interface found")
    results = dtlib.spawn(gloo_interface_and_addresses, 2, output="none")
    assert results == [(loopback, True)] * 2


@pytest.mark.timeout(60)
def test_a_gloo_interface_the_user_chose_is_kept(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "chosen0")
    assert dtlib.spawn(read_gloo_variable, 2, init_process_group=False, output="none") == ["chosen0"] * 2


def test_a_port_to_name_is_outside_the_kernels_own_choices_and_never_repeats(monkeypatch):
    """free_port's ports are never ones the kernel hands out by itself (bind to 0, outgoing connections), so
    nobody takes one between the choice and the store's bind; a process that seeds ``random`` alike (two test
    workers, two kernels of one notebook) still gets other ports; a port that is taken is never chosen."""
    import random
    import socket

    from dtlib.launch.processes import _ephemeral_ports, free_port

    ephemeral = _ephemeral_ports()
    random.seed(0)
    first = [free_port() for _ in range(20)]
    random.seed(0)
    second = [free_port() for _ in range(20)]
    assert not set(first) & set(second) and len(set(first)) == 20
    assert not any(port in ephemeral or port == 29500 for port in first + second)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        free = next(port for port in range(20000, 30000) if port not in first + second and port != 29500)
        monkeypatch.setattr(dtlib.launch.processes._port_choice, "sample", lambda ports, k: [busy, free])
        assert free_port() == free  # the listening port was tried and passed over


@pytest.mark.timeout(120)
def test_a_dead_forkserver_is_named(tmp_path, leftovers):
    """The forkserver killed mid-job (as the out-of-memory killer does): the error says so, every
    rank is gone, and the next call starts a new server."""
    with pytest.raises(dtlib.WorkerError) as info:
        dtlib.spawn(kill_the_parent_on_rank_0, 2, args=(str(tmp_path),), start_method="forkserver",
                    init_process_group=False, output="none", timeout=60)
    message = str(info.value)
    assert "the forkserver" in message and "SIGKILL" in message and "out-of-memory" in message
    pids = [int(path.read_text()) for path in tmp_path.glob("*.pid")]
    deadline = time.monotonic() + 10  # the ranks die of PR_SET_PDEATHSIG, a moment after their parent
    while not all(exited(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(exited(pid) for pid in pids)
    assert dtlib.spawn(own_rank, 2, output="none") == [0, 1]


@pytest.mark.timeout(120)
def test_a_forkserver_dying_while_a_rank_starts_is_named(monkeypatch):
    """The forkserver killed while this process waits for a new rank's pid: the error names the
    forkserver (at the start, or as the rank's death if it was forked first), not a bare EOFError."""
    dtlib.spawn(own_rank, 1, output="none")  # the server runs
    read_signed = multiprocessing.forkserver.read_signed

    def read_after_the_server_died(fd):
        pid = forkserver_pid()
        assert pid is not None and pid != os.getpid()
        server = psutil.Process(pid)
        server.kill()
        while server.status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.01)
        return read_signed(fd)

    monkeypatch.setattr(multiprocessing.forkserver, "read_signed", read_after_the_server_died)
    with pytest.raises(dtlib.WorkerError, match="the forkserver, the process that forks every rank,"):
        dtlib.spawn(own_rank, 2, start_method="forkserver", init_process_group=False, output="none", timeout=60)
    monkeypatch.undo()
    assert dtlib.spawn(own_rank, 2, output="none") == [0, 1]


# -- arguments -------------------------------------------------------------------------------


@pytest.mark.parametrize("args", [5, "ab", {"a": 1}, None])
def test_args_that_are_not_a_sequence_are_named(no_process_start, args):
    """args=5 says that args must be a tuple or list (not "'int' object is not iterable")."""
    with pytest.raises(TypeError, match=r"^args must be a tuple or list"):
        dtlib.spawn(own_rank, 2, args=args)


@pytest.mark.parametrize("kwargs", [5, [("a", 1)], {1: "x"}])
def test_kwargs_that_are_not_a_dict_are_named(no_process_start, kwargs):
    with pytest.raises(TypeError, match=r"^kwargs must be a dict"):
        dtlib.spawn(own_rank, 2, kwargs=kwargs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [np.int64(2), np.int32(2), torch.tensor(2)], ids=["int64", "int32", "tensor"])
def test_any_integral_world_size_is_accepted(world_size):
    assert dtlib.spawn(own_rank, world_size, output="none") == [0, 1]


def test_world_size_beyond_what_this_process_can_hold_is_a_clear_error(no_process_start):
    """world_size=2**40 is a ValueError naming the limit, not an OverflowError from listen()."""
    with pytest.raises(ValueError, match=r"world_size=1099511627776 is more ranks than .* at most \d+"):
        dtlib.spawn(own_rank, 2**40)


def test_many_ranks_per_core_warn(monkeypatch, no_process_start):
    """More than 4 ranks per usable core is a RuntimeWarning (the call goes on); 4 per core is not."""
    monkeypatch.setattr(dtlib.launch.spawn, "usable_cores", lambda: 1)
    with pytest.warns(RuntimeWarning, match="world_size=5 starts 5 processes on 1 CPU core"), \
            pytest.raises(AssertionError, match="started a process"):
        dtlib.spawn(own_rank, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AssertionError, match="started a process"):
            dtlib.spawn(own_rank, 4)


def test_limit_follows_the_open_file_limit(monkeypatch):
    """The largest world_size is what the open-file limit allows at FDS_PER_RANK per rank."""
    resource = pytest.importorskip("resource")
    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 4096))
    launch = dtlib.launch.spawn
    assert launch.max_world_size() == (1024 - launch.FDS_KEPT_FREE) // launch.FDS_PER_RANK


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
@pytest.mark.timeout(60)
def test_descriptors_per_rank_stay_within_the_budget(tmp_path):
    """While 4 ranks run, this process holds at most FDS_PER_RANK descriptors per rank for them
    (the figure max_world_size divides by)."""
    dtlib.spawn(own_rank, 2, output="none")  # helpers already running
    before = open_fds()
    counted = {}

    def count_when_started():
        if all(wait_for_file(tmp_path / str(rank), 60) for rank in range(4)):
            counted["during"] = open_fds()
            for rank in range(4):
                pid = int((tmp_path / str(rank)).read_text().split()[0])
                os.kill(pid, signal.SIGKILL)

    counter = threading.Thread(target=count_when_started)
    counter.start()
    with pytest.raises(dtlib.WorkerError):
        dtlib.spawn(note_pid_and_port_then_sleep, 4, args=(str(tmp_path),), output="none", timeout=50,
                    init_process_group=False)
    counter.join()
    assert 0 < counted["during"] - before <= 4 * dtlib.launch.spawn.FDS_PER_RANK



# -- Failure 6: a process that fn started does not outlive a successful call ------------------


def start_a_sleeper(rank, world_size):
    import subprocess

    return subprocess.Popen(["sleep", "300"], start_new_session=False).pid  # stays in the rank's group


def _living(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_method", ["forkserver", "fork"])
def test_a_subprocess_fn_started_ends_with_a_successful_call(start_method):
    """A process that fn started in its rank's group ends with the call, whether the rank is a child of the
    forkserver or (fork) of this process, as a spawn rank is; how the rank started (spawn: a fresh
    interpreter, 4 s a rank) does not change how its group is ended."""
    pids = dtlib.spawn(start_a_sleeper, 2, start_method=start_method, output="none", timeout=60)
    deadline = time.monotonic() + 30  # hang guard only: the kill is immediate, reaping by init may lag
    while any(map(_living, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(_living, pids)), f"processes that fn started outlived the call: {pids}"


def start_an_escaper_and_a_waited_child(rank, world_size):
    import multiprocessing
    import subprocess
    import time

    escaper = subprocess.Popen(["sleep", "300"], start_new_session=True)  # a session of its own
    waited = multiprocessing.get_context("fork").Process(target=time.sleep, args=(300,), daemon=False)
    waited.start()  # not a daemon: Python waits for it before the rank may exit
    return escaper.pid, waited.pid


@pytest.mark.timeout(120)
def test_processes_that_escape_the_ranks_group_or_hold_its_exit_end_with_the_call_and_are_named(capfd):
    began = time.monotonic()
    pids = dtlib.spawn(start_an_escaper_and_a_waited_child, 2, timeout=60)
    took = time.monotonic() - began
    deadline = time.monotonic() + 30  # hang guard only: the kill is immediate, reaping by init may lag
    flat = [pid for pair in pids for pid in pair]
    while any(map(_living, flat)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(_living, flat)), f"processes that fn started outlived the call: {pids}"
    err = capfd.readouterr().err
    for rank in range(2):
        assert f"dtlib: rank {rank}'s function returned and left 2 process(es) running" in err, err
    assert "in a process group of its own" in err and "a multiprocessing child that is not a daemon" in err
    assert took < 60, took  # hang guard: before, each rank stalled in its exit until dtlib's grace ran out


def start_escapers_then(rank, world_size, folder, then):
    """A process in a session of its own and a double-forked daemon, their pids written to ``folder``; then the
    rank returns, raises or hangs."""
    import os
    import subprocess
    import time

    escaper = subprocess.Popen(["sleep", "300"], start_new_session=True)
    subprocess.run(["sh", "-c", f"(setsid sleep 300 & echo $! > {folder}/daemon{rank}) &"], check=True)
    while not os.path.exists(f"{folder}/daemon{rank}") or not open(f"{folder}/daemon{rank}").read().strip():
        time.sleep(0.01)
    with open(f"{folder}/escaper{rank}", "w") as file:
        file.write(str(escaper.pid))
    if then == "raise":
        raise RuntimeError("boom")
    if then == "hang":
        time.sleep(300)
    return rank


def _escapers(folder) -> list[int]:
    return [int(path.read_text()) for path in sorted(folder.iterdir())]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("then", ["return", "raise", "hang"])
def test_new_sessions_and_double_forked_daemons_end_with_the_call_whatever_its_outcome(tmp_path, clock_starts_when,
                                                                                        then):
    """A rank's process in a session of its own outlived a timeout, and a double-forked daemon every path: each
    rank now reaps its orphans (PR_SET_CHILD_SUBREAPER), and the call ends the rank's whole tree.

    "hang": the timeout's clock starts once both ranks have written their escapers' pids, so 1 s is enough
    however slowly they started."""
    folder = tmp_path / "pids"
    folder.mkdir()
    if then == "hang":
        clock_starts_when(folder / "escaper0", folder / "escaper1")
    outcome = contextlib.nullcontext() if then == "return" else pytest.raises(dtlib.WorkerError)
    with outcome:
        dtlib.spawn(start_escapers_then, 2, args=(str(folder), then), timeout=1 if then == "hang" else 60,
                    output="none")
    pids = _escapers(folder)
    assert len(pids) == 4
    deadline = time.monotonic() + 30  # hang guard only: the kill is immediate, reaping by init may lag
    while any(map(_living, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(_living, pids)), f"processes that fn started outlived the call ({then}): {pids}"


@pytest.mark.timeout(120)
def test_live_ranks_end_double_forked_daemons_at_close(tmp_path):
    folder = tmp_path / "pids"
    folder.mkdir()
    with dtlib.LiveRanks(2, timeout=60) as live:
        live.push(start_escapers_then=start_escapers_then)
        live.run(f"start_escapers_then(rank, world_size, {str(folder)!r}, 'return')")
    pids = _escapers(folder)
    deadline = time.monotonic() + 30
    while any(map(_living, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(_living, pids)), f"processes that live ranks started outlived close(): {pids}"


def start_one_after_returning(rank, world_size, folder):
    """Rank 0 returns, then a timer it left starts a process in a session of its own; rank 1 returns only once
    that process runs, so it starts after fn returned and before the job ends."""
    import os
    import subprocess
    import threading
    import time

    if rank == 0:
        def start_late():
            late = subprocess.Popen(["sleep", "300"], start_new_session=True)
            with open(f"{folder}/late.tmp", "w") as file:
                file.write(str(late.pid))
            os.rename(f"{folder}/late.tmp", f"{folder}/late")

        threading.Timer(0.2, start_late).start()
        return rank
    while not os.path.exists(f"{folder}/late"):
        time.sleep(0.01)
    return rank


@pytest.mark.timeout(120)
def test_a_process_started_after_fn_returned_ends_with_the_call(tmp_path):
    """A process that a timer started after fn returned outlived the call: the rank's own sweep had run, and the
    rank then exited, handing the process to init. The rank now stops itself and the call ends its whole tree."""
    dtlib.spawn(start_one_after_returning, 2, args=(str(tmp_path),), timeout=60, output="none")
    late = int((tmp_path / "late").read_text())
    deadline = time.monotonic() + 30  # hang guard only
    while _living(late) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _living(late), f"a process started after fn returned outlived the call: {late}"


def start_one_later(folder, delay):
    """Leave a timer that starts a process in a session of its own ``delay`` seconds from now, after the cell
    that called this returned, and writes its pid to ``folder/late``."""
    import os
    import subprocess
    import threading

    def start_late():
        late = subprocess.Popen(["sleep", "300"], start_new_session=True)
        with open(f"{folder}/late.tmp", "w") as file:
            file.write(str(late.pid))
        os.rename(f"{folder}/late.tmp", f"{folder}/late")

    threading.Timer(delay, start_late).start()


@pytest.mark.timeout(120)
def test_a_process_a_timer_started_between_cells_ends_when_live_ranks_close(tmp_path):
    """The live ranks' form of the test above: a cell leaves a timer, the cell returns, the timer starts a process
    in a session of its own while the ranks sit idle, and ``close()`` must end it with the ranks."""
    with dtlib.LiveRanks(2, timeout=60) as live:
        live.push(start_one_later=start_one_later)
        live.run(f"start_one_later({str(tmp_path)!r}, 0.3) if rank == 0 else None")
        deadline = time.monotonic() + 30  # hang guard only: the process is started before the ranks close
        while not (tmp_path / "late").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        late = int((tmp_path / "late").read_text())
        assert _living(late)
    deadline = time.monotonic() + 30  # hang guard only
    while _living(late) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _living(late), f"a process a timer started between cells outlived close(): {late}"


def leave_a_thread_that_never_ends(rank, world_size):
    import threading

    threading.Thread(target=threading.Event().wait, name="forever", daemon=False).start()
    return rank


@pytest.mark.timeout(120)
def test_a_thread_that_never_ends_is_named_and_holds_nothing_up(monkeypatch, capfd):
    """A thread that is not a daemon held the rank's exit (Python joins such threads) until the call's grace ran
    out: 10 s per call, silently. It is named now, and the rank ends without waiting for it: with the grace
    raised past the test's own timeout, only that can let the call return."""
    monkeypatch.setattr(dtlib.launch.spawn, "FINISH_GRACE_S", 600.0)
    assert dtlib.spawn(leave_a_thread_that_never_ends, 2, timeout=60) == [0, 1]
    err = capfd.readouterr().err
    for rank in range(2):
        assert f"rank {rank}'s function returned and left 1 thread(s) running that are not daemons: forever" in err


@pytest.mark.timeout(120)
def test_a_killed_kernels_forkserver_folder_goes_at_the_next_start():
    """multiprocessing removes its pymp-* folder at a normal exit only: a kernel killed with SIGKILL left one for
    good. dtlib names the folder after the process and removes those of processes that no longer run."""
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="dt", dir="/tmp"))  # short: a forkserver's socket path has a limit
    env = {**os.environ, "TMPDIR": str(folder)}
    code = ("import dtlib, os; dtlib.spawn(lambda r, w: r, 1, timeout=60{method}); print(os.getpid(), flush=True); "
            "{end}")
    try:
        # the killed kernel ran the default forkserver, whose socket is in the folder it leaves
        killed = subprocess.run([sys.executable, "-c", code.format(method="", end="os.kill(os.getpid(), 9)")],
                                env=env, capture_output=True, text=True, timeout=90)
        left = [p.name for p in folder.iterdir() if p.name.startswith("dtlib-pymp-")]
        assert left and left[0].startswith(f"dtlib-pymp-{killed.stdout.split()[0]}-"), (left, killed.stderr[-500:])
        # any start makes the folder (own_temp_dir, for the ranks' store) and clears the dead ones: fork spares
        # this second process a forkserver's own start (importing torch again, 4 s)
        clean = subprocess.run([sys.executable, "-c", code.format(method=", start_method='fork'", end="")], env=env,
                               capture_output=True, text=True, timeout=90)
        assert clean.returncode == 0, clean.stderr[-500:]
        assert not [p.name for p in folder.iterdir() if p.name.startswith(("dtlib-pymp-", "pymp-"))]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# -- Temporary folders whose names a URL or a socket cannot hold -------------------------------------------------
SUM_IN_A_CHILD = ("import dtlib, torch, torch.distributed as dist, os\n"
                  "def total(rank, world_size):\n"
                  "    x = torch.tensor([float(rank + 1)])\n"
                  "    dist.all_reduce(x)\n"
                  "    return x.item()\n"
                  "print(dtlib.spawn(total, 2, timeout=60, output='none'))\n")


def total_of_ranks(rank, world_size):
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    return x.item()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["with#hash", "with?query", "with\nnewline"])
def test_a_store_folder_of_any_name_keeps_the_store_inside_it(tmp_path, monkeypatch, name):
    """``file://{path}`` was built unquoted: with a ``#`` in TMPDIR the store landed in its parent, outside the
    private folder (two jobs at once shared it, and one hung); a ``?`` failed every spawn, a newline hung."""
    folder = tmp_path / name
    folder.mkdir()
    monkeypatch.setattr(dtlib.launch.job, "own_temp_dir", lambda: str(folder))
    seen = []
    real_mkdtemp = dtlib.launch.job.tempfile.mkdtemp

    def noted_mkdtemp(*args, **kwargs):
        seen.append(real_mkdtemp(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(dtlib.launch.job.tempfile, "mkdtemp", noted_mkdtemp)
    assert dtlib.spawn(total_of_ranks, 2, timeout=60, output="none") == [3.0, 3.0]
    stores = [Path(path) for path in seen if Path(path).name.startswith("store-")]
    assert stores and all(path.parent == folder for path in stores)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name], "something landed beside the folder, not inside"


@pytest.mark.timeout(240)
def test_a_temporary_folder_too_long_for_a_socket_still_serves_the_forkserver(tmp_path):
    """A TMPDIR of 66 characters or more failed every spawn with a bare "AF_UNIX path too long"."""
    folder = tmp_path / ("long" + "-" * 70)
    folder.mkdir()
    child = subprocess.run([sys.executable, "-c", SUM_IN_A_CHILD], env={**os.environ, "TMPDIR": str(folder)},
                           capture_output=True, text=True, timeout=180)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.strip().splitlines()[-1] == "[3.0, 3.0]"


def test_the_temporary_base_is_tmpdir_unless_too_long_for_a_socket(monkeypatch):
    from dtlib.launch import processes

    monkeypatch.setattr(processes.tempfile, "gettempdir", lambda: "/tmp/short")
    assert processes.temp_base() == "/tmp/short"
    monkeypatch.setattr(processes.tempfile, "gettempdir", lambda: "/tmp/" + "x" * 80)
    assert processes.temp_base() == "/tmp"
    monkeypatch.setattr(processes.os.path, "isdir", lambda path: False)
    with pytest.raises(OSError, match="set TMPDIR to a folder of at most 61 characters"):
        processes.temp_base()
