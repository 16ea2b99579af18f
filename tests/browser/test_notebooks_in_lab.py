"""Every notebook opened in JupyterLab in headless Chromium and run with Run > Run All Cells, as a learner does.

They check in JupyterLab what nbval checks in a bare kernel (every cell runs, in order, without an error, and
each cell nbval checks shows what the notebook stores), and they look at what the page shows: every figure the
stored notebook has drawn again as a loaded image, the Run All time reported against the notebook's budget
(``metadata.dtlib.time_budget_s``), every ipywidgets slider driving the figure beside it, and every prediction
widget measuring and judging what a learner types.
Run them with ``make test-browser``; screenshots land in build/browser/.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
import status
from nbval_compare import checked_output_problems

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted(path.name for path in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def _stored(notebook: str) -> nbformat.NotebookNode:
    return nbformat.read(ROOT / "notebooks" / notebook, as_version=4)


def _figures_per_cell(notebook: nbformat.NotebookNode) -> dict[int, int]:
    """PNG outputs per code cell index (cells without figures left out)."""
    counts = {index: sum("image/png" in output.get("data", {}) for output in cell.outputs)
              for index, cell in enumerate(notebook.cells) if cell.cell_type == "code"}
    return {index: count for index, count in counts.items() if count}


def _has_widgets(notebook: str) -> bool:
    return bool(status.widget_cells(_stored(notebook)))


@pytest.mark.timeout(600)  # above 5 x the largest budget (90 s), so that Run All's own guard speaks first
@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_run_all_shows_no_error_and_every_figure_within_budget(notebook: str, notebook_runs) -> None:
    run = notebook_runs.get(notebook)
    counts = [cell.execution_count for cell in run.saved.cells if cell.cell_type == "code"]
    assert counts == list(range(1, len(counts) + 1)), f"cells not run once each, in order: {counts}"
    errors = [f"cell {index}: {output.ename}: {output.evalue}" for index, cell in enumerate(run.saved.cells)
              if cell.cell_type == "code" for output in cell.outputs if output.output_type == "error"]
    assert not errors, "error outputs after Run All:\n" + "\n".join(errors)
    assert not (changed := checked_output_problems(run.stored, run.saved)), "\n".join(changed)
    assert run.images == _figures_per_cell(run.stored), (
        f"figures per cell: the page shows {run.images}, the notebook stores {_figures_per_cell(run.stored)}")
    # The budget is a target, reported beside each screenshot (make browser-screenshots). The gate only guards
    # against a hang: Run All raises after notebook_runs.hang_guard_x_budget times the budget, so that a busy
    # machine cannot fail correct notebooks.


@pytest.mark.parametrize("notebook", [name for name in NOTEBOOKS if _has_widgets(name)])
def test_every_slider_drives_its_figure(notebook: str, notebook_runs) -> None:
    run = notebook_runs.get(notebook)
    assert run.view is not None
    for cell_index in status.widget_cells(run.stored):
        sliders = run.view.sliders(cell_index)
        assert sliders, f"cell {cell_index}: the stored notebook has a widget here, the page shows no slider"
        for slider in sliders:
            label, before_value = run.view.slider_text(slider)
            before = run.view.widget_figure(cell_index)
            assert before, f"cell {cell_index}: no figure drawn beside the {label!r} slider"
            after_value = run.view.move_slider(slider)
            assert after_value != before_value, f"slider {label!r} did not move ({before_value})"
            after = run.view.figure_after(cell_index, before)
            changed = after is not None and after != before  # compared here, so a failure prints no base64
            assert changed, f"cell {cell_index}: moving {label!r} from {before_value} to {after_value} " + (
                "left no figure" if after is None else "did not change the figure")


@pytest.mark.parametrize("notebook", [name for name in NOTEBOOKS if status.prediction_cells(_stored(name))])
def test_every_prediction_measures_and_judges_what_is_typed(notebook: str, notebook_runs) -> None:
    run = notebook_runs.get(notebook)
    assert set(run.verdicts) == set(status.prediction_cells(run.stored))
    for cell_index, verdict in run.verdicts.items():
        assert verdict.startswith(("✓", "✗")) and re.search(r"You predicted 1; [\w ]+ measured", verdict), (
            f"cell {cell_index}: the prediction widget showed {verdict!r}")
