"""The collectives as torch dispatches them, named as the course teaches them: one table for every observer.

Every call that moves data between ranks reaches torch's dispatcher as an op, whoever issues it: ``c10d`` ops
for ``torch.distributed``'s calls (a learner's, DDP's reducer, FSDP2's hooks, a pipeline's transfers) and
``_c10d_functional`` ops for the functional collectives (DTensor's, tensor parallelism's). :data:`C10D` and
:data:`FUNCTIONAL` say, for each op, the call a learner writes (2.13's names: ``all_gather_single``, whichever
spelling this torch dispatched), the ring algorithm whose share of the payload a rank sends (the kinds of
:data:`dtlib.ring.cost.RING_OF`; a rooted gather, reduce or scatter is one send of the buffer) and which argument
holds that payload. The counters and the traffic tables (:mod:`dtlib.measure.counting`), the stepper
(:mod:`dtlib.live.stepper`) and the timeline's log (:mod:`dtlib.measure.commlog`, through :func:`op_called`) read
them here, so that every view of a rank's collectives calls them the same.

Example::

    op_of("c10d", "_allgather_base_")    # Op(call='all_gather_single', kind='gather', payload=0)
    op_called("all_gather_into_tensor")   # the same Op: what dist.all_gather_into_tensor dispatches
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    """What one dispatcher op is, as the course counts it."""

    call: str  # the torch.distributed call (for c10d) or the functional op's own name
    kind: str  # gather, scatter, all_reduce, all_to_all, broadcast, send, none (a receive), barrier
    payload: int  # the argument holding the buffer the call is about (the gathered output, the reduced input)


#: ``torch.ops.c10d.<name>`` -> the call. A coalesced op (``_coalescing_manager``'s) counts as one call of its
#: plain form.
C10D: dict[str, Op] = {
    "allreduce_": Op("all_reduce", "all_reduce", 0),
    "allreduce_coalesced_": Op("all_reduce_coalesced", "all_reduce", 0),
    "broadcast_": Op("broadcast", "broadcast", 0),
    "allgather_": Op("all_gather", "gather", 0),
    "_allgather_base_": Op("all_gather_single", "gather", 0),
    "allgather_coalesced_": Op("all_gather_coalesced", "gather", 0),
    "allgather_into_tensor_coalesced_": Op("all_gather_single", "gather", 0),
    "reduce_scatter_": Op("reduce_scatter", "scatter", 1),
    "_reduce_scatter_base_": Op("reduce_scatter_single", "scatter", 1),
    "reduce_scatter_tensor_coalesced_": Op("reduce_scatter_single", "scatter", 1),
    "reduce_": Op("reduce", "send", 0),
    "gather_": Op("gather", "send", 1),
    "scatter_": Op("scatter", "send", 1),
    "alltoall_": Op("all_to_all", "all_to_all", 1),
    "alltoall_base_": Op("all_to_all_single", "all_to_all", 1),
    "send": Op("send", "send", 0),
    "recv_": Op("recv", "none", 0),
    "recv_any_source_": Op("recv", "none", 0),
    "barrier": Op("barrier", "barrier", 0),
    "monitored_barrier_": Op("monitored_barrier", "barrier", 0),
}

#: ``torch.ops._c10d_functional.<name>`` -> the call, under its own name (an all-gather's payload is its input
#: times the group: :func:`dtlib.measure.counting.observing` multiplies it). ``_dtensor.shard_dim_alltoall``,
#: DTensor's all-to-all between two sharded dimensions, is one too.
FUNCTIONAL: dict[str, Op] = {
    "all_gather_into_tensor": Op("all_gather_into_tensor", "gather", 0),
    "all_gather_into_tensor_coalesced": Op("all_gather_into_tensor_coalesced", "gather", 0),
    "all_reduce": Op("all_reduce", "all_reduce", 0),
    "all_reduce_coalesced": Op("all_reduce_coalesced", "all_reduce", 0),
    "all_to_all_single": Op("all_to_all_single", "all_to_all", 0),
    "broadcast": Op("broadcast", "broadcast", 0),
    "reduce_scatter_tensor": Op("reduce_scatter_tensor", "scatter", 0),
    "reduce_scatter_tensor_coalesced": Op("reduce_scatter_tensor_coalesced", "scatter", 0),
    "shard_dim_alltoall": Op("shard_dim_alltoall", "all_to_all", 0),
}

#: The namespaces whose ops :data:`FUNCTIONAL` names (autograd's variant of ``all_to_all_single`` included).
FUNCTIONAL_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "_dtensor")


#: A ``torch.distributed`` function's older spelling -> the call it is under 2.13's names.
SPELLINGS = {"all_gather_into_tensor": "all_gather_single", "reduce_scatter_tensor": "reduce_scatter_single"}


def op_called(call: str) -> Op | None:
    """The :class:`Op` that ``torch.distributed.<call>`` dispatches, under either spelling, or None where it is no
    collective. Its ``payload`` is also the position of the buffer in the function's own arguments.
    Example: ``op_called("reduce_scatter_tensor").payload == 1`` (the input being reduced)."""
    call = SPELLINGS.get(call, call)
    return next((op for op in C10D.values() if op.call == call), None)


def op_of(namespace: str, name: str) -> Op | None:
    """The :class:`Op` of ``torch.ops.<namespace>.<name>``, or None where it moves nothing between ranks
    (``wait_tensor``, any other op)."""
    if namespace == "c10d":
        return C10D.get(name)
    if namespace in FUNCTIONAL_NAMESPACES:
        return FUNCTIONAL.get(name)
    return None
