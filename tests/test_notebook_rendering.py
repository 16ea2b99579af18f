"""The stored notebooks render without a kernel: on GitHub, on nbviewer, in a fresh JupyterLab.

Static renderers show only what the .ipynb holds. A figure must be a PNG output (GitHub shows no widget
and no JavaScript), and widget state saved in the metadata must be valid or absent: GitHub refuses to
render a whole notebook whose ``metadata.widgets`` lacks its ``state`` ("Invalid Notebook").
"""

from __future__ import annotations

import base64
import struct
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(data: str) -> tuple[int, int]:
    """Width and height in pixels of a base64 PNG, read from its IHDR chunk; ValueError if it is no PNG."""
    raw = base64.b64decode(data, validate=False)
    if raw[:8] != PNG_SIGNATURE or raw[12:16] != b"IHDR":
        raise ValueError("not a PNG image")
    width, height = struct.unpack(">II", raw[16:24])
    return width, height


def figure_problems(notebook: nbformat.NotebookNode) -> list[str]:
    """Every output that shows a figure but would not render statically as a PNG."""
    problems = []
    for index, cell in enumerate(notebook.cells):
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            images = [mime for mime in data if mime.startswith("image/")]
            text = "".join(data.get("text/plain", ""))
            if images and "image/png" not in images:
                problems.append(f"cell {index}: a figure stored only as {images}, not image/png")
            elif "image/png" in data:
                try:
                    width, height = png_size(data["image/png"])
                except ValueError as error:
                    problems.append(f"cell {index}: image/png output is {error}")
                    continue
                if width < 200 or height < 100:
                    problems.append(f"cell {index}: a {width}x{height} px figure is too small to read")
            elif text.startswith("<Figure size") or "matplotlib" in text and "object at 0x" in text:
                problems.append(f"cell {index}: a figure was stored as its text repr, not drawn ({text[:40]})")
    return problems


def widget_state_problems(notebook: nbformat.NotebookNode) -> list[str]:
    """What is wrong with the saved widget state (nothing when there is none, or it is complete)."""
    widgets = notebook.metadata.get("widgets")
    views = [(index, output["data"][WIDGET_VIEW]) for index, cell in enumerate(notebook.cells)
             for output in cell.get("outputs", []) if WIDGET_VIEW in output.get("data", {})]
    if widgets is None:
        return []  # absent: renderers show each widget output's text/plain fallback
    saved = widgets.get(WIDGET_STATE)
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict):
        return [f"metadata.widgets has no '{WIDGET_STATE}' with a 'state' dict (GitHub: Invalid Notebook)"]
    problems = []
    if not (isinstance(saved.get("version_major"), int) and isinstance(saved.get("version_minor"), int)):
        problems.append("widget state lacks integer version_major / version_minor")
    for model_id, model in saved["state"].items():
        missing = {"model_name", "model_module", "model_module_version", "state"} - set(model)
        if missing:
            problems.append(f"widget model {model_id} lacks {sorted(missing)}")
    for index, view in views:
        if view.get("model_id") not in saved["state"]:
            problems.append(f"cell {index}: widget view {view.get('model_id')} has no saved model")
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_stored_notebook_renders_statically(path: Path) -> None:
    """Valid nbformat, every figure a readable PNG, widget state complete or absent."""
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    assert figure_problems(notebook) + widget_state_problems(notebook) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_the_notebook_declares_its_time_budget(path: Path) -> None:
    """The browser tests hold each notebook's Run All to ``metadata.dtlib.time_budget_s`` seconds (five times it
    at most, then a hang); the README promises 30 to 120 s for each."""
    budget = nbformat.read(path, as_version=4).metadata.get("dtlib", {}).get("time_budget_s")
    assert isinstance(budget, int) and 30 <= budget <= 120, budget


def _figure_cell(*outputs: dict) -> nbformat.NotebookNode:
    notebook = nbformat.v4.new_notebook()
    notebook.cells.append(nbformat.v4.new_code_cell("plot()", outputs=[nbformat.v4.new_output(
        "display_data", data=data) for data in outputs]))
    return notebook


def test_the_checks_catch_what_breaks_static_rendering() -> None:
    png = base64.b64encode(PNG_SIGNATURE + b"\x00\x00\x00\rIHDR" + struct.pack(">II", 640, 480)).decode()
    assert figure_problems(_figure_cell({"image/png": png, "text/plain": "<Figure size 640x480>"})) == []
    assert "only as ['image/svg+xml']" in figure_problems(_figure_cell({"image/svg+xml": "<svg/>"}))[0]
    assert "text repr" in figure_problems(_figure_cell({"text/plain": "<Figure size 640x480 with 1 Axes>"}))[0]
    assert "not a PNG" in figure_problems(_figure_cell({"image/png": base64.b64encode(b"GIF89a").decode()}))[0]
    tiny = base64.b64encode(PNG_SIGNATURE + b"\x00\x00\x00\rIHDR" + struct.pack(">II", 40, 30)).decode()
    assert "too small" in figure_problems(_figure_cell({"image/png": tiny}))[0]

    notebook = _figure_cell({WIDGET_VIEW: {"model_id": "abc", "version_major": 2, "version_minor": 0}})
    assert widget_state_problems(notebook) == []
    notebook.metadata["widgets"] = {WIDGET_STATE: {"version_major": 2, "version_minor": 0}}
    assert "Invalid Notebook" in widget_state_problems(notebook)[0]
    notebook.metadata["widgets"][WIDGET_STATE]["state"] = {}
    assert widget_state_problems(notebook) == ["cell 0: widget view abc has no saved model"]
