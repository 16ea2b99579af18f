"""Code shipped to the ranks keeps its filename and its in-memory source, whatever cloudpickle does.

cloudpickle 3.1.3 ships every code object with ``co_filename = "<dynamic-code>"``; older releases
kept the real one. A notebook cell's function lives in a file that exists only in ``linecache``, so
both the filename and those lines must travel for a rank's traceback to show the cell's source.
The oracle is Python's own traceback of the same function run here, in this process.
"""

from __future__ import annotations

import linecache
import os
import re
import subprocess
import sys
import textwrap
import threading
import tomllib
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path

import cloudpickle
import pytest

import dtlib
from dtlib.launch import pickling

REPO = Path(__file__).resolve().parents[2]
CELL = '''\
def cell_fn(rank, world_size):
    def inner():
        return [x + 1.0 for x in [rank]]  # a nested function and a comprehension
    if rank == 1:
        raise LookupError("cell " + "marker")
    return inner()
'''


@pytest.fixture
def cell() -> Iterator[tuple[str, dict]]:
    """A function whose source lives only in linecache, as a notebook cell's does: (filename, namespace)."""
    filename = f"/tmp/ipykernel_fake_{uuid.uuid4().hex}/123.py"
    linecache.cache[filename] = (len(CELL), None, CELL.splitlines(True), filename)
    namespace: dict = {"__name__": "__main__"}
    exec(compile(CELL, filename, "exec"), namespace)
    try:
        yield filename, namespace
    finally:
        linecache.cache.pop(filename, None)


def code_filenames(code) -> set[str]:
    """The filename of ``code`` and of every code object nested in it."""
    nested = [c for c in code.co_consts if isinstance(c, type(code))]
    return {code.co_filename}.union(*(code_filenames(c) for c in nested))


def test_every_code_object_keeps_its_filename_and_only_in_memory_sources_travel(cell):
    filename, namespace = cell
    payload = pickling.dumps((namespace["cell_fn"], (), {}), parts=[], refusal="cannot send {part}")
    fn, _, _ = cloudpickle.loads(payload.data)
    assert code_filenames(fn.__code__) == {filename}  # the nested function and comprehension too
    assert payload.sources == {filename: CELL.splitlines(True)}
    # a function from a file on disk travels by reference or by value, but its source never does
    assert pickling.dumps(textwrap.dedent, parts=[], refusal="{part}").sources == {}


def test_the_rank_raises_the_same_traceback_lines_as_this_process(cell):
    """Oracle: the traceback Python prints for the same call here, in the kernel."""
    filename, namespace = cell
    with pytest.raises(LookupError) as here:
        namespace["cell_fn"](1, 2)
    local = traceback.format_exception(here.value)[-2:]  # the cell's frame and the message
    with pytest.raises(dtlib.WorkerError) as remote:
        dtlib.spawn(namespace["cell_fn"], world_size=2, output="none", timeout=120)
    [failure] = remote.value.failures
    assert failure.traceback.endswith("".join(local))
    assert f'File "{filename}", line 5, in cell_fn' in failure.traceback
    assert 'raise LookupError("cell " + "marker")' in failure.traceback


def test_a_refusal_names_the_part_that_cannot_be_pickled():
    lock = threading.Lock()
    with pytest.raises(TypeError, match=r"cannot send args\[1\] \(lock\) to the ranks: it cannot be pickled"):
        dtlib.spawn(lambda rank, world_size, *a: rank, world_size=2, args=(1, lock))
    assert not pickling.picklable(lock) and pickling.picklable(lambda: 1)


@pytest.mark.timeout(300)
def test_a_pushed_function_shows_its_cell_source_when_it_raises_on_a_live_rank(cell):
    filename, namespace = cell
    with dtlib.LiveRanks(2, backend="gloo", timeout=60) as ranks:
        ranks.push(cell_fn=namespace["cell_fn"])
        with pytest.raises(dtlib.WorkerError) as caught:
            ranks.run("cell_fn(rank, world_size)")
    [failure] = caught.value.failures
    assert failure.rank == 1
    assert f'File "{filename}", line 5, in cell_fn' in failure.traceback
    assert 'raise LookupError("cell " + "marker")' in failure.traceback


def oldest_allowed(package: str) -> str:
    """The lower bound pyproject.toml gives ``package`` (``cloudpickle>=2.2`` -> ``2.2``)."""
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    [bound] = [m.group(1) for d in dependencies if (m := re.fullmatch(rf"{package}>=([\d.]+)", d))]
    return bound


@pytest.mark.timeout(300)
def test_a_rank_traceback_shows_the_cell_source_with_the_oldest_cloudpickle_allowed(tmp_path):
    """The same spawn, in a fresh Python that imports the oldest cloudpickle pyproject.toml allows."""
    version = oldest_allowed("cloudpickle")
    target = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
                          "--target", str(target), f"cloudpickle=={version}"], capture_output=True, text=True)
    if pip.returncode != 0:
        pytest.skip(f"cannot install cloudpickle=={version} (offline?): {pip.stderr.strip()[-300:]}")
    script = textwrap.dedent(f'''
        import linecache, cloudpickle, dtlib
        assert cloudpickle.__version__ == {version!r} or cloudpickle.__version__.startswith({version + "."!r}), \\
            cloudpickle.__version__
        filename = "/tmp/ipykernel_oldest/1.py"
        source = {CELL!r}
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        namespace = {{"__name__": "__main__"}}
        exec(compile(source, filename, "exec"), namespace)
        try:
            dtlib.spawn(namespace["cell_fn"], world_size=2, output="none", timeout=120)
        except dtlib.WorkerError as err:
            print(err.failures[0].traceback)
    ''')
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240,
                         env={**os.environ, "PYTHONPATH": str(target)})
    assert run.returncode == 0, run.stderr
    assert 'File "/tmp/ipykernel_oldest/1.py", line 5, in cell_fn' in run.stdout
    assert 'raise LookupError("cell " + "marker")' in run.stdout
