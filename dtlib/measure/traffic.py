"""Bytes each collective moves, by process group, seen as torch dispatches them: one table for live ranks and
for the simulator's fake ones.

A row is (group label, call): how many calls, their payload (the whole buffer the collective is about: an
all-gather's output, a reduce-scatter's or all-reduce's input, a send's tensor) and the bytes this rank sends
with the ring algorithms of notebook 03: (n-1)/n of the payload for an all-gather, a reduce-scatter or an
all-to-all, 2(n-1)/n for an all-reduce, all of it for a send or a broadcast, n ranks in the group.
Calls are named as the course teaches them (``all_gather_single``, whatever this torch dispatches).

Example (inside a rank)::

    with traffic({"dp": mesh["dp"].get_group()}) as seen:
        step()
    seen.rows()     # [Row(group="dp", call="all_gather_single", calls=6, payload=..., sent=...), ...]
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from dtlib import calls
from dtlib.measure.counting import Collective, observing


def call_kind(call: str) -> str:
    """The kind of a call as a table names it (its ring algorithm, :data:`dtlib.ring.cost.RING_OF`), for the
    seconds that :mod:`dtlib.sim.network` gives each row. Example: ``call_kind("all_gather_single")`` is "gather"."""
    for op in (*calls.C10D.values(), *calls.FUNCTIONAL.values()):
        if op.call == call:
            return op.kind
    raise ValueError(f"no traffic table names a call {call!r}")


@dataclass(frozen=True)
class Row:
    """One (group, call) of the table: calls, payload bytes and bytes this rank sent, over the block."""

    group: str
    call: str
    calls: int
    payload: int
    sent: int


@dataclass
class Traffic:
    """What :func:`traffic` saw: ``{(group, call): [calls, payload, sent]}``."""

    seen: dict[tuple[str, str], list[float]] = field(default_factory=dict)

    def add(self, group: str, call: str, payload: int, sent: float) -> None:
        row = self.seen.setdefault((group, call), [0, 0, 0.0])
        row[0], row[1], row[2] = row[0] + 1, row[1] + payload, row[2] + sent

    def rows(self) -> list[Row]:
        """The table, by group then call."""
        return [Row(group, call, int(calls), int(payload), round(sent))
                for (group, call), (calls, payload, sent) in sorted(self.seen.items())]


def sent_by_group(rows: list[Row]) -> dict[str, int]:
    """Bytes a rank sent, per group, from its table (:meth:`Traffic.rows`)."""
    totals: dict[str, int] = {}
    for row in rows:
        totals[row.group] = totals.get(row.group, 0) + row.sent
    return totals


@contextlib.contextmanager
def traffic(groups: dict[str, Any]) -> Iterator[Traffic]:
    """Inside a rank: tabulate the bytes of every collective and transfer in the block by the group it ran on;
    ``groups`` maps a label to a process group, and any other group is labelled "other" (a group this rank is
    not in, as ``new_group`` gives the others, is left out).

    It folds :func:`dtlib.measure.counting.observing`'s calls, so it sees what every counter sees: c10d ops
    (FSDP2's, DDP's reducer, a learner's), functional ones (DTensor's, tensor parallelism's), send and recv (a
    pipeline's), on this thread and in the backward it starts.
    """
    seen = Traffic()
    labels = {group.group_name: label for label, group in groups.items() if isinstance(group, dist.ProcessGroup)}

    def add(collective: Collective) -> None:
        if collective.kind != "barrier":  # a table of bytes: a barrier moves none
            seen.add(labels.get(collective.group, "other"), collective.call, collective.payload, collective.sent)

    with observing(add):
        yield seen
