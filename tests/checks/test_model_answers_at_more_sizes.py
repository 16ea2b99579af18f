"""Every rank-function checker judges its notebook's own model answer right at the larger sizes it accepts.

The notebooks call each checker at its default world size (and the one after it, which every check also runs):
2 and 3 for most. A checker that crashes or misjudges at a size nobody ran (09's once raised IndexError at 4
ranks on a right answer) would ship. Here each notebook's solution cell runs as the learner would run it (after
the definitions of the cells above it: imports, functions, classes), with its checker call caught, and the real
checker judges the caught answer at a larger ``world_size``: 4 (so 4 and 5 ranks), or the largest a checker
accepts (09's MLP splits its 12 hidden features over 3 and 4 ranks, not 5). Oracle: the solution is right by
construction, and the notebook's stored output says so at the default size.
"""

from __future__ import annotations

import ast
import inspect
import json
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import dtlib
from dtlib import checks
from dtlib.checks import skeleton

NOTEBOOKS = Path(__file__).parents[2] / "notebooks"
#: Every rank-function checker, by the notebook that asks for it: (checker, size to judge at). The principles' tests
#: (``test_principles_in_every_checker.py``) run over this table too, and the last test below holds it whole.
LARGER = {"01_processes_and_ranks": ("sum_of_ranks", 4), "02_collectives": ("average_of_ranks", 4),
          "03_ring_allreduce": ("ring_phase", 4), "04_ddp": ("gradient_hook", 4),
          "05_fsdp": ("fsdp_wrap", 4), "08_pitfalls": ("fixed_barrier", 4),
          "09_tensor_parallel": ("tensor_parallel_mlp", 3), "13_expert_parallel": ("expert_parallel_moe", 4)}


def _definitions(source: str) -> str:
    """A code cell's imports, functions and classes, without what it runs (a cell with magics: nothing)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ""
    kept = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)
    return "\n".join(ast.get_source_segment(source, node) or "" for node in tree.body if isinstance(node, kept))


def _solution(notebook: str, checker: str) -> tuple[str, str]:
    """The definitions of every code cell above the solution cell, and the solution cell."""
    cells = json.loads((NOTEBOOKS / f"{notebook}.ipynb").read_text())["cells"]
    for index, (note, cell) in enumerate(zip(cells, cells[1:], strict=False)):
        text = "".join(cell["source"])
        if "".join(note["source"]).startswith("**Solution") and f"dtlib.checks.{checker}(" in text:
            above = [_definitions("".join(c["source"])) for c in cells[:index] if c["cell_type"] == "code"]
            return "\n".join(above), text
    raise LookupError(f"{notebook} has no solution cell calling dtlib.checks.{checker}")


def _caught_answer(notebook: str, checker: str):
    """The solution cell run in a namespace of its own, as a cell's functions are (module ``__main__``, shipped to
    the ranks by value), its ``dtlib.checks.<checker>(...)`` call caught instead of run: (answer, keywords)."""
    caught = []
    stand_in_checks = types.SimpleNamespace(**{name: getattr(checks, name) for name in dir(checks)
                                               if not name.startswith("_")})
    setattr(stand_in_checks, checker, lambda answer, **keywords: caught.append((answer, keywords)))
    stand_in = types.SimpleNamespace(**{name: getattr(dtlib, name) for name in dir(dtlib) if not name.startswith("_")})
    stand_in.checks = stand_in_checks
    above, solution = _solution(notebook, checker)
    namespace = {"__name__": "__main__", "torch": torch, "dist": dist}
    exec(compile(above, f"<{notebook} above its solution>", "exec"), namespace)  # noqa: S102
    namespace["dtlib"] = stand_in  # after the cells' own `import dtlib`
    exec(compile(solution, f"<{notebook} solution>", "exec"), namespace)  # noqa: S102
    assert len(caught) == 1, f"{notebook}'s solution called {checker} {len(caught)} times"
    return caught[0]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("notebook", "checker", "size"), [(name, *rest) for name, rest in sorted(LARGER.items())])
def test_the_model_answer_is_judged_right_at_a_larger_world_size(notebook, checker, size):
    answer, keywords = _caught_answer(notebook, checker)
    keywords = {name: value for name, value in keywords.items() if name != "world_size"}
    feedback = getattr(checks, checker)(answer, world_size=size, **keywords)
    assert feedback.ok, f"{notebook}'s own answer, at {size} and {size + 1} ranks: {feedback.message}"


def test_the_main_module_is_where_cell_functions_live():
    """The caught answers are shipped by value, as a notebook's are: their module is ``__main__``."""
    answer, _ = _caught_answer("01_processes_and_ranks", "sum_of_ranks")
    assert answer.__module__ == "__main__" and "__main__" in sys.modules


def test_every_checker_built_on_the_skeleton_is_in_the_table():
    """A new rank-function checker (one whose module judges with the skeleton's ``judge``) left out of ``LARGER``
    would escape this file's larger sizes and every principle's test, with nothing failing: the table names each."""
    on_the_skeleton = {name for name in checks.__all__ if inspect.isfunction(checker := getattr(checks, name))
                       and getattr(sys.modules[checker.__module__], "judge", None) is skeleton.judge}
    assert on_the_skeleton == {checker for checker, _ in LARGER.values()}, (
        "add each rank-function checker to LARGER, by its notebook (docs/architecture.md, a checker's recipe)")
