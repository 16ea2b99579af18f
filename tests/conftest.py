"""Shared fixtures: check that a test left no processes or shared-memory files behind; the order of the files."""

from __future__ import annotations

import json
import multiprocessing.forkserver
import multiprocessing.process
import multiprocessing.resource_tracker
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

import psutil
import pytest

from dtlib.launch.processes import own_temp_dir

SHM = "/dev/shm"


def _multiprocessing_helpers() -> set[int]:
    """Pids of the long-lived helpers multiprocessing starts once per process (not leftovers)."""
    pids = {
        getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None),
        getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None),
    }
    return {pid for pid in pids if pid is not None}


def _children() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)} - _multiprocessing_helpers()


def _shm_entries() -> set[str]:
    return set(os.listdir(SHM)) if os.path.isdir(SHM) else set()


def _store_folders() -> set[str]:
    """The private stores' folders (dtlib.launch.job.Job.private_store) in this process's temporary folder."""
    return {name for name in os.listdir(own_temp_dir()) if name.startswith("store-")}


def gone(pid: int) -> bool:
    """True when no process with ``pid`` exists any more (a zombie still exists)."""
    return not psutil.pid_exists(pid)


class Leftovers:
    """Snapshot of this process's children and of /dev/shm, taken when the test starts."""

    def __init__(self) -> None:
        self.children = _children()
        self.shm = _shm_entries()
        self.stores = _store_folders()

    def assert_clean(self, worker_pids: Iterable[int] = ()) -> None:
        """No new child process (besides multiprocessing's helpers), no worker alive, no new /dev/shm file."""
        new_children = _children() - self.children
        assert not new_children, f"child processes left behind: {sorted(new_children)}"
        alive = [pid for pid in worker_pids if not gone(pid)]
        assert not alive, f"worker processes still exist: {alive}"
        new_shm = _shm_entries() - self.shm
        assert not new_shm, f"new entries in {SHM}: {sorted(new_shm)}"
        new_stores = _store_folders() - self.stores
        assert not new_stores, f"private store folders left behind: {sorted(new_stores)}"


@pytest.fixture(autouse=True)
def _gpu_tests_choose_their_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test marked ``gpu`` gets the machine's own backend (NCCL with a GPU per rank); the rest keep gloo."""
    if request.node.get_closest_marker("gpu") is not None:
        monkeypatch.delenv("DTLIB_BACKEND", raising=False)


@pytest.fixture
def leftovers() -> Leftovers:
    """Snapshot taken before the test; call ``leftovers.assert_clean(pids)`` after the launch."""
    return Leftovers()



_SESSION_STARTED = time.time()
NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def _time_budget_s(notebook: Path) -> float:
    """A notebook's Run All budget (metadata.dtlib.time_budget_s): a rough measure of how long it runs."""
    try:
        return float(json.loads(notebook.read_text())["metadata"]["dtlib"]["time_budget_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0


# The slowest test files, in seconds: what `pytest -n 2 --dist loadfile --durations=0` summed per file on the
# 2-core machine (a busy fresh clone at 504344d, beside the browser tests; scripts/durations.py sums them). Only
# their order matters; a file not named here is short.
SLOW_FILES_S = {"test_torchrun.py": 212, "test_sim.py": 159, "test_rank_functions.py": 106, "test_training.py": 92,
                "test_tensor_parallel.py": 90, "test_launch.py": 70, "test_launch_abuse.py": 55, "test_live.py": 55,
                "test_skeleton.py": 47, "test_experts.py": 45, "test_project.py": 44, "test_ring_phases.py": 31,
                "test_fsdp.py": 30, "test_doctor.py": 28, "test_stepping.py": 28, "test_cluster.py": 27,
                "test_model_answers_at_more_sizes.py": 25, "test_ddp.py": 24, "test_live_kernel.py": 23,
                "test_fsdp_checkpoint.py": 21}


BROWSER_TESTS = Path(__file__).resolve().parent / "browser"


def _browser_tests_collected(config: pytest.Config) -> bool:
    """Whether this run collects the browser tests: one of its paths holds tests/browser (``pytest tests``, say)."""
    paths = [Path(arg.split("::")[0]).resolve() for arg in config.args] or [Path(config.rootpath)]
    return any(BROWSER_TESTS == path or BROWSER_TESTS.is_relative_to(path) for path in paths)


class NotebooksRunOnce:
    """Each notebook runs once: when the browser tests will run it in JupyterLab, nbval leaves it out.

    The browser tests then check what nbval would (tests/browser/nbval_compare.py). Without a Chromium, or in
    a run that leaves the browser tests out (``pytest notebooks/02_collectives.ipynb``), nbval runs them all.
    A plugin rather than a hook of this file: a conftest's collection hooks reach only its own folder.
    """

    @staticmethod
    def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
        if collection_path.suffix != ".ipynb" or not collection_path.is_relative_to(NOTEBOOKS):
            return None
        from browser import status

        if _browser_tests_collected(config) and status.why_skipped() is None:
            return True
        return None


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(NotebooksRunOnce(), "dtlib-notebooks-run-once")
    # The suite is written for gloo on the CPU: on a GPU machine, backend="auto" would pick NCCL for tests whose
    # rank functions build CPU tensors. DTLIB_BACKEND keeps them on gloo (tests marked gpu lift it, below);
    # the GPU check (make gpu-check) sets DTLIB_GPU_SUITE so that the notebooks take the machine's own backend.
    if not os.environ.get("DTLIB_GPU_SUITE"):
        os.environ.setdefault("DTLIB_BACKEND", "gloo")
    # A shell starts a background job (`make test &`, `nohup`) with SIGINT ignored, and Python keeps it so in
    # pytest and in every process it starts. The interrupt tests press Ctrl-C as a learner does in a kernel,
    # which always handles SIGINT: give this process Python's own handler back.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _expected_s(path: Path) -> float:
    """How long a file's tests run, roughly: the browser tests run every notebook, nbval runs one."""
    if path.suffix == ".ipynb":
        return _time_budget_s(path)
    if path.name == "test_notebooks_in_lab.py":
        return sum(map(_time_budget_s, NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")))
    return SLOW_FILES_S.get(path.name, 0.0)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest files first, each file's tests kept together and in order.

    ``make test`` hands whole files to two pytest-xdist workers (``--dist loadfile --no-loadscope-reorder``),
    in this order. Started last, the browser tests (every notebook run in JupyterLab, one after another)
    would run alone at the end while the other worker idles; started first, they run beside everything else.
    """
    expected = {path: _expected_s(path) for path in {Path(str(item.path)) for item in items}}
    items.sort(key=lambda item: -expected[Path(str(item.path))])  # stable: files stay in their order


#: Seconds of test phases (setup, call, teardown) and the files run, per pytest-xdist worker ("main" without one).
_PER_WORKER: dict[str, list] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add each phase's duration to its worker's sum: under pytest-xdist the reports reach this process with the
    worker that ran them (``report.node``)."""
    node = getattr(report, "node", None)
    worker = node.gateway.id if node is not None else "main"
    seconds, files = _PER_WORKER.setdefault(worker, [0.0, set()])
    _PER_WORKER[worker][0] = seconds + report.duration
    files.add(report.location[0])


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say where each worker's time went, then why the browser tests were skipped, or show this session's
    notebook runs in JupyterLab.

    Here rather than in tests/browser/conftest.py: under pytest-xdist only this conftest reaches the
    process that prints the summary."""
    from browser import status

    if _PER_WORKER:
        workers = sorted(_PER_WORKER.items())
        terminalreporter.write_line("time per worker (setup, call and teardown summed): " + ", ".join(
            f"{worker} {seconds:.0f} s in {len(files)} files" for worker, (seconds, files) in workers))
    reason = status.why_skipped()
    if reason:
        terminalreporter.write_line(f"browser tests skipped: {reason}", yellow=True, bold=True)
        return
    table = status.report(since=_SESSION_STARTED)
    if not table.startswith("no "):
        terminalreporter.write_sep("-", "notebooks run in JupyterLab (make browser-screenshots shows this again)")
        terminalreporter.write_line(table)


# What opens the rendezvous port (dtlib.compat), for tests that must show nothing started.
STORE_FACTORIES = ("loopback_listener", "store_on")


@pytest.fixture
def no_process_start(monkeypatch):
    """Make starting a rank or opening the rendezvous store fail the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("dtlib.spawn started a process or a store before rejecting its input")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    import dtlib.compat

    for name in STORE_FACTORIES:
        if hasattr(dtlib.compat, name):
            monkeypatch.setattr(dtlib.compat, name, refuse)
