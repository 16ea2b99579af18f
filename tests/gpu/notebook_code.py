"""A notebook's own rank functions, taken from its cells, so that the GPU suite runs the lesson's code.

Example::

    code = definitions("09_tensor_parallel.ipynb", ["Attention", "Block", "TP_PLAN", "tp_block"])
    dtlib.spawn(code["tp_block"], 1, args=(code["TP_PLAN"],), backend="nccl")

Only a cell's imports and the named definitions run (functions, classes, and names assigned at the top of a
cell), in the notebook's order; every other statement (the cell's own ``dtlib.spawn(...)``) is left out, and
so is every cell with IPython syntax (``%%ranks``, ``%load_ext``). The functions travel to the ranks by value,
as a cell's functions do.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def _defined_names(node: ast.stmt) -> set[str]:
    """The names a top-level statement defines: a function, a class, or plain names assigned."""
    if isinstance(node, ast.FunctionDef | ast.ClassDef):
        return {node.name}
    if isinstance(node, ast.Assign) and all(isinstance(target, ast.Name) for target in node.targets):
        return {target.id for target in node.targets}
    return set()


def definitions(notebook: str, names: Iterable[str]) -> dict[str, Any]:
    """The namespace after running ``notebook``'s imports and its definitions of ``names``, in cell order.

    Raises LookupError naming what the notebook no longer defines (a renamed function, say).
    """
    path = NOTEBOOKS / notebook
    wanted, found = set(names), set()
    namespace: dict[str, Any] = {"__name__": f"notebook_{path.stem}"}  # not importable: shipped by value
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    for index, cell in enumerate(cells):
        if cell["cell_type"] != "code":
            continue
        try:
            tree = ast.parse("".join(cell["source"]))
        except SyntaxError:  # IPython syntax: a magic, live ranks
            continue
        kept = [node for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)
                or (_defined_names(node) and _defined_names(node) <= wanted)]
        found |= set().union(*map(_defined_names, kept))
        if kept:
            code = compile(ast.Module(body=kept, type_ignores=[]), f"{path} (cell {index})", "exec")
            exec(code, namespace)  # noqa: S102 - the course's own notebook
    missing = wanted - found
    if missing:
        raise LookupError(f"{notebook} no longer defines {sorted(missing)} at the top of a code cell")
    return namespace
