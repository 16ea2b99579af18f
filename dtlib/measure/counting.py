"""Which collectives a rank's code calls, counted as torch dispatches them (no patching).

The checkers use it to refuse answers that compute the right number without communicating.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from dtlib import compat
from dtlib.launch import strict
from dtlib.launch.spawn import spawn

#: c10d operator (``torch.ops.c10d.<name>``) -> the ``torch.distributed`` call that a learner writes.
CALL_NAMES = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce_coalesced", "broadcast_": "broadcast",
    "allgather_": "all_gather", "_allgather_base_": "all_gather_into_tensor",
    "allgather_coalesced_": "all_gather_coalesced", "allgather_into_tensor_coalesced_": "all_gather_into_tensor",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter_tensor", "reduce_": "reduce", "gather_": "gather",
    "scatter_": "scatter", "alltoall_": "all_to_all", "alltoall_base_": "all_to_all_single",
    "send": "send", "recv_": "recv", "recv_any_source_": "recv", "barrier": "barrier",
}


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
            if isinstance(func, torch._ops.HigherOrderOperator):  # no overload packet, never a collective
                return func(*args, **(kwargs or {}))
            if DTensor in types:
                return NotImplemented
            namespace, _, name = str(func.overloadpacket).partition(".")
            see(namespace, name, args)
            return func(*args, **(kwargs or {}))

    return Watch()


#: Functional collectives (``torch.ops._c10d_functional.<name>``, what DTensor and ``_functional_collectives``
#: call), counted under their own name; their ``wait_tensor`` is not a transfer.
FUNCTIONAL_CALLS = ("all_gather_into_tensor", "all_gather_into_tensor_coalesced", "all_reduce", "all_reduce_coalesced",
                    "all_to_all_single", "broadcast", "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced")


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
    calls: dict[str, int] = {}

    def see(namespace: str, name: str, args: tuple) -> None:
        if namespace == "c10d":
            call = CALL_NAMES.get(name)
        elif namespace in ("_c10d_functional", "_c10d_functional_autograd"):
            call = name if name in FUNCTIONAL_CALLS else None
        else:
            call = name if (namespace, name) == ("_dtensor", "shard_dim_alltoall") else None
        if call is not None:
            calls[call] = calls.get(call, 0) + 1

    with watching(see):
        value = fn(*args)
    return value, calls


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
    for rank, calls in enumerate(calls_per_rank):
        if not any(times for name, times in calls.items() if name != "barrier"):
            return rank
    return None


#: The torch.distributed functions whose calls :func:`count_by_group` attributes to their process group.
GROUPED_CALLS = ("all_reduce", "all_gather_single", "all_gather_into_tensor", "all_gather", "reduce_scatter_single",
                 "reduce_scatter_tensor", "reduce_scatter", "broadcast", "all_to_all_single", "reduce", "gather",
                 "scatter")  # FSDP2 calls the *_single ones
#: Point-to-point ops as torch dispatches them (``torch.ops.c10d.<name>``) -> the name they are counted under.
#: Not wrapped: ``dist.P2POp`` (pipelining's, ``batch_isend_irecv``'s) accepts only the original functions.
POINT_TO_POINT = {"send": "send", "recv_": "recv", "recv_any_source_": "recv"}


def count_by_group(fn: Callable[..., Any], groups: dict[str, Any], *args: Any) -> tuple[Any, dict[str, dict[str, int]]]:
    """Inside a rank: call ``fn(*args)`` and count its collectives by the process group they ran on, as
    ``(value, {group label: {call: times}})``; ``groups`` maps a label to a group (``{"dp": mesh["dp"].get_group(),
    "tp": mesh["tp"].get_group()}``). A group not among them is counted under ``"other"``.

    Two routes, because torch has two: ``torch.distributed.<name>(..., group=...)`` collectives (FSDP2's, a DDP
    communication hook's, a learner's) are seen by wrapping those functions, for every thread, while ``fn`` runs;
    DTensor's functional collectives (``_c10d_functional``, which tensor parallelism uses) and every
    point-to-point transfer (``send``, ``recv``, ``isend``, ``irecv``, ``batch_isend_irecv``, a pipeline stage's)
    are seen as torch dispatches them on this thread, with their group, and counted as "send" and "recv". Not
    seen: DDP's built-in C++ reducer (count it with :func:`count_collectives`), the ``*_object`` calls, and a
    function imported by name before ``fn`` runs. A group is matched by identity (by its name, for what is
    dispatched): a ``new_group`` of the same ranks is another communicator, counted under "other".
    """
    counts: dict[str, dict[str, int]] = {}
    by_name = {group.group_name: label for label, group in groups.items()}

    def note(label: str, call: str) -> None:
        counts.setdefault(label, {})
        counts[label][call] = counts[label].get(call, 0) + 1

    def label_of(group: Any) -> str:
        group = group if group is not None else dist.group.WORLD
        return next((label for label, known in groups.items() if known is group), "other")

    def wrapped(call: str, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        @strict.passes_through
        def collective(*call_args: Any, **kwargs: Any) -> Any:
            # Under the name the course teaches: FSDP2 calls all_gather_into_tensor before torch 2.13.
            note(label_of(signature.bind(*call_args, **kwargs).arguments.get("group")), compat.current_name(call))
            return original(*call_args, **kwargs)
        return collective

    def dispatched_group(args: tuple) -> str:
        """The label of a c10d op's process group, which the dispatcher passes as a boxed ScriptObject."""
        for arg in args:
            if isinstance(arg, torch.ScriptObject):
                with contextlib.suppress(RuntimeError):  # another boxed object (a ReduceOp)
                    return by_name.get(dist.ProcessGroup.unbox(arg).group_name, "other")
        return "other"

    def see(namespace: str, name: str, args: tuple) -> None:
        if namespace == "_c10d_functional" and name not in ("wait_tensor", "_wrap_tensor_autograd"):
            note(next((by_name[a] for a in args if isinstance(a, str) and a in by_name), "other"), name)
        elif namespace == "c10d" and name in POINT_TO_POINT:
            note(dispatched_group(args), POINT_TO_POINT[name])

    originals = {call: getattr(dist, call) for call in GROUPED_CALLS if hasattr(dist, call)}
    try:
        for call, original in originals.items():
            setattr(dist, call, wrapped(call, original))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)
            with watching(see):
                value = fn(*args)
    finally:
        for call, original in originals.items():
            setattr(dist, call, original)
    return value, counts
