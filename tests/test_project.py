"""The repository itself: set-up files agree, and every notebook is in shape."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
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


def test_readme_is_a_newcomer_page_and_every_local_link_resolves():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.split()) <= 1500, "the README is the newcomer's page: maintainer material goes to docs/"
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)|src=\"([^\"]+)\"", page.read_text()):
            path = next(t for t in target if t)
            assert (page.parent / path).exists(), f"{page.relative_to(ROOT)} links to missing {path}"


def _dtlib_imports() -> dict[str, set[str]]:
    """Each dtlib module and the dtlib modules it imports anywhere in it (inside functions too)."""
    import ast

    modules = {".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): path
               for path in (ROOT / "dtlib").rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dtlib"):
                graph[name] |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                                for a in node.names}
            elif isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name.startswith("dtlib")}
        graph[name] = {target for target in graph[name] if target in modules and target != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle in ``graph`` as a path that returns to its start, or None."""
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return path[path.index(name):] + [name]
        if name in done:
            return None
        for target in sorted(graph[name]):
            if found := visit(target, path + [name]):
                return found
        done.add(name)
        return None

    return next((found for name in sorted(graph) if (found := visit(name, []))), None)


def test_dtlib_modules_import_each_other_without_a_cycle():
    graph = _dtlib_imports()
    assert "dtlib.guide" in graph["dtlib.plots.sharding"]  # imports inside functions count too
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert not (found := _cycle(graph)), "import cycle: " + " -> ".join(found or [])


def test_make_lab_allows_root_and_passes_the_users_options():
    """Jupyter refuses root without --allow-root; containers and cloud notebooks often run as root."""
    dry_run = subprocess.run(["make", "-n", "--no-print-directory", "lab", 'LAB_ARGS=--port 9999 --no-browser'],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout
    (command,) = [line for line in dry_run.splitlines() if "jupyter lab" in line]
    assert command.endswith("--port 9999 --no-browser")
    assert ("--allow-root" in command) == (os.geteuid() == 0)


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
