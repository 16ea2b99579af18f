"""The repository itself: set-up files agree, and every notebook is in shape."""

from __future__ import annotations

import json
import re
import statistics
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CONDA_NAMES = {"torch": "pytorch", "playwright": "playwright-python"}  # pip name -> conda-forge name where they differ


def _requirement(spec: str) -> tuple[str, str]:
    match = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*(.*?)\s*", spec)
    assert match, spec
    return match.group(1).lower(), match.group(2).replace(" ", "")


def test_environment_yml_names_the_same_packages_and_bounds_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pip_specs = project["dependencies"] + project["optional-dependencies"]["dev"]
    expected = {CONDA_NAMES.get(name, name): bound for name, bound in map(_requirement, pip_specs)}
    conda = yaml.safe_load((ROOT / "environment.yml").read_text())
    listed = dict(_requirement(d) for d in conda["dependencies"] if isinstance(d, str))
    listed.pop("pip", None)
    assert listed.pop("python") == project["requires-python"]
    assert listed == expected


def test_constraints_pin_the_cpu_torch_that_set_up_installs():
    pins = [line for line in (ROOT / "constraints.txt").read_text().splitlines() if line and line[0] != "#"]
    assert pins == ["torch==2.13.0"]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make lab" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    targets = re.findall(r"^([a-z]+):", (ROOT / "Makefile").read_text(), flags=re.M)
    assert {"lab", "test", "notebooks", "setup"} <= set(targets)


def test_the_first_notebooks_exist():
    names = [path.name for path in NOTEBOOKS]
    assert names[:2] == ["00_setup_check.ipynb", "01_processes_and_ranks.ipynb"]
    assert all(re.fullmatch(r"\d\d_[a-z0-9_]+\.ipynb", name) for name in names)


def _code_cells(path: Path) -> list[dict]:
    return [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def _text(cell: dict) -> str:
    return "".join(cell["source"])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_outputs_are_stored_in_order(path):
    counts = [cell["execution_count"] for cell in _code_cells(path)]
    assert None not in counts, "run `make notebooks` to store every output"
    assert counts == list(range(1, len(counts) + 1))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_outputs_hold_no_errors_or_warnings(path):
    for cell in _code_cells(path):
        for output in cell["outputs"]:
            if "NBVAL_RAISES_EXCEPTION" not in _text(cell):
                assert output["output_type"] != "error", _text(cell)
            text = "".join(output.get("text", "")) + "".join(output.get("data", {}).get("text/plain", ""))
            assert not re.search(r"(Deprecation|Future|User)Warning", text), text


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_has_the_course_shape(path):
    cells = json.loads(path.read_text())["cells"]
    markdown = "\n".join(_text(c) for c in cells if c["cell_type"] == "markdown")
    code = [_text(c) for c in _code_cells(path)]
    for heading in ("Learning goals", "Measure it on your machine", "Exercise", "Summary"):
        assert heading in markdown, f"{path.name} lacks a '{heading}' section"
    assert any("dtlib.checks." in source for source in code), "the exercise needs a dtlib.checks function"
    images = [o for c in _code_cells(path) for o in c["outputs"] if "image/png" in o.get("data", {})]
    assert images, "every notebook shows at least one figure"
    assert "sys.path" not in "\n".join(code), "import dtlib as installed, never via sys.path"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_cells_are_short(path):
    """One idea per cell; a training function the learner reads and edits may take about 30 lines."""
    lengths = [len([line for line in _text(c).splitlines() if line.strip()]) for c in _code_cells(path)]
    assert max(lengths) <= 30
    assert statistics.median(lengths) <= 6


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_solutions_are_out_of_sight(path):
    """A solution's code is collapsed (JupyterLab's source_hidden), and the line above says how to open it."""
    cells = json.loads(path.read_text())["cells"]
    solutions = [(cell, after) for cell, after in zip(cells, cells[1:], strict=False)
                 if cell["cell_type"] == "markdown" and _text(cell).startswith("**Solution")]
    assert solutions, f"{path.name} has no solution"
    for note, solution in solutions:
        assert "click the collapsed cell" in _text(note), _text(note)
        assert solution["cell_type"] == "code" and solution["metadata"].get("jupyter", {}).get("source_hidden"), \
            f"{path.name}: the solution under {_text(note)[:40]!r} is visible"
