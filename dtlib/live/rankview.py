"""Values from every rank, side by side, so that differences between ranks show at a glance.

Example::

    RankValues([torch.tensor([1., 2.]), torch.tensor([1., 2.])])
    # rank 0 │ tensor([1., 2.])
    # rank 1 │ tensor([1., 2.])
    # the same on every rank
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from dtlib.launch.shards import LocalMesh, LocalShard, describe
from dtlib.live.server import RemoteRepr


def _text(value: Any) -> str:
    try:
        return repr(value)
    except Exception:  # noqa: BLE001 - a broken repr must not hide the other ranks
        return f"<{type(value).__qualname__} whose repr() failed>"


def _same(a: Any, b: Any) -> bool:
    try:
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                    and a.dtype == b.dtype and bool(torch.equal(a, b)))
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that cannot be compared are compared by their text
        return _text(a) == _text(b)


def compare(values: Sequence[Any]) -> str:
    """One sentence: are the ranks' values the same, and if not, by how much (for tensors)?

    Example: ``compare([torch.ones(2), torch.zeros(2)])`` is ``"rank 1 differs from rank 0 (by up to 1)"``.
    """
    if len(values) < 2:
        return ""
    if all(isinstance(value, (LocalShard, LocalMesh)) for value in values):  # parts differ by design: say how
        return describe(list(values))
    if all(isinstance(value, RemoteRepr) for value in values):  # sent as text: it cannot leave its rank
        agree = len({_text(value) for value in values}) == 1
        return f"shown as text, since these values cannot leave their ranks; the texts {'agree' if agree else 'differ'}"
    first = values[0]
    different = [rank for rank, value in enumerate(values) if not _same(first, value)]
    if not different:
        return "the same on every rank"
    gaps = [_largest_gap(first, values[rank]) for rank in different]
    who = f"rank {different[0]} differs" if len(different) == 1 else \
        f"ranks {', '.join(map(str, different))} differ"
    by = f" (by up to {max(gaps):.4g})" if None not in gaps else ""
    return f"{who} from rank 0{by}"


def _largest_gap(a: Any, b: Any) -> float | None:
    try:
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape:
            if a.numel() == 0:
                return 0.0
            return float((a.double() - b.double()).abs().max())
        if isinstance(a, (int, float)) and isinstance(b, (int, float)):
            return abs(float(a) - float(b))
    except Exception:  # noqa: BLE001
        return None
    return None


MAX_ALIGNED_ELEMENTS = 64  # vectors up to this long are printed one row per rank, in one shared format


def _aligned_vectors(values: Sequence[Any]) -> list[str] | None:
    """Rows of one shared format (same precision, same column widths) for same-shape small vectors, else None.

    Example: ``[tensor([1., 2.]), tensor([1., 2.5])]`` gives ``["tensor([1.0, 2.0])", "tensor([1.0, 2.5])"]``.
    """
    if not values or not all(isinstance(v, torch.Tensor) for v in values):
        return None
    first = values[0]
    if first.dim() > 1 or first.numel() > MAX_ALIGNED_ELEMENTS or first.is_complex() or any(
            v.shape != first.shape or v.dtype != first.dtype for v in values):
        return None
    rows = torch.stack([v.detach().cpu().reshape(-1) for v in values])
    array = rows.double().numpy() if rows.is_floating_point() else rows.numpy()
    text = np.array2string(array, max_line_width=1 << 20, precision=4, separator=", ", threshold=1 << 20,
                           floatmode="maxprec_equal", suppress_small=True)
    suffix = "" if first.dtype in (torch.float32, torch.int64, torch.bool) else f", dtype={first.dtype}"
    lines = [line.strip().strip("[],") for line in text.splitlines()]  # the padding inside stays: columns line up
    if first.dim() == 0:
        return [f"tensor({line.strip()}{suffix})" for line in lines]
    return [f"tensor([{line}]{suffix})" for line in lines]


class RankValues(list):
    """A list of per-rank values that shows one row per rank and says whether they agree."""

    def __init__(self, values: Sequence[Any], name: str = "") -> None:
        super().__init__(values)
        self.name = name

    def _rows(self) -> list[tuple[str, str]]:
        aligned = _aligned_vectors(self)
        if aligned is not None:
            return [(f"rank {rank}", text) for rank, text in enumerate(aligned)]
        return [(f"rank {rank}", _text(value)) for rank, value in enumerate(self)]

    def __repr__(self) -> str:
        rows = self._rows()
        width = max((len(label) for label, _ in rows), default=0)
        lines = [f"{self.name}:"] if self.name else []
        for label, text in rows:
            body = text.replace("\n", "\n" + " " * width + " │ ")
            lines.append(f"{label:<{width}} │ {body}")
        summary = compare(self)
        if summary:
            lines.append(summary)
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        cells = "".join(f"<tr><th style='text-align:left'>{label}</th>"
                        f"<td style='text-align:left'><pre style='margin:0'>{html.escape(text)}</pre></td></tr>"
                        for label, text in self._rows())
        caption = " · ".join(part for part in (self.name, compare(self)) if part)
        head = f"<caption style='text-align:left'>{html.escape(caption)}</caption>" if caption else ""
        return f"<table>{head}{cells}</table>"
