"""The browser tests' output check agrees with nbval itself, cell by cell.

When the browser tests run the notebooks, nbval leaves them out (tests/conftest.py), so the browser tests'
check must fail exactly the cells nbval would fail. Oracle: nbval run by pytest on the same small notebook.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from browser.nbval_compare import checked_output_problems, checks_output
from nbclient import NotebookClient

STREAM = nbformat.v4.new_output


def _cell(source: str, stored: list, tags: list[str] | None = None) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell(source, outputs=stored, execution_count=1)
    if tags:
        cell.metadata["tags"] = tags
    return cell


def _notebook() -> nbformat.NotebookNode:
    """Cells whose stored outputs nbval must accept or refuse; the comment in each says which."""
    out = lambda text: [STREAM("stream", name="stdout", text=text)]  # noqa: E731
    value = lambda text: [STREAM("execute_result", data={"text/plain": text}, execution_count=1)]  # noqa: E731
    return nbformat.v4.new_notebook(cells=[
        _cell("# NBVAL_CHECK_OUTPUT\nprint('same')", out("same\n")),                                # accepted
        _cell("# NBVAL_CHECK_OUTPUT\nprint('one')", out("two\n")),                                  # refused
        _cell("print('unchecked')", out("something else\n")),                                        # not checked
        _cell("1 + 1", value("3"), tags=["nbval-check-output"]),                                    # refused (tag)
        _cell("# NBVAL_CHECK_OUTPUT\nprint('a', end='')\nprint('b')", out("a")+out("b\n")),          # accepted
        _cell("# NBVAL_CHECK_OUTPUT\nprint('10%\\r100%')", out("100%\n")),                         # accepted (\r)
        _cell("# NBVAL_IGNORE_OUTPUT\n2", value("9"), tags=["nbval-check-output"]),                 # comment wins
        _cell("#NBVAL_CHECK_OUTPUT\nimport sys; print('x', file=sys.stderr)", out("x\n")),          # refused (stream)
    ], metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})


@pytest.mark.timeout(180)
def test_the_browser_check_refuses_exactly_the_cells_nbval_refuses(tmp_path: Path):
    stored = _notebook()
    path = tmp_path / "probe.ipynb"
    nbformat.write(stored, path)
    nbval = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly",
                            "--nbval-lax", "--nbval-current-env", "-q", "-o", "addopts=", "--rootdir", str(tmp_path),
                            str(path)], capture_output=True, text=True, timeout=150, cwd=tmp_path)
    refused_by_nbval = sorted(int(n) for n in re.findall(r"FAILED \S+::Cell (\d+)", nbval.stdout))
    assert refused_by_nbval == [1, 3, 7], nbval.stdout[-3000:]  # the oracle behaves as the comments say

    ran = nbformat.read(path, as_version=4)
    NotebookClient(ran, timeout=60, kernel_name="python3").execute()
    problems = checked_output_problems(stored, ran)
    refused_here = [int(re.match(r"cell (\d+):", p).group(1)) for p in problems]
    assert refused_here == refused_by_nbval, problems
    assert "two" in problems[0] and "one" in problems[0]  # nbval's own report of what differs


def test_a_cell_is_checked_by_its_comment_or_its_tag_and_a_comment_wins():
    cells = _notebook().cells
    assert [checks_output(cell) for cell in cells] == [True, True, False, True, True, True, False, True]
    assert not checks_output(nbformat.v4.new_markdown_cell("# NBVAL_CHECK_OUTPUT"))
