"""Every ``torch.distributed`` name the course calls, and whether the oldest supported torch has it.

    python scripts/torch_names.py list      # the names dtlib and the notebooks' cells use, one a line
    python scripts/torch_names.py record    # under the oldest torch (make test-torch's venv): write the record

The record (tests/data/torch_names.txt) says, for each name, whether that torch has it. The gate's test
(tests/test_torch_names.py) runs on any torch: a name the code uses that the record does not hold, or that the
oldest torch lacks and ``dtlib.compat`` does not supply, fails it, so a call that only a newer torch knows is
caught on the CPU before a learner with an older torch meets it. Regenerate the record with
``.venv-torch2.11/bin/python scripts/torch_names.py record`` after ``make test-torch TORCH=2.11`` made that venv.

Names are read with ``ast``: attribute chains on a name bound to ``torch.distributed`` or a module below it
(``dist.all_reduce``, ``dcp.save``, ``torch.distributed.fsdp.fully_shard``) and ``from torch.distributed... import
name``. Standard library only, but for ``record``, which imports torch.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "tests" / "data" / "torch_names.txt"
PREFIX = "torch.distributed"
MAGIC = re.compile(r"^(\s*|.*=\s*)[%!].*$")
#: What a %%ranks cell finds bound without importing it (dtlib/live/server.py).
LIVE_NAMES = {"dist": PREFIX}


def sources() -> dict[str, str]:
    """Each Python source of dtlib, and each notebook's code cell (``path#index``), by path relative to the root."""
    found = {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "dtlib").rglob("*.py"))}
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        for index, cell in enumerate(cells):
            if cell["cell_type"] == "code":
                # A magic (%%ranks, %ranks pull, !cmd) is not Python: a %%ranks body is, the rest reads as None.
                lines = [MAGIC.sub(r"\1None", line) for line in "".join(cell["source"]).splitlines()]
                found[f"{path.relative_to(ROOT)}#{index}"] = "\n".join(lines)
    return found


def _chain(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; None for anything but names and attributes."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return parts[::-1]


def names_in(source: str, bound: dict[str, str] | None = None) -> set[str]:
    """The dotted ``torch.distributed`` names one source uses; ``bound`` (names bound earlier, as in a
    notebook's earlier cells) gains this source's imports.

    Example: ``names_in("import torch.distributed as dist\\ndist.all_reduce(x)")`` is
    ``{"torch.distributed", "torch.distributed.all_reduce"}``.
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:  # a cell that is not Python (%%ranks bodies are; %%bash ones are not)
        return set()
    aliases = bound if bound is not None else {}  # local name -> dotted name under torch.distributed; grows
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PREFIX):
                    used.add(alias.name)
                    if alias.asname:
                        aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PREFIX) and not node.level:
            for alias in node.names:
                if alias.name != "*":
                    dotted = f"{node.module}.{alias.name}"
                    used.add(dotted)
                    aliases[alias.asname or alias.name] = dotted
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (parts := _chain(node)):
            if parts[0] in aliases:
                used.add(".".join([aliases[parts[0]], *parts[1:]]))
            elif parts[:2] == ["torch", "distributed"]:
                used.add(".".join(parts))
    return used


def used_names() -> dict[str, list[str]]:
    """Each name the course uses -> the files that use it."""
    where: dict[str, list[str]] = {}
    notebook_names: dict[str, dict[str, str]] = {}  # a notebook's imports hold in its later cells
    for path, source in sources().items():
        bound = notebook_names.setdefault(path.split("#")[0], dict(LIVE_NAMES)) if ".ipynb#" in path else None
        for name in names_in(source, bound):
            where.setdefault(name, [])
            if path.split("#")[0] not in where[name]:
                where[name].append(path.split("#")[0])
    return dict(sorted(where.items()))


def exists(dotted: str) -> bool:
    """Whether the installed torch has ``dotted`` (a module, or an attribute reached from one)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attribute in parts[cut:]:
                value = getattr(value, attribute)
        except AttributeError:
            return False
        return True
    return False


def read_record(path: Path = RECORD) -> tuple[str, dict[str, bool]]:
    """``(torch version, {name: present})`` from the record."""
    lines = path.read_text().splitlines()
    version = lines[0].removeprefix("# torch ").split()[0]
    present = {}
    for line in lines[1:]:
        if line and not line.startswith("#"):
            name, _, state = line.partition(" ")
            present[name] = state.strip() == "present"
    return version, present


def record(path: Path = RECORD) -> None:
    """Write, for each name the course uses, whether this process's torch has it (without dtlib's additions)."""
    import torch

    if "dtlib" in sys.modules:
        raise SystemExit("record in a fresh interpreter: dtlib adds names to an older torch")
    names = used_names()
    lines = [f"# torch {torch.__version__}: every torch.distributed name the course uses, and whether this torch",
             "# has it. Written by: python scripts/torch_names.py record (under the oldest supported torch)."]
    lines += [f"{name} {'present' if exists(name) else 'missing'}" for name in names]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    missing = [name for name in names if not exists(name)]
    print(f"{path.relative_to(ROOT)}: {len(names)} names under torch {torch.__version__}, missing: {missing or 'none'}")


def main(argv: list[str]) -> int:
    if argv[:1] == ["list"]:
        for name, paths in used_names().items():
            print(name, " ".join(paths))
    elif argv[:1] == ["record"]:
        record()
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
