"""The benchmarks' one table writer and one JSON-record maker: each benchmark only declares its columns.

A table is nccl-tests-shaped: a title line and a header line, both starting with ``#``, then one
indented line per row, so that a reader (or ``grep -v '^#'``) tells data from description::

    # dtlib.bench ddp: torch 2.13.0+cpu, ...
    # setting                 ranks  step ms
      1 rank, whole batch         1    41.20
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Column:
    """One column: its header, its least width in characters, and how to write one row's cell.

    ``cell`` takes a row and returns its value; ``spec`` formats it (``".2f"``, ``".0%"``) and ``unit``
    follows it (``"x"``); a value of ``None`` is written ``-``. A column widens to its widest cell.
    Example: ``Column("step ms", 8, lambda row: row.step_ms, ".2f")``.
    """

    header: str
    width: int
    cell: Callable[[Any], object]
    spec: str = ""
    unit: str = ""
    align: str = ">"  # "<" for text read from the left

    def text(self, row: Any) -> str:
        value = self.cell(row)
        return "-" if value is None else f"{value:{self.spec}}{self.unit}"


def format_table(title: str, columns: Sequence[Column], rows: Iterable[Any], footer: str = "") -> str:
    """``title``, the columns' headers, then one line per row (and ``footer``, when given, last).

    Example: ``format_table("dtlib.bench x", [Column("n", 3, len)], [[1, 2]])`` ->
    ``"# dtlib.bench x\\n#   n\\n    2"``.
    """
    cells = [[column.text(row) for column in columns] for row in rows]
    widths = [max([column.width, len(column.header), *(len(line[i]) for line in cells)])
              for i, column in enumerate(columns)]

    def line(prefix: str, texts: Sequence[str]) -> str:
        padded = (f"{text:{column.align}{width}}" for text, column, width in zip(texts, columns, widths, strict=True))
        return (prefix + " ".join(padded)).rstrip()

    lines = [f"# {title}", line("# ", [column.header for column in columns])]
    lines += [line("  ", texts) for texts in cells]
    return "\n".join(lines + ([footer] if footer else []))


def as_records(rows: Iterable[Any], **computed: Callable[[Any], object]) -> list[dict[str, Any]]:
    """Each row (a dataclass) as a plain dict for ``--json``: its fields, then the ``computed`` ones in order.

    A computed field that has a row field's name replaces it, in the computed field's place.
    Example: ``as_records(rows, speed_up=lambda row: 2.0)`` -> ``[{..., "speed_up": 2.0}, ...]``.
    """
    records = []
    for row in rows:
        fields = {name: value for name, value in asdict(row).items() if name not in computed}
        records.append({**fields, **{name: value(row) for name, value in computed.items()}})
    return records
