"""nbval's own output check, applied to a notebook that JupyterLab ran and saved.

When the browser tests run a notebook, nbval leaves it out (tests/conftest.py), so the browser test must check
exactly what nbval would have: the same cells (``# NBVAL_CHECK_OUTPUT``, or the ``nbval-check-output`` tag
where the first line must be a cell magic) compared the same way (streams joined, ``\\r`` and ``\\b`` applied,
images, widget views, metadata and tracebacks left out). Both come from nbval's plugin itself.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from types import SimpleNamespace

import nbformat
from nbval.plugin import IPyNbCell, coalesce_streams, find_comment_markers, find_metadata_tags, nocolors

# nbval's IPyNbFile.skip_compare with --nbval-lax and without nbdime (the gate's options).
SKIP_COMPARE = ("metadata", "traceback", "prompt_number", "output_type", "name", "execution_count",
                "application/vnd.jupyter.widget-view+json", "image/png", "image/jpeg")


def checks_output(cell: nbformat.NotebookNode) -> bool:
    """Whether nbval --nbval-lax compares this cell's outputs: its tags, then its comments, as nbval reads them."""
    if cell.cell_type != "code":
        return False
    options: dict[str, bool] = defaultdict(bool, find_metadata_tags(cell.metadata))
    options.update(dict(find_comment_markers(cell.source)))  # comments win over tags, as in nbval
    return options["check"]


def output_difference(stored: nbformat.NotebookNode, ran: nbformat.NotebookNode) -> str | None:
    """nbval's verdict on a checked cell: None when ``ran``'s outputs match ``stored``'s, else nbval's report."""
    cell = SimpleNamespace(parent=SimpleNamespace(skip_compare=SKIP_COMPARE, sanitize_patterns={}),
                           colors=nocolors, comparison_traceback=[], sanitize=lambda text: text,
                           ihook=SimpleNamespace(pytest_assertrepr_compare=lambda **_: []), config=None)
    cell.format_output_compare = lambda key, left, right: IPyNbCell.format_output_compare(cell, key, left, right)
    test = coalesce_streams(copy.deepcopy(ran.outputs))
    reference = coalesce_streams(copy.deepcopy(stored.outputs))
    if IPyNbCell.compare_outputs(cell, test, reference):
        return None
    return "\n".join(cell.comparison_traceback)


def checked_output_problems(stored: nbformat.NotebookNode, saved: nbformat.NotebookNode) -> list[str]:
    """Each cell nbval checks whose outputs after the run differ from the stored ones, with nbval's report."""
    return [f"cell {index}: {difference}"
            for index, (before, after) in enumerate(zip(stored.cells, saved.cells, strict=True))
            if checks_output(before) and (difference := output_difference(before, after)) is not None]
