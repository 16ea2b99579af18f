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

import torch
import torch.distributed as dist

from dtlib import compat
from dtlib.measure.counting import CALL_NAMES, watching
from dtlib.ring.cost import ring_terms

#: c10d op -> (kind, which argument holds the payload): 0 the first, 1 the second. The kind names the ring
#: algorithm whose share of the payload a rank sends (:data:`dtlib.ring.cost.RING_OF`); a rooted gather, reduce
#: or scatter counts as one send of the buffer.
_C10D = {"allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0), "broadcast_": ("broadcast", 0),
         "allgather_": ("gather", 0), "_allgather_base_": ("gather", 0), "allgather_coalesced_": ("gather", 0),
         "allgather_into_tensor_coalesced_": ("gather", 0), "reduce_scatter_": ("scatter", 1),
         "_reduce_scatter_base_": ("scatter", 1), "reduce_scatter_tensor_coalesced_": ("scatter", 1),
         "alltoall_": ("all_to_all", 1), "alltoall_base_": ("all_to_all", 1), "send": ("send", 0),
         "recv_": ("none", 0), "recv_any_source_": ("none", 0), "reduce_": ("send", 0), "gather_": ("send", 1),
         "scatter_": ("send", 1)}
#: Functional op -> kind; its payload is its input (times the group for an all-gather).
_FUNCTIONAL = {"all_gather_into_tensor": "gather", "all_gather_into_tensor_coalesced": "gather",
               "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce", "all_to_all_single": "all_to_all",
               "broadcast": "broadcast", "reduce_scatter_tensor": "scatter",
               "reduce_scatter_tensor_coalesced": "scatter"}


def call_kind(call: str) -> str:
    """The kind of a call as a table names it (its ring algorithm, :data:`dtlib.ring.cost.RING_OF`), for the
    seconds that :mod:`dtlib.sim.network` gives each row. Example: ``call_kind("all_gather_single")`` is "gather"."""
    for name, (kind, _) in _C10D.items():
        if compat.current_name(CALL_NAMES.get(name, name)) == call:
            return kind
    if call in _FUNCTIONAL:
        return _FUNCTIONAL[call]
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


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(item) for item in value)
    return 0


def _group_of(args: tuple) -> Any:
    """The process group a c10d op runs on (the dispatcher passes it boxed), or None."""
    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            with contextlib.suppress(RuntimeError):  # another boxed object (a ReduceOp)
                return dist.ProcessGroup.unbox(arg)
    return None


def _size_of(group_name: str) -> int:
    """The size of a group known only by name (one not in ``groups``); 1 where this torch cannot say."""
    resolve = getattr(dist.distributed_c10d, "_resolve_process_group", None)  # private: present in 2.11 to 2.15
    with contextlib.suppress(Exception):
        return resolve(group_name).size() if resolve is not None else 1
    return 1


@contextlib.contextmanager
def traffic(groups: dict[str, Any]) -> Iterator[Traffic]:
    """Inside a rank: tabulate the bytes of every collective and transfer in the block by the group it ran on;
    ``groups`` maps a label to a process group, and any other group is labelled "other" (a group this rank is
    not in, as ``new_group`` gives the others, is left out).

    It sees what torch dispatches (c10d ops: FSDP2's, DDP's from Python, a learner's; functional ones: DTensor's,
    tensor parallelism's; send and recv: a pipeline's), on this thread and in the backward it starts.
    """
    seen = Traffic()
    groups = {label: group for label, group in groups.items() if isinstance(group, dist.ProcessGroup)}  # its own
    labels = {group.group_name: label for label, group in groups.items()}
    sizes = {group.group_name: group.size() for group in groups.values()}

    def see(namespace: str, name: str, args: tuple) -> None:
        if namespace == "c10d" and name in _C10D:
            kind, where = _C10D[name]
            group = _group_of(args)
            size = group.size() if group is not None else 1
            label = labels.get(group.group_name, "other") if group is not None else "other"
            payload = _nbytes(args[where])
            call = compat.current_name(CALL_NAMES.get(name, name))
        elif namespace == "_c10d_functional" and name in _FUNCTIONAL:
            kind, group_name = _FUNCTIONAL[name], next(a for a in reversed(args) if isinstance(a, str))
            size = sizes.get(group_name) or _size_of(group_name)
            label, call = labels.get(group_name, "other"), name
            payload = _nbytes(args[0]) * (size if kind == "gather" else 1)
        else:
            return
        seen.add(label, call, payload, payload * ring_terms(kind, size)[1])

    with watching(see):
        yield seen
