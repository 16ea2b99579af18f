"""Which collectives a rank's code calls, seen as torch dispatches them (no function is replaced): the one
observer of collectives that the counters, the traffic tables, the simulator and the checkers share.

:func:`observing` hands each call to a function as a :class:`Collective` (its call, named by :mod:`dtlib.calls`,
its group, the payload and the bytes this rank sends); :func:`recording` keeps them in a list. Every view is
that list, folded: :func:`count_collectives` by call, :func:`count_by_group` by group and call,
:func:`dtlib.measure.traffic.traffic` into bytes by group. Two observers stay apart, for what they add: the
runners' :class:`dtlib.measure.commlog.CommLog` times each call it wraps (launched, done), and the live ranks'
stepper (:mod:`dtlib.live.stepper`) pauses before each with its line, naming calls by :mod:`dtlib.calls` too.

Example (inside a rank)::

    with recording() as seen:
        dist.all_reduce(torch.ones(4))
    seen   # [Collective(call='all_reduce', group='0', size=2, kind='all_reduce', payload=16, sent=16.0)]
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from dtlib import calls
from dtlib.launch.spawn import spawn
from dtlib.ring.cost import ring_terms

#: c10d operator (``torch.ops.c10d.<name>``) -> the ``torch.distributed`` call that a learner writes
#: (:data:`dtlib.calls.C10D`'s names, as every observer here gives them).
CALL_NAMES = {name: op.call for name, op in calls.C10D.items()}


#: op -> its (namespace, name) as :func:`watching` hands them on (``("c10d", "allreduce_")``), or None for a
#: higher-order operator, which has no overload packet: read once per op, not at each of its many dispatches.
_NAMES: dict[Any, tuple[str, str] | None] = {}


def _names_of(func: Any) -> tuple[str, str] | None:
    """``func``'s (namespace, name), or None where it is a higher-order operator (never a collective)."""
    if func not in _NAMES:
        if isinstance(func, torch._ops.HigherOrderOperator):
            _NAMES[func] = None
        else:
            namespace, _, name = str(func.overloadpacket).partition(".")
            _NAMES[func] = (namespace, name)
    return _NAMES[func]


def watching(see: Callable[[str, str, tuple], None]) -> contextlib.AbstractContextManager[Any]:
    """A dispatch mode that calls ``see(namespace, name, args)`` for each op torch dispatches in its block
    (``"c10d", "allreduce_"``), before the op runs, on this thread.

    DTensor's ops are let through first (``NotImplemented``, as ``CommDebugMode`` does), so that the collectives
    DTensor desugars them into come back through the mode and are seen (loss_parallel's all-reduces run inside
    DTensor's op handler); higher-order operators, which have no name to see, run as they are. Every counter
    and checker of dtlib that looks at dispatched communication uses this one mode.

    Example (inside a rank)::

        with watching(lambda namespace, name, args: print(namespace, name)):
            dist.all_reduce(torch.ones(2))    # prints: c10d allreduce_
    """
    from torch.distributed.tensor import DTensor

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            names = _names_of(func)
            if names is None:  # a higher-order operator: no overload packet, never a collective
                return func(*args, **(kwargs or {}))
            if DTensor in types:
                return NotImplemented
            see(*names, args)
            return func(*args, **(kwargs or {}))

    return Watch()


#: Functional collectives (``torch.ops._c10d_functional.<name>``, what DTensor and ``_functional_collectives``
#: call), counted under their own name; their ``wait_tensor`` is not a transfer.
FUNCTIONAL_CALLS = tuple(name for name in calls.FUNCTIONAL if name != "shard_dim_alltoall")


@dataclass(frozen=True)
class Collective:
    """One call that moves data between ranks (or waits for them: a barrier), as this rank dispatched it."""

    call: str  # as the course names it (dtlib.calls): "all_gather_single", "all_gather_into_tensor" if functional
    group: str  # its process group's name (``group.group_name``)
    size: int  # the ranks in that group (1 where this torch cannot say)
    kind: str  # its ring algorithm (dtlib.calls.Op.kind): gather, scatter, all_reduce, all_to_all, send, ...
    payload: int  # bytes of the buffer the call is about: an all-gather's output, an all-reduce's input
    sent: float  # bytes this rank sends with the ring algorithms of notebook 03 (a receive sends none)


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
    """The size of a group known only by name (a functional op's); 1 where this torch cannot say."""
    resolve = getattr(dist.distributed_c10d, "_resolve_process_group", None)  # private: present in 2.11 to 2.15
    with contextlib.suppress(Exception):
        return resolve(group_name).size() if resolve is not None else 1
    return 1


def observing(see: Callable[[Collective], None]) -> contextlib.AbstractContextManager[Any]:
    """A dispatch mode that calls ``see(collective)`` for each collective, transfer and barrier torch dispatches
    in its block, before it runs: c10d calls (a learner's, FSDP2's, DDP's reducer, a pipeline's sends and
    receives), functional ones (DTensor's, tensor parallelism's), on this thread and in the backward it starts.

    Not seen: a collective a thread of its own starts (a communication hook may); the ``*_object`` calls are seen
    as the collectives they run.
    """
    sizes: dict[str, int] = {}

    def see_op(namespace: str, name: str, args: tuple) -> None:
        op = calls.op_of(namespace, name)
        if op is None:
            return
        if namespace == "c10d":
            group = _group_of(args)
            group_name, size = (group.group_name, group.size()) if group is not None else ("", 1)
            payload = _nbytes(args[op.payload]) if op.kind != "barrier" else 0
        else:
            group_name = next((a for a in reversed(args) if isinstance(a, str)), "")
            size = sizes.get(group_name) or sizes.setdefault(group_name, _size_of(group_name))
            payload = _nbytes(args[op.payload]) * (size if op.kind == "gather" else 1)
        sent = payload * ring_terms(op.kind, size)[1] if op.kind != "barrier" else 0.0
        see(Collective(op.call, group_name, size, op.kind, payload, sent))

    return watching(see_op)


@contextlib.contextmanager
def recording() -> Iterator[list[Collective]]:
    """:func:`observing`, keeping every :class:`Collective` of the block in a list, in the order they ran."""
    seen: list[Collective] = []
    with observing(seen.append):
        yield seen


def count_collectives(fn: Callable[..., Any], *args: Any) -> tuple[Any, dict[str, int]]:
    """Inside a rank: call ``fn(*args)`` and count the communication it makes, as ``(value, {call: times})``.

    The counter is a dispatch mode over the ops that move data between ranks, the way torch's
    ``CommDebugMode`` counts them, with the same names: no function is replaced, and it sees every c10d
    collective on plain tensors (gloo or NCCL), every functional one (DTensor's, ``all_to_all_single_autograd``),
    point-to-point transfers and barriers, in ``fn`` and in the backward ``fn`` runs. ``CommDebugMode`` itself is
    not used: in torch 2.13 its module tracker raises ``IndexError`` when a module runs twice inside it (a
    router called for the choices, then for the gates), which would refuse a learner's right answer.

    Example (inside ``dtlib.spawn``)::

        count_collectives(dist.all_reduce, torch.ones(2))[1]   # {"all_reduce": 1}
    """
    with recording() as seen:
        value = fn(*args)
    counts: dict[str, int] = {}
    for collective in seen:
        counts[collective.call] = counts.get(collective.call, 0) + 1
    return value, counts


def _counted(rank: int, world_size: int, fn: Callable[..., Any], *args: Any) -> tuple[Any, dict[str, int]]:
    return count_collectives(fn, rank, world_size, *args)


def spawn_counting(fn: Callable[..., Any], world_size: int, *, args: tuple[Any, ...] = (),
                   timeout: float = 30.0, strict: bool | None = None, backend: str = "auto",
                   env: dict[str, str] | None = None) -> tuple[list[Any], list[dict[str, int]]]:
    """``dtlib.spawn(fn, world_size)`` without output, each rank's call counted by :func:`count_collectives`
    (``strict``, ``backend`` and ``env`` as ``dtlib.spawn`` takes them).

    Returns the ranks' values and, per rank, ``{call: times}``; raises as ``dtlib.spawn`` does.
    Example: ``spawn_counting(fn, 2)`` -> ``([3.0, 3.0], [{"all_reduce": 1}, {"all_reduce": 1}])``.
    """
    reports = spawn(_counted, world_size, args=(fn, *args), timeout=timeout, output="none", strict=strict,
                    backend=backend, env=env)
    return [value for value, _ in reports], [calls for _, calls in reports]


def rank_without_communication(calls_per_rank: list[dict[str, int]]) -> int | None:
    """The first rank whose function moved no data between ranks (a barrier moves none), or None.

    Example: ``rank_without_communication([{"all_reduce": 1}, {"barrier": 1}]) == 1``.
    """
    for rank, counted in enumerate(calls_per_rank):
        if not any(times for name, times in counted.items() if name != "barrier"):
            return rank
    return None


def count_by_group(fn: Callable[..., Any], groups: dict[str, Any], *args: Any) -> tuple[Any, dict[str, dict[str, int]]]:
    """Inside a rank: call ``fn(*args)`` and count its collectives by the process group they ran on, as
    ``(value, {group label: {call: times}})``; ``groups`` maps a label to a group (``{"dp": mesh["dp"].get_group(),
    "tp": mesh["tp"].get_group()}``). A group not among them is counted under ``"other"``.

    It folds :func:`recording`'s calls, so it sees what that sees: every c10d collective and transfer (FSDP2's,
    DDP's reducer, a pipeline stage's ``send`` and ``recv``, a learner's, however imported) and every functional
    one (DTensor's, tensor parallelism's), barriers too. A group is matched by its name: a ``new_group`` of the
    same ranks is another communicator, counted under "other".

    Example (inside a rank)::

        count_by_group(step, {"dp": mesh["dp"].get_group(), "tp": mesh["tp"].get_group()})[1]
        # {"dp": {"all_gather_single": 4, "reduce_scatter_single": 2}, "tp": {"all_reduce": 4}}
    """
    labels = {group.group_name: label for label, group in groups.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)
        with recording() as seen:
            value = fn(*args)
    counts: dict[str, dict[str, int]] = {}
    for collective in seen:
        row = counts.setdefault(labels.get(collective.group, "other"), {})
        row[collective.call] = row.get(collective.call, 0) + 1
    return value, counts
