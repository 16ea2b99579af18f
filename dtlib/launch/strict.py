"""NCCL's contract on gloo: code that passes only because gloo is lenient fails on a laptop, where you can see why.

gloo does more than NCCL promises. A rank's code that relies on the difference runs on a laptop and breaks on
GPUs. Strict mode holds a gloo job to what NCCL (and ``torch.distributed``'s documentation for it) promises:

- **reduce**: only ``dst`` holds the result. NCCL leaves the other ranks' tensors undefined; gloo leaves a sum
  there. Strict mode fills them with NaN (floating point) or the dtype's smallest value (integers).
- **async collectives** (``async_op=True``, and a ``ProcessGroup``'s own methods, ``group.allreduce([x])``,
  which are always async): the tensors a collective writes hold nothing you may read until ``wait()`` returns
  (NCCL writes them on its own stream, later). Strict mode runs the collective on copies, fills your tensors as
  above, and copies the results in when ``wait()`` returns, the work's future completes or ``is_completed()``
  says yes.
- **the stacked form** of ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` (the large tensor shaped
  ``(group size, *the small one's shape)``): NCCL takes it, as torch documents; gloo refuses it. Strict mode
  hands gloo a flat view of the same memory.
- **bitwise reductions** (``ReduceOp.BAND``, ``BOR``, ``BXOR``) and **receiving from any source**
  (``dist.recv`` without ``src``): gloo has them, NCCL does not. Strict mode refuses them.
- **``dist.monitored_barrier``** on a group that would be NCCL's on GPUs (the default one, or one made by
  ``dist.new_group`` without ``backend="gloo"``): torch implements it for gloo only and raises on NCCL. Strict
  mode refuses it there, as torch would on GPUs, and lets it run on a group made with ``backend="gloo"``.
- **sparse tensors**, which gloo reduces and NCCL refuses, and a send or receive of **int16, uint16, uint32 or
  uint64** (or the newest 8- and 4-bit floats), which gloo sends as bytes and NCCL has no type for: strict mode
  refuses them.
- **non-contiguous tensors** (a transpose, a slice with a step, ``x[:, 0]``) as a call's tensor, input or
  output: NCCL refuses them ("Tensors must be contiguous"); gloo reduces, broadcasts and gathers them through
  a copy, and refuses only some (a send). Strict mode refuses them, naming the argument. (Lists of tensors may
  hold views: NCCL's ``all_gather`` and ``reduce_scatter`` copy them through a flat buffer.)
- **tensors a GPU machine holds on the host** (made without ``device=``, or with ``.cpu()``), while
  :func:`dtlib.launch.host_tensors.watching` is on (every checker runs answers so): NCCL takes only tensors on
  the rank's GPU. Strict mode refuses them, naming the call that made them.
- **``batch_isend_irecv``'s works**: NCCL posts the batch as one group call and returns one work for it, gloo
  one work per transfer. Strict mode returns NCCL's one, so code that unpacks the list fails here too.
- **tags** (``tag=`` of ``send``, ``recv``, ``isend``, ``irecv`` and ``P2POp``): NCCL ignores them and matches
  a pair of ranks' messages in the order they were posted. Strict mode does the same (it passes tag 0 on) and
  warns (:class:`StrictWarning`) once per place in the code. It notes each tag as written: where an answer's
  values come out wrong and its tags disagree with NCCL's pairing, the checkers say so first, naming the pair
  (:func:`dtlib.launch.nccl_order.tags_disagree`); tags that only repeat the order posted pass, as NCCL runs them.
- **a blocking send and a blocking receive with one peer**, posted as separate calls, and **an ``isend`` or
  ``irecv`` posted while another of the rank's is still unwaited**: NCCL documents that dependent
  point-to-point calls must be posted together (``dist.batch_isend_irecv``); apart, NCCL runs them one after
  another, and a large message then waits for a receive that is queued behind it. Strict mode warns once per
  place in the code.

What one rank posts cannot tell whether the ranks' transfers, taken together, finish on NCCL (a ring where every
rank posts its ``isend`` before its ``irecv`` hangs there; an even/odd order does not), so strict mode also notes
each call it sees for :mod:`dtlib.launch.nccl_order`, which replays every rank's notes as NCCL runs them, and
:func:`unwaited` names the ``isend``, ``irecv`` and async collectives never waited for.

Only calls made from outside torch are held to it: torch's own (FSDP, DDP, DTensor) keep gloo's behaviour. So
do calls on a group made with ``dist.new_group(backend="gloo")``: that group is gloo's on a GPU machine too.
It is on in every gloo rank that ``dtlib.spawn`` or live ranks start (NCCL ranks need none);
``dtlib.spawn(..., strict=False)``, or ``DTLIB_STRICT=0`` in the environment, shows gloo's own behaviour instead.
Inside any gloo rank (under torchrun, say), :func:`nccl_contract` turns it on for a block.

Example (inside a gloo rank)::

    with nccl_contract():
        x = torch.ones(2)
        dist.reduce(x, dst=0)   # rank 1's x is now [nan, nan]: NCCL promises it nothing
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, distributed_c10d

from dtlib.launch import host_tensors, nccl_order

#: The environment variable that turns strict mode off in every gloo rank (``0``); unset or anything else: on.
STRICT_ENV = "DTLIB_STRICT"

#: Collective -> the names of its arguments that it writes (a tensor or a list of tensors).
WRITES = {
    "all_reduce": ("tensor",), "broadcast": ("tensor",), "reduce": ("tensor",),
    "all_gather": ("tensor_list",), "all_gather_into_tensor": ("output_tensor",),
    "all_gather_single": ("output_tensor",), "reduce_scatter": ("output",),
    "reduce_scatter_tensor": ("output",), "reduce_scatter_single": ("output",),
    "all_to_all_single": ("output",), "all_to_all": ("output_tensor_list",),
    "gather": ("gather_list",), "scatter": ("tensor",),
}
#: The single-tensor collectives whose large tensor NCCL also takes stacked, ``(group size, *the small one's
#: shape)``, as torch documents, where gloo takes only the concatenated form: (the large one, the small one).
STACKED = {"all_gather_into_tensor": ("output_tensor", "input_tensor"),
           "all_gather_single": ("output_tensor", "input_tensor"),
           "reduce_scatter_tensor": ("input", "output"), "reduce_scatter_single": ("input", "output")}
BITWISE = ("BAND", "BOR", "BXOR")
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep

_posted: list[Any] = []  # every isend, irecv and async collective strict mode handed out, until waited for


def _group_ranks(group: Any) -> tuple[int, ...]:
    """The global ranks of ``group`` (None: the default group), in order."""
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _op(kind: str, peer: int | None, group: Any, call: str, **details: Any) -> nccl_order.Op:
    """One op on ``group`` (None: the default group) as :mod:`dtlib.launch.nccl_order` replays it."""
    chosen = group if group is not None else dist.group.WORLD
    return nccl_order.Op(kind, peer, _group_ranks(group), call, comm=getattr(chosen, "group_name", ""), **details)


def unwaited() -> list[str]:
    """What the learner's code posted and never waited for, this process, in its words ("dist.isend to rank 1"):
    gloo finishes such work anyway, NCCL promises nothing until ``wait()``."""
    _posted[:] = [work for work in _posted if work.pending]
    return [work.what for work in _posted]


def _track(work: Any) -> Any:
    """Keep ``work`` (with ``pending`` and ``what``) among the posted until it is waited for; returns it."""
    _posted[:] = [posted for posted in _posted if posted.pending]
    _posted.append(work)
    return work


class StrictWarning(UserWarning):
    """Code that gloo runs and NCCL may not (a pattern NCCL documents as unsafe)."""


def poison(tensor: torch.Tensor) -> None:
    """Fill ``tensor`` with what reads as "undefined": NaN, or the dtype's smallest value for integers."""
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.fill_(float("nan"))
    elif tensor.dtype == torch.bool:
        tensor.fill_(True)
    else:
        tensor.fill_(torch.iinfo(tensor.dtype).min)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [item for item in value if isinstance(item, torch.Tensor)]
    return []


#: The code of wrappers that pass torch.distributed calls on (dtlib's counters and communication log): the code
#: that called them decides whether a call is torch's own.
_PASS_THROUGH: set[Any] = set()


def passes_through(wrapper: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``wrapper``, a function that wraps a ``torch.distributed`` call and passes it on, so that strict mode
    judges a call by whoever called the wrapper (FSDP's calls through a counter stay torch's own). A decorator."""
    _PASS_THROUGH.add(wrapper.__code__)
    return wrapper


# torch.distributed's functions hand themselves to a torch-function mode (has_torch_function), and the mode calls
# them again, by their module's name, which strict mode holds: that second call is torch's own, not a new one.
passes_through(host_tensors.HostTensors.__torch_function__)


def _called_from_torch() -> bool:
    """Whether the wrapped function's caller is torch's own code (FSDP, DDP, DTensor, checkpointing)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code in _PASS_THROUGH:
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(TORCH_DIR)


class DeferredWork:
    """A collective's work whose results reach the caller's tensors only when it is waited for.

    Everything else is the real work's (``is_completed``, ``exception``, ...).
    """

    def __init__(self, work: Any, finish: Callable[[], None], what: str = "") -> None:
        self._work = work
        self._finish = finish
        self._done = False
        self._claimed = False  # its future was asked for: whoever holds it orders what follows
        self.what = what

    @property
    def pending(self) -> bool:
        """Whether nobody has waited for it (nor asked for its future) yet."""
        return not (self._done or self._claimed)

    def _deliver(self) -> None:
        if not self._done:
            self._done = True
            self._finish()

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        result = self._work.wait(*args, **kwargs)
        self._deliver()
        return result

    def is_completed(self) -> bool:
        """The real work's answer; once it is yes, the results are the caller's to read, as NCCL's are once its
        work has completed (polling instead of waiting)."""
        completed = bool(self._work.is_completed())
        if completed:
            self._deliver()
        return completed

    def get_future(self) -> torch.futures.Future:
        def delivered(future: torch.futures.Future) -> Any:
            future.wait()
            self._deliver()
            return future.value()
        self._claimed = True
        return self._work.get_future().then(delivered)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _strict(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)
    writes = WRITES.get(name, ())

    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        if _called_from_torch():
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        if _gloo_group(arguments.get("group")):
            return original(*args, **kwargs)
        op = arguments.get("op")
        op_name = "" if op is None else getattr(op, "name", str(op).rsplit(".", 1)[-1])
        if op_name in BITWISE:
            raise ValueError(f"dist.{name} with {op}: NCCL has no bitwise reductions (gloo does). Use SUM, "
                             "PRODUCT, MIN, MAX or AVG, or reduce integers with MAX/MIN")
        _refuse_non_contiguous(name, arguments)
        host_tensors.refuse(name, arguments)
        _concatenated(name, arguments)
        nccl_order.note(_op(name, None, arguments.get("group"), name, reduce_op=op_name))
        rank = dist.get_rank()
        undefined_here = name == "reduce" and rank != _global_root(arguments, "dst")
        if not arguments.get("async_op"):
            result = original(*bound.args, **bound.kwargs)
            if undefined_here:
                poison(arguments["tensor"])
            return result
        # Async: the collective writes copies; the caller's tensors read as undefined until wait(). A broadcast's
        # source only reads its tensor: that stays readable (writing it before wait() is still a race).
        written = () if name == "broadcast" and rank == _global_root(arguments, "src") else writes
        theirs = [t for key in written for t in _tensors(arguments.get(key))]
        copies = {id(t): t.clone() for t in theirs}
        for key in written:
            value = arguments.get(key)
            if isinstance(value, torch.Tensor):
                arguments[key] = copies[id(value)]
            elif isinstance(value, (list, tuple)):
                arguments[key] = type(value)(copies.get(id(t), t) if isinstance(t, torch.Tensor) else t
                                             for t in value)
        work = original(*bound.args, **bound.kwargs)
        for tensor in theirs:
            poison(tensor)

        def finish() -> None:
            if not undefined_here:  # a reduce's non-root tensor stays undefined after wait() too
                for tensor in theirs:
                    tensor.copy_(copies[id(tensor)])
        return _track(DeferredWork(work, finish, f"dist.{name}(..., async_op=True)"))
    return collective


def _contiguous(tensor: torch.Tensor) -> bool:
    """Dense in a memory format NCCL accepts: row-major, or channels-last for 4-D and 5-D tensors."""
    layout = {4: torch.channels_last, 5: torch.channels_last_3d}.get(tensor.dim())
    return tensor.is_contiguous() or (layout is not None and tensor.is_contiguous(memory_format=layout))


def _refuse_non_contiguous(name: str, arguments: dict[str, Any]) -> None:
    """A ValueError naming the first tensor argument of ``dist.<name>`` that is not contiguous. Lists of tensors
    pass: NCCL's ``all_gather`` and ``reduce_scatter`` copy them through a flat buffer of their own."""
    for key, tensor in arguments.items():
        if isinstance(tensor, torch.Tensor) and tensor.layout != torch.strided:
            raise ValueError(f"dist.{name}: {key} is a {str(tensor.layout).removeprefix('torch.')} tensor, which "
                             "NCCL refuses (torch's NCCL group takes dense GPU tensors only), though gloo takes it. "
                             "Pass a dense one (t.to_dense())")
        if isinstance(tensor, torch.Tensor) and not _contiguous(tensor):
            raise ValueError(
                f"dist.{name}: {key} is not contiguous (shape {tuple(tensor.shape)}, strides {tensor.stride()}: "
                "a transpose, a slice with a step or a column). NCCL refuses it ('Tensors must be contiguous'), "
                "where gloo works on a copy. Pass a contiguous copy (t.contiguous()) "
                "and copy the result back where the call writes it")


#: The dtypes that gloo sends as bytes and NCCL has no type for (NCCLUtils.hpp's ``ncclDataType``): a send or a
#: receive of them raises on GPUs. gloo's collectives refuse them already.
NO_NCCL_TYPE = tuple(getattr(torch, name) for name in ("int16", "uint16", "uint32", "uint64", "float8_e8m0fnu",
                                                        "float4_e2m1fn_x2") if hasattr(torch, name))


def _refuse_dtype_nccl_lacks(name: str, tensor: Any) -> None:
    """A ValueError where ``dist.<name>`` sends or receives a tensor whose dtype NCCL has no type for."""
    if isinstance(tensor, torch.Tensor) and tensor.dtype in NO_NCCL_TYPE:
        dtype = str(tensor.dtype).removeprefix("torch.")
        raise ValueError(f"dist.{name}: the tensor is {dtype}, which NCCL has no type for: on GPUs torch raises "
                         f"before sending it, while gloo sends its bytes. Send int32 or int64 instead "
                         f"(t.to(torch.int64)), or the raw bytes (t.view(torch.uint8)) on both ends")


def _concatenated(name: str, arguments: dict[str, Any]) -> None:
    """Where ``dist.<name>``'s large tensor is in the stacked form NCCL takes (:data:`STACKED`), hand gloo a
    concatenated view of the same memory: the results land where the caller reads them."""
    large, small = STACKED.get(name, ("", ""))
    big, little = arguments.get(large), arguments.get(small)
    if (isinstance(big, torch.Tensor) and isinstance(little, torch.Tensor) and little.dim() >= 1
            and big.dim() == little.dim() + 1 and tuple(big.shape[1:]) == tuple(little.shape)
            and big.shape[0] == len(_group_ranks(arguments.get("group"))) and big.is_contiguous()):
        arguments[large] = big.flatten(0, 1)


def _global_root(arguments: dict[str, Any], key: str) -> int:
    """A rooted collective's root as a global rank: ``arguments[key]`` (``"src"``, ``"dst"``), or
    ``group_src``/``group_dst``, a rank within ``group``."""
    if arguments.get(f"group_{key}") is not None:
        return dist.get_global_rank(arguments.get("group") or dist.group.WORLD, arguments[f"group_{key}"])
    return arguments[key]


class _Batched:
    """The works of one ``batch_isend_irecv`` as the one work NCCL returns for them: NCCL posts the batch as one
    group call (``_coalescing_manager``) and returns a list of one work, gloo one work per transfer. Code that
    unpacks the list (``send_work, recv_work = dist.batch_isend_irecv(...)``) fails on a laptop as on GPUs."""

    def __init__(self, works: list[Any]) -> None:
        self._works = works

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return all([work.wait(*args, **kwargs) for work in self._works])  # every one waited, whatever the first says

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def get_future(self) -> torch.futures.Future:
        return torch.futures.collect_all([work.get_future() for work in self._works])

    def is_success(self) -> bool:
        """Torch's deprecated ``Work.is_success()``, kept for code that still calls it."""
        return all(work.is_success() for work in self._works)

    def exception(self) -> Any:
        """Torch's deprecated ``Work.exception()``, kept so that code calling it meets what torch's own work
        does: ``None`` or the error on 2.13, a ``TypeError`` on 2.11, which cannot convert the value."""
        return next((error for error in (work.exception() for work in self._works) if error is not None), None)

    def synchronize(self) -> None:
        for work in self._works:
            work.synchronize()

    def result(self) -> list[torch.Tensor]:
        return [tensor for work in self._works for tensor in work.result()]

    def source_rank(self) -> int:
        raise RuntimeError("the work of a dist.batch_isend_irecv has no source rank: NCCL returns one work for "
                           "the whole batch. Name each irecv's sender in its P2POp instead")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._works[-1], name)


class _Posted:
    """An unbatched ``isend``/``irecv``'s work: pending until it is waited for (or its future is)."""

    def __init__(self, work: Any, what: str) -> None:
        self._work = work
        self.pending = True
        self.what = what

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        result = self._work.wait(*args, **kwargs)
        self.pending = False
        return result

    def is_completed(self) -> bool:
        completed = bool(self._work.is_completed())
        self.pending = self.pending and not completed  # polled until done: as good as waited for
        return completed

    def get_future(self) -> torch.futures.Future:
        self.pending = False  # whoever holds the future orders what follows it
        return self._work.get_future()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


_warned: set[tuple[str, int, str]] = set()  # the places in the code strict mode has warned about, and of what


def _warn_once(kind: str, message: str) -> None:
    """A :class:`StrictWarning` of ``kind`` at the learner's line that called strict mode's caller, once there."""
    caller = sys._getframe(2)
    where = (caller.f_code.co_filename, caller.f_lineno, kind)
    if where not in _warned:
        _warned.add(where)
        warnings.warn(message, StrictWarning, stacklevel=3)


#: What a tag warning says after the call: how NCCL pairs messages, and what strict mode does about it.
_TAGS_IGNORED = ("NCCL ignores tags and matches two ranks' messages in the order they were posted; strict mode "
                 "does the same (tag 0). Post the sends and the receives in the same order on both ranks.")


def _size(tensor: Any) -> tuple[int, str, int] | None:
    """A transfer's tensor as :mod:`dtlib.launch.nccl_order` compares the two ends: elements, dtype and bytes."""
    if not isinstance(tensor, torch.Tensor):
        return None
    return tensor.numel(), str(tensor.dtype).removeprefix("torch."), tensor.numel() * tensor.element_size()


def _untagged(op: Any) -> Any:
    """A copy of the ``P2POp`` ``op`` with tag 0 (the learner's own stays as written)."""
    copy = object.__new__(type(op))
    copy.__dict__.update(vars(op), tag=0)
    return copy


class _PointToPoint:
    """Holds ``send``, ``recv``, ``isend`` and ``irecv`` to NCCL's contract: a named sender, contiguous tensors,
    tags ignored; and flags dependent calls posted apart (a blocking send and receive with one peer, or an
    unbatched ``isend``/``irecv`` posted while another is unwaited)."""

    def __init__(self) -> None:
        self.last: tuple[str, int] | None = None
        self.unwaited: list[_Posted] = []

    def wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)
        peer_key = "dst" if name in ("send", "isend") else "src"

        @functools.wraps(original)
        def point_to_point(*args: Any, **kwargs: Any) -> Any:
            if _called_from_torch():  # batch_isend_irecv's own calls among them: posted together
                return original(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            arguments = bound.arguments
            if _gloo_group(arguments.get("group")):
                return original(*args, **kwargs)
            peer = arguments.get(peer_key)
            if peer is None and arguments.get(f"group_{peer_key}") is not None:
                peer = dist.get_global_rank(arguments.get("group") or dist.group.WORLD, arguments[f"group_{peer_key}"])
            if name in ("recv", "irecv") and peer is None:
                raise ValueError(f"dist.{name} without src receives from any rank: gloo allows it, NCCL does not. "
                                 f"Name the sender: dist.{name}(tensor, src=...)")
            _refuse_non_contiguous(name, arguments)
            _refuse_dtype_nccl_lacks(name, arguments.get("tensor"))
            host_tensors.refuse(name, arguments)
            nccl_order.note(_op("send" if name in ("send", "isend") else "recv", peer, arguments.get("group"), name,
                                tag=arguments.get("tag") or 0, size=_size(arguments.get("tensor"))))
            if arguments.get("tag"):
                _warn_once("tag", f"dist.{name}(..., tag={arguments['tag']}): {_TAGS_IGNORED}")
                arguments["tag"] = 0
            if name in ("send", "recv"):
                if self.last is not None and self.last[1] == peer and self.last[0] != name:
                    _warn_once("apart", f"rank {dist.get_rank()} posted a blocking dist.{self.last[0]} and a "
                                    f"blocking dist.{name} with rank {peer} as two calls. NCCL documents that such "
                                    "dependent transfers can deadlock unless posted together: "
                                    "dist.batch_isend_irecv([dist.P2POp(dist.isend, ...), "
                                    "dist.P2POp(dist.irecv, ...)]) then wait() on each.")
                self.last = (name, peer)
                return original(*bound.args, **bound.kwargs)
            self.unwaited = [posted for posted in self.unwaited if posted.pending]
            if self.unwaited:
                _warn_once("unbatched", f"rank {dist.get_rank()} posted dist.{name} while an earlier isend or "
                                "irecv of its own was still unwaited. NCCL runs unbatched point-to-point calls one "
                                "after another: a large message then waits for a receive queued behind it, and "
                                "the ranks hang. Post them together: dist.batch_isend_irecv([dist.P2POp(dist.isend, "
                                "...), dist.P2POp(dist.irecv, ...)]) then wait() on each.")
            posted = _Posted(original(*bound.args, **bound.kwargs),
                             f"dist.{name} {'to' if name == 'isend' else 'from'} rank {peer}")
            self.unwaited.append(posted)
            return _track(posted)
        return point_to_point


#: ``ProcessGroup``'s collective methods, which code may call on a group directly (``dist.group.WORLD.allreduce(
#: [x])``): each is async whatever it is given, and writes its first argument (a tensor, a list of tensors or a
#: list of lists), except a broadcast's source and a send, which only read it. Held as an async ``dist`` call is:
#: what it writes reads as undefined until ``wait()`` (or ``is_completed()``), and work never waited for is named.
GROUP_METHODS = ("allreduce", "allreduce_coalesced", "allgather", "all_gather_single", "_allgather_base",
                 "allgather_into_tensor_coalesced", "reduce_scatter", "reduce_scatter_single",
                 "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base",
                 "all_to_all_single", "reduce", "gather", "scatter", "recv", "broadcast", "send")
_READ_ONLY = ("broadcast", "send")


def _group_method(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """``ProcessGroup.<name>`` held to NCCL's contract for an async collective, when called from outside torch."""

    @functools.wraps(original)
    def method(group: Any, *args: Any, **kwargs: Any) -> Any:
        if _called_from_torch() or not args or _gloo_group(group):
            return original(group, *args, **kwargs)
        what = f"ProcessGroup.{name}(...)"
        host_tensors.refuse(f"group.{name}", {"its tensors": args[0]})
        if name in _READ_ONLY:  # a broadcast's non-source ranks write: left readable, as the source's tensor is
            return _track(DeferredWork(original(group, *args, **kwargs), lambda: None, what))
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

        def copied(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                pairs.append((value, value.clone()))
                return pairs[-1][1]
            return type(value)(map(copied, value)) if isinstance(value, (list, tuple)) else value

        work = original(group, copied(args[0]), *args[1:], **kwargs)
        for theirs, _ in pairs:
            poison(theirs)

        def finish() -> None:
            for theirs, copy in pairs:
                theirs.copy_(copy)
        return _track(DeferredWork(work, finish, what))
    return method


_active: dict[str, Callable[..., Any]] = {}  # what install replaced, by name ("send", "P2POp.__init__")
#: The groups made with backend="gloo", gloo's on a GPU machine too, by name and identity (torch may give a name
#: again after a group is destroyed; ProcessGroup takes no weak reference).
_gloo_groups: set[tuple[str, int]] = set()


def _new_group(*args: Any, **kwargs: Any) -> Any:
    """torch's ``new_group``, the group's name kept where it names gloo as its backend."""
    original = _active["new_group"]
    group = original(*args, **kwargs)
    backend = inspect.signature(original).bind(*args, **kwargs).arguments.get("backend")
    if str(backend or "").lower() == "gloo" and isinstance(group, ProcessGroup):
        _gloo_groups.add((group.group_name, id(group)))
    return group


def _gloo_group(group: Any) -> bool:
    """Whether ``group`` was made with ``backend="gloo"``: gloo's on a GPU machine too, so its calls keep gloo's
    rules (host tensors, bitwise reductions, buffered sends) and stay out of NCCL's replay."""
    return isinstance(group, ProcessGroup) and (group.group_name, id(group)) in _gloo_groups


def _monitored_barrier(*args: Any, **kwargs: Any) -> Any:
    """torch's ``monitored_barrier``, refused on a group that is NCCL's on GPUs, as torch refuses it there."""
    original = _active["monitored_barrier"]
    group = inspect.signature(original).bind(*args, **kwargs).arguments.get("group")
    if (_called_from_torch() or group is dist.GroupMember.NON_GROUP_MEMBER  # torch's: a warning, no barrier
            or _gloo_group(group)):
        return original(*args, **kwargs)
    which = ("the default group" if group in (None, dist.group.WORLD)
             else "a group not made by dist.new_group(backend=\"gloo\")")
    raise ValueError(f"dist.monitored_barrier on {which}: torch implements it for gloo only, and on GPUs that group "
                     "is NCCL's, where it raises \"monitored_barrier is only implemented for GLOO backend\". Make "
                     "a gloo group for it once, on every rank: checker = dist.new_group(backend=\"gloo\"), then "
                     "dist.monitored_barrier(group=checker, timeout=...). Or use dist.barrier()")


def _original(op: Any) -> Any:
    """torch's own ``isend``/``irecv`` for strict mode's wrapper of it: ``P2POp`` accepts only torch's own (it
    compares by identity), and ``batch_isend_irecv`` posts them together, as NCCL needs."""
    for name in ("isend", "irecv"):
        if name in _active and op is getattr(dist, name):
            return _active[name]
    return op


def _p2p_op_new(cls: type, op: Any, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    group = kwargs.get("group", args[1] if len(args) > 1 else None)  # (op, tensor, peer, group, ...)
    # A pipeline schedule's own P2POps, and those on a gloo group, keep gloo's rules.
    if isinstance(tensor, torch.Tensor) and not _called_from_torch() and not _gloo_group(group):
        _refuse_non_contiguous("P2POp", {"tensor": tensor})
        _refuse_dtype_nccl_lacks("P2POp", tensor)
    return _active["P2POp.__new__"](cls, _original(op), tensor, *args, **kwargs)


def _p2p_op_init(self: Any, op: Any, *args: Any, **kwargs: Any) -> None:
    _active["P2POp.__init__"](self, _original(op), *args, **kwargs)


def _batch_isend_irecv(p2p_op_list: list[Any]) -> list[Any]:
    """torch's ``batch_isend_irecv``, its transfers noted as posted together (:mod:`dtlib.launch.nccl_order`) and
    its works kept until waited for."""
    original = _active["batch_isend_irecv"]
    ops = list(p2p_op_list)
    if _called_from_torch() or ops and all(_gloo_group(op.group) for op in ops):  # a schedule's own, or gloo's
        return original(p2p_op_list)
    kinds = ["send" if "send" in getattr(op.op, "__name__", "") else "recv" for op in ops]
    host_tensors.refuse("batch_isend_irecv", {f"the tensor of its i{kind}": op.tensor for kind, op in
                                              zip(kinds, ops, strict=True)})
    nccl_order.note(*(_op(kind, op.peer, op.group, f"batch_isend_irecv's i{kind}", tag=op.tag or 0,
                          size=_size(op.tensor)) for kind, op in zip(kinds, ops, strict=True)))
    if any(op.tag for op in ops):
        _warn_once("tag", f"dist.P2POp(..., tag={next(op.tag for op in ops if op.tag)}): {_TAGS_IGNORED}")
        ops = [_untagged(op) for op in ops]
    works = original(ops)
    return [_track(_Posted(works[0] if len(works) == 1 else _Batched(works), "the work of dist.batch_isend_irecv"))]


#: Where ``from torch.distributed import all_reduce`` finds the function, and where a pickled reference to it
#: (a cell's function shipped by value) is looked up: strict mode replaces the collectives and the blocking
#: transfers there too. Not ``isend``, ``irecv`` or ``batch_isend_irecv``: torch's own ``P2POp`` and
#: ``batch_isend_irecv`` compare their ops with that module's ``isend`` by identity.
_SOURCE = distributed_c10d
_ALSO_IN_SOURCE = (*WRITES, "send", "recv", "new_group", "monitored_barrier")


def install() -> bool:
    """Hold this process's later ``torch.distributed`` calls to NCCL's contract; False where it already is.

    The worker calls it before it unpickles the rank's function, so that the functions a cell imported by name
    (``from torch.distributed import reduce``) come back held to it too.
    """
    if _active:
        return False
    _warned.clear()
    point_to_point = _PointToPoint()
    for name in WRITES:
        if hasattr(dist, name):
            _active[name] = getattr(dist, name)
            setattr(dist, name, _strict(name, _active[name]))
    for name in ("send", "recv", "isend", "irecv"):
        _active[name] = getattr(dist, name)
        setattr(dist, name, point_to_point.wrap(name, _active[name]))
    _gloo_groups.clear()
    for name, replacement in (("new_group", _new_group), ("monitored_barrier", _monitored_barrier)):
        _active[name] = getattr(dist, name)
        setattr(dist, name, functools.wraps(_active[name])(replacement))
    for name in _ALSO_IN_SOURCE:
        if name in _active and getattr(_SOURCE, name, None) is _active[name]:
            _active[f"{_SOURCE.__name__}:{name}"] = _active[name]
            setattr(_SOURCE, name, getattr(dist, name))
    _active["P2POp.__new__"], _active["P2POp.__init__"] = dist.P2POp.__new__, dist.P2POp.__init__
    dist.P2POp.__new__, dist.P2POp.__init__ = _p2p_op_new, _p2p_op_init
    _active["batch_isend_irecv"] = dist.batch_isend_irecv
    dist.batch_isend_irecv = _batch_isend_irecv
    for name in GROUP_METHODS:
        if hasattr(ProcessGroup, name):
            _active[f"ProcessGroup.{name}"] = getattr(ProcessGroup, name)
            setattr(ProcessGroup, name, _group_method(name, _active[f"ProcessGroup.{name}"]))
    return True


def uninstall() -> None:
    """Give ``torch.distributed`` its own functions back."""
    for name, original in _active.items():
        module, _, name = name.rpartition(":")
        owner, _, attribute = name.rpartition(".")
        setattr(_SOURCE if module else {"P2POp": dist.P2POp, "ProcessGroup": ProcessGroup}.get(owner, dist),
                attribute, original)
    _active.clear()


def active() -> bool:
    """Whether strict mode holds this process's calls."""
    return bool(_active)


@contextlib.contextmanager
def nccl_contract() -> Iterator[None]:
    """Strict mode for a block of code inside a rank (a no-op where it is on already)."""
    started = install()
    try:
        yield
    finally:
        if started:
            uninstall()


def wanted(environ: dict[str, str] | None = None) -> bool:
    """Whether the environment leaves strict mode on (anything but ``DTLIB_STRICT=0``)."""
    return (environ if environ is not None else os.environ).get(STRICT_ENV, "1") != "0"
