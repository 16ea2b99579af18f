"""A live rank's side of stepping (``%%ranks --step``): pause just before each collective, say which one.

Every collective reaches torch's dispatcher as an op, whoever issues it: ``c10d`` ops for ``torch.distributed``'s
calls (``dist.all_reduce``, ``dist.send``, ``dist.barrier``...), DDP's reducer, FSDP2's hooks and DTensor's
redistributions, and ``_c10d_functional`` ops for the functional collectives. :class:`PauseBeforeCollectives`, a
``TorchDispatchMode``, sees each such op before it runs, describes it as a :class:`Call` (what, on which group,
which tensors, from which line of the cell) and hands it to a pause, which answers the kernel and waits for its
next command (:class:`Pauses`, used by :mod:`dtlib.live.server`). Nothing is sent to a peer before the pause
returns.

Seen on the CPU (tests/live/test_stepping.py): ``torch.distributed``'s collectives and point-to-point calls,
DDP's bucket all-reduces in backward, the functional collectives, DTensor's (those its op handlers run too, as
an add of a row-sharded and a column-sharded tensor does). GPU run must confirm: DDP's
reducer on CUDA runs its all-reduce from the autograd engine's device thread, which a dispatch mode reaches only
if torch carries the mode's thread-local state there.
"""

from __future__ import annotations

import ast
import linecache
import os
import pickle
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dtlib import calls, compat

#: The dispatcher's c10d op -> the torch.distributed call a learner knows it by, as every observer names it
#: (:data:`dtlib.calls.C10D`).
C10D_CALLS = {name: op.call for name, op in calls.C10D.items()}
_NOT_COLLECTIVES = {"wait_tensor", "_wrap_tensor_autograd"}  # _c10d_functional ops that move nothing
_ROOTS = {"broadcast": "src", "scatter": "src", "reduce": "dst", "gather": "dst", "send": "dst", "recv": "src"}
_ROOT_ARGUMENTS = ("root_rank", "dstRank", "srcRank", "src", "dst")
_P2P_CALLS = {"send", "recv", "isend", "irecv", "send_object_list", "recv_object_list"}
#: Calls whose tensors differ between ranks by design (a root's list, split sizes): their shapes are not compared.
UNEQUAL_TENSORS = {"gather", "scatter", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier"}
_PLUMBING = (os.sep + os.path.join("torch", "_ops.py"), os.path.join("utils", "_python_dispatch.py"),
             os.path.join("distributed", "c10d_logger.py"), os.path.join("dtlib", "live", "stepper.py"),
             os.path.join("_dynamo", "eval_frame.py"), os.path.join("torch", "_compile.py"),
             os.path.join("utils", "_contextlib.py"), os.path.join("_library", "autograd.py"),
             os.path.join("dtlib", "live", "notes.py"), os.path.join("dtlib", "launch", "strict.py"),
             "distributed_c10d.py")  # wrappers, not issuers
_WRAPPERS = {"__call__", "wrapper", "inner", "_fn", "decorate_context"}  # decorators' names, not the issuer's


@dataclass(frozen=True)
class Call:
    """One collective a rank is about to run, as the stepper shows it.

    ``index``: this rank's collective number in the cell, from 1. ``op``: the torch.distributed name
    (``"all_reduce"``, ``"isend"``; ``"all_reduce (functional)"`` for a functional collective; DDP's reducer's
    under the dispatcher's name, as no torch.distributed function made them). ``members``: the group's global
    ranks. ``tensors``: ``"float32[4]"`` per tensor. ``root``: the global rank of ``src`` or ``dst`` (the peer of a
    send or recv), ``root_name`` which of the two. ``line``: ``"<rank cell 3>:5"`` and ``source`` its text;
    ``issuer``: the innermost frame of torch or dtlib that issued it (``"torch/distributed/tensor/... in
    mesh_scatter"``), empty when the cell called torch.distributed itself.
    """

    index: int
    op: str
    group: str
    members: tuple[int, ...]
    tensors: tuple[str, ...] = ()
    root: int | None = None
    root_name: str = ""
    reduce_op: str = ""
    splits: str = ""
    line: str = ""
    source: str = ""
    issuer: str = ""
    transfer: str = ""
    kind: str = ""  # the dispatcher's op (``c10d.allreduce_``): one per collective, whatever name called it
    async_op: bool = False  # returns before its peers arrive: ``async_op=True``, or a functional collective

    @property
    def p2p(self) -> bool:
        """A point-to-point call: ``transfer`` says which end (``"send"`` or ``"recv"``)."""
        return bool(self.transfer)

    @property
    def peers(self) -> tuple[int, ...]:
        """The ranks this call needs: a send's or recv's peer (every member for a recv from any source), else
        the group's members."""
        if self.p2p and self.root is not None:
            return (self.root,)
        return self.members

    def elements(self) -> tuple[int, ...]:
        """Each tensor's number of elements: ``("float32[108]", "float32[54]")`` -> ``(108, 54)``."""
        counts = []
        for tensor in self.tensors:
            count = 1
            for size in tensor.split("[", 1)[-1].rstrip("]").split(","):
                count *= int(size) if size.strip() else 1
            counts.append(count)
        return tuple(counts)

    def details(self, every: bool = False) -> str:
        """``SUM, float32[4]``: the root, reduce op, split sizes and tensors, as far as the call has them (the
        first three tensors, or ``every`` one)."""
        shown = self.tensors if every else self.tensors[:3]
        extras = [f"{self.root_name}={self.root}" if self.root_name and self.root is not None else "",
                  self.reduce_op, self.splits, ", ".join(shown) + (" …" if len(self.tensors) > len(shown) else "")]
        return ", ".join(extra for extra in extras if extra)

    def what(self, every: bool = False) -> str:
        """``all_reduce #2 (SUM, float32[4])``: the call in one phrase (``every``: with all its tensors)."""
        details = self.details(every)
        return f"{self.op} #{self.index}" + (f" ({details})" if details else "")


def _tensor_text(tensor: torch.Tensor) -> str:
    """``float32[4]``; a complex tensor as the cell passed it, though c10d sends its real view (``complex64[2]``,
    not ``float32[2, 2]``)."""
    base = tensor._base
    if base is not None and base.is_complex() and tuple(tensor.shape) == (*base.shape, 2):
        tensor = base
    return f"{str(tensor.dtype).removeprefix('torch.')}[{', '.join(str(size) for size in tensor.shape)}]"


def _flat(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [tensor for item in value for tensor in _flat(item)]
    return []


def _group(bound: dict[str, Any]) -> Any:
    """The op's process group: a boxed one (c10d ops) or a name (functional ones)."""
    boxed = bound.get("process_group")
    if isinstance(boxed, torch.ScriptObject):
        return dist.ProcessGroup.unbox(boxed)
    name = bound.get("group_name")
    if isinstance(name, str):
        return distributed_c10d._resolve_process_group(name)
    return None


def _where(frame: FrameType | None) -> tuple[str, str, str, str, bool]:
    """The innermost line of the learner's cell (``<rank cell 3>:5``, its source), the innermost torch or
    dtlib frame below it (the one that issued the collective), the torch.distributed function called: the
    outermost one (``send``, which calls ``isend``), or the innermost inside ``batch_isend_irecv``; and whether
    that outermost one was called with ``async_op=True``."""
    line = source = issuer = ""
    calls: list[str] = []
    async_op = False
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.endswith("distributed_c10d.py") and not frame.f_code.co_name.startswith("_"):
            calls.append(frame.f_code.co_name)
            async_op = frame.f_locals.get("async_op") is True
        if filename.startswith("<rank cell"):
            line = f"{filename}:{frame.f_lineno}"
            source = linecache.getline(filename, frame.f_lineno).strip()
            break
        if not issuer and not filename.endswith(_PLUMBING) and frame.f_code.co_name not in _WRAPPERS:
            for package in ("torch", "dtlib"):
                marker = os.sep + package + os.sep
                if marker in filename:
                    issuer = (f"{package}/{filename.rsplit(marker, 1)[1]} in "
                              f"{compat.current_name(frame.f_code.co_name)}")  # no line: the line moves with
                    # every torch release, the file and function rarely (a renamed one: as 2.13 names it)
                    break
        frame = frame.f_back
    called = "" if not calls else calls[0] if calls[-1] == "batch_isend_irecv" else calls[-1]
    return line, source, issuer, called, async_op


def describe(func: Any, args: tuple, kwargs: dict[str, Any], index: int, frame: FrameType | None) -> Call:
    """The :class:`Call` that the dispatcher's collective op ``func`` makes with ``args``."""
    names = [argument.name for argument in func._schema.arguments]
    bound = dict(zip(names, args, strict=False)) | kwargs  # trailing defaults may be left out
    functional = func.namespace == "_c10d_functional"
    op = f"{func._opname} (functional)" if functional else C10D_CALLS.get(func._opname, func._opname)
    base = op.removesuffix(" (functional)")
    group = _group(bound)
    members = tuple(dist.get_process_group_ranks(group)) if group is not None else ()
    root = next((bound[name] for name in _ROOT_ARGUMENTS if isinstance(bound.get(name), int)), None)
    if root is not None and 0 <= root < len(members):
        root = members[root]  # the ops take the rank within the group
    reduce_op = bound.get("reduce_op")
    if isinstance(reduce_op, torch.ScriptObject):
        reduce_op = dist.ReduceOp.RedOpType(reduce_op.op()).name
    splits = ""
    if "output_split_sizes" in bound or "input_split_sizes" in bound:
        out, into = (list(bound.get(name) or []) for name in ("output_split_sizes", "input_split_sizes"))
        splits = f"splits out {out} in {into}"
    tensors = tuple(_tensor_text(tensor) for name, value in bound.items() if name != "sparse_indices"
                    for tensor in _flat(value))
    if base in ("barrier", "monitored_barrier"):
        tensors = ()  # gloo's barriers carry a placeholder tensor of their own
    line, source, issuer, called, async_op = _where(frame)
    transfer = base if base in ("send", "recv") else ""
    if called and not functional and (not transfer or called in _P2P_CALLS):
        op = called  # as the cell called it: isend rather than send, all_gather_object rather than all_gather
        if issuer:  # torch's own call (FSDP's), under the name the course teaches: 2.11's all_gather_into_tensor
            op = compat.current_name(op)
    return Call(index, op, getattr(group, "group_name", "?"), members, tensors, root,
                _ROOTS.get(base, "") if root is not None else "", str(reduce_op or "").upper(), splits,
                line, source, issuer, transfer, f"{func.namespace}.{func._opname}", async_op or functional)


def _dtensor_in(types: Any) -> bool:
    """Whether a DTensor takes part in the op: DTensor's handler must run first (``NotImplemented``, as
    ``CommDebugMode`` answers), so that the collectives it desugars the op into come back through the mode.
    Without DTensor's module loaded there is no DTensor."""
    tensor = sys.modules.get("torch.distributed.tensor")
    return tensor is not None and tensor.DTensor in types


def is_collective(func: Any) -> bool:
    """Whether the dispatcher's op ``func`` is a collective or a point-to-point transfer."""
    namespace = getattr(func, "namespace", "")
    return (namespace == "c10d" and func._opname in C10D_CALLS) or (
        namespace == "_c10d_functional" and func._opname not in _NOT_COLLECTIVES)


class PauseBeforeCollectives(TorchDispatchMode):
    """Calls ``pause(call, frame)`` just before each collective that runs under it, then runs the collective.

    Every op of the cell passes through Python while it is on: a cell steps at the speed of a lesson, not a job.
    """

    def __init__(self, pause: Callable[[Call, FrameType | None], None]) -> None:
        super().__init__()
        self.pause = pause
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if _dtensor_in(types):  # a DTensor op: its redistributions come back here as collectives of their own
            return NotImplemented
        kwargs = kwargs or {}
        if is_collective(func):
            self.count += 1
            if getattr(self.pause, "stepping", True):  # after continue it counts, and describes nothing
                frame = sys._getframe(1)
                self.pause(describe(func, args, kwargs, self.count, frame), frame)
        return func(*args, **kwargs)


class RefuseCollectives(TorchDispatchMode):
    """Raises instead of running a collective: ``%ranks peek`` looks, and sends nothing (a collective run by one
    paused rank would wait for peers that are paused, or run a call the learner has not stepped to)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if _dtensor_in(types):
            return NotImplemented
        if is_collective(func):
            raise RuntimeError(f"peek only looks: {describe(func, args, kwargs or {}, 0, None).op} is a collective, "
                               "and a paused rank sends nothing. Step to it, or run it in a cell")
        if _unwaited((args, kwargs)) or (getattr(func, "namespace", "") == "_c10d_functional"
                                         and func._opname == "wait_tensor"):
            raise RuntimeError(UNWAITED)
        return func(*args, **(kwargs or {}))


#: Why peek refuses a functional collective's result that no one has waited for.
UNWAITED = ("peek only looks: this value is a functional collective's result, and reading it waits until every rank "
            "has finished that collective, which a paused peer may never do. Step on until the cell reads it, then "
            "peek")


def _unwaited(values: Any) -> bool:
    """Whether ``values`` hold a functional collective's result not yet waited for (an ``AsyncCollectiveTensor``
    whose wait has not run): reading it, or sending it, waits for the collective on every rank."""
    functional = sys.modules.get("torch.distributed._functional_collectives")
    waiting = getattr(functional, "AsyncCollectiveTensor", None)
    return waiting is not None and any(isinstance(value, waiting) and not value.completed
                                       for value in tree_leaves(values))


class StepAborted(BaseException):
    """Raised inside a paused rank by ``%ranks abort``: a BaseException, so that a cell's ``except Exception``
    cannot swallow it."""


@dataclass
class Pauses:
    """The rank's pause before each collective: answer the kernel ``"paused"`` with the :class:`Call`, then take
    commands until one moves on.

    Commands while paused: ``"step"`` (on to the next collective), ``"continue"`` (to the cell's end without
    pausing), ``"abort"`` (:class:`StepAborted` unwinds the cell), ``"peek"`` (an expression evaluated in the
    paused frame, answered at once) and ``"pull"``. ``number`` is the command whose answer this rank owes: the
    cell's end answers it too.
    """

    commands: Connection
    number: int
    answer: Callable[[Any], bytes]
    stepping: bool = True
    namespace: dict[str, Any] = field(default_factory=dict)

    def __call__(self, call: Call, frame: FrameType | None) -> None:
        if not self.stepping:
            return
        self._send("paused", pickle.dumps(call))
        while True:
            self.number, kind, body = pickle.loads(self.commands.recv_bytes())
            if kind == "step":
                return
            if kind == "continue":
                self.stepping = False
                return
            if kind == "abort":
                raise StepAborted(f"aborted before {call.what()}, by %ranks abort")
            if kind == "exit":
                sys.stdout.flush()
                os._exit(0)  # the kernel is closing the ranks: the cell's frames go with the process
            if kind in ("peek", "pull"):
                self._send(*self.look(kind, body, frame))
            else:
                self._send("error", {"type": "RuntimeError", "module": "builtins", "traceback": "",
                                     "message": f"a cell is paused on this rank: {kind!r} must wait until it ends"})

    def look(self, kind: str, body: str, frame: FrameType | None) -> tuple[str, Any]:
        """``peek``: ``body`` evaluated in ``frame`` (the cell's innermost frame, locals included); ``pull``: a
        name of the rank's namespace."""
        cell = frame
        while cell is not None and not cell.f_code.co_filename.startswith("<rank cell"):
            cell = cell.f_back
        try:
            if kind == "pull":
                if body not in self.namespace:
                    raise NameError(f"name {body!r} is not defined on this rank")
                return "ok", self.answer(self.namespace[body])
            if any(isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "wait"
                   for node in ast.walk(ast.parse(body, mode="eval"))):
                raise RuntimeError("peek only looks: .wait() waits until every rank has finished the collective "
                                   "the work belongs to, which a paused peer may never do. Step on until the cell "
                                   "waits, then peek")
            scope = cell if cell is not None else None
            global_names = scope.f_globals if scope is not None else self.namespace
            local_names = dict(scope.f_locals) if scope is not None else {}
            with RefuseCollectives():
                value = eval(body, global_names, local_names)  # noqa: S307 - the learner's expression
            if _unwaited(value):  # sent back as it is, it would be read: the same wait
                raise RuntimeError(UNWAITED)
            return "ok", self.answer(value)
        except Exception as exc:  # noqa: BLE001 - the learner's expression failed: say so, stay paused
            return "error", {"type": type(exc).__qualname__, "module": type(exc).__module__, "traceback": "",
                             "message": str(exc)}

    def _send(self, status: str, body: Any) -> None:
        sys.stdout.flush()  # what the cell printed before the pause reaches the kernel first
        sys.stderr.flush()
        self.commands.send_bytes(pickle.dumps((self.number, status, body)))
