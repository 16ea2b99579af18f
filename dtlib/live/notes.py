"""What each live rank notes of its collectives for the hang doctor (:mod:`dtlib.live.doctor`).

torch's Flight Recorder keeps a collective's group, number, tensors and stack. :class:`CallNotes` adds what it
leaves out (a root, a reduce op, split sizes, a group's ranks), says which call an error came from, and, under
torch's DETAIL mode, keeps the record itself: there the recorder names no group, mixes in the check's own
collectives and never sees a rank that waits in the check for a peer that does not come.
"""

from __future__ import annotations

import os
import sys
import time
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from dtlib.launch import strict
from dtlib.live.doctor import FR_BUFFER_SIZE

#: The ProcessGroup methods that torch.distributed's collectives call, one Flight Recorder record each.
COLLECTIVE_METHODS = ("allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather", "_allgather_base",
                      "all_gather_single", "allgather_coalesced", "allgather_into_tensor_coalesced",
                      "all_gather_single_coalesced", "gather", "scatter", "reduce_scatter", "_reduce_scatter_base",
                      "reduce_scatter_single", "reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced",
                      "alltoall", "alltoall_base", "all_to_all_single", "barrier")
_ROOTS = {"broadcast": "src", "scatter": "src", "reduce": "dst", "gather": "dst"}  # as torch.distributed names them
_SPLITS = ("all_to_all_single", "alltoall_base")  # (output, input, output_split_sizes, input_split_sizes, opts)
_C10D = os.sep + "distributed_c10d.py"


class CallNotes:
    """What a rank's Flight Recorder leaves out, noted as each collective starts, for the hang doctor.

    The recorder keeps a collective's group, number, tensors and stack, not its root (``src``, ``dst``), its
    reduce ``op``, its split sizes or its group's ranks. :meth:`install` wraps the ``ProcessGroup`` methods that
    every ``torch.distributed`` collective calls (the learner's calls and DDP's or FSDP's alike) to note them
    under the recorder's own ``(group name, number)``: a few microseconds a call. :meth:`raised_in` says which
    call an error came from. Example: after ``dist.broadcast(x, src=1)`` as collective #1 of the world,
    ``notes.arguments[("0", 1)]`` is ``(("src", "1"),)``.
    """

    def __init__(self, keep: int = FR_BUFFER_SIZE) -> None:
        self.arguments: dict[tuple[str, int], tuple[tuple[str, str], ...]] = {}  # the newest ``keep`` calls
        self.members: dict[str, tuple[int, ...]] = {}  # group name -> its ranks, by group rank
        self.raised: tuple | None = None  # the call the cell's error came from (:meth:`raised_in`)
        self.keep = keep
        self.detail = False  # torch's DETAIL mode: :meth:`entries` stands in for the Flight Recorder
        self.newest: dict[str, dict[str, Any]] = {}  # group name -> its newest call, as a recorder entry (DETAIL)
        self._failed: tuple[str, int, bool] | None = None  # the newest call, if it raised: group, number, started

    def install(self) -> None:
        """Note every later collective of this process (once: a second call changes nothing)."""
        self.detail = dist.get_debug_level() == dist.DebugLevel.DETAIL
        for name in COLLECTIVE_METHODS:
            original = getattr(ProcessGroup, name, None)
            if original is not None and not getattr(original, "dtlib_notes", None):
                setattr(ProcessGroup, name, self._wrap(name, original))

    def _wrap(self, name: str, original: Any) -> Any:
        @strict.passes_through  # strict mode judges the call by who called this note, torch's code or the cell's
        def noted(group: Any, *args: Any, **kwargs: Any) -> Any:
            self._failed = None
            entry = None
            try:
                key = self._note(name, group, args, kwargs)
                if self.detail:
                    entry = self._record(name, group, args, key)
            except Exception:  # noqa: BLE001 - a note is never worth failing the learner's call
                key = None
            try:
                work = original(group, *args, **kwargs)
            except BaseException:
                if key is not None:  # started: the group's number moved on, so the recorder has it
                    self._failed = (*key, group._get_sequence_number_for_group() >= key[1])
                if entry is not None:
                    entry["retired"] = True
                raise
            if entry is not None:
                _retire_when_done(entry, work)
            if key is not None:  # gloo runs some calls as several collectives (reduce_scatter of a list: two)
                for number in range(key[1] + 1, group._get_sequence_number_for_group() + 1):
                    self._keep((key[0], number), self.arguments.get(key, ()))
            return work

        noted.dtlib_notes = self  # type: ignore[attr-defined]
        return noted

    def _note(self, name: str, group: Any, args: tuple, kwargs: dict) -> tuple[str, int]:
        """Note what the call carries beside tensors under the number the recorder will give it."""
        # gloo: the group's sequence number is the recorder's collective_seq_id (tests/live/test_doctor.py). GPU run
        # must confirm the same of NCCL (its seqCollective_): a note under a wrong number would give a record another
        # call's root or op (Collective.fields shows only what each call takes, which narrows that, no more).
        key = (group.group_name, group._get_sequence_number_for_group() + 1)
        members = self.members.get(key[0])
        if members is None:
            members = self.members[key[0]] = tuple(dist.get_process_group_ranks(group))
        options = next((value for value in (*args, *kwargs.values()) if type(value).__name__.endswith("Options")),
                       None)
        noted = []
        if name in _ROOTS and options is not None:
            noted.append((_ROOTS[name], str(members[options.rootRank])))  # a group rank -> the global rank
        reduce_op = getattr(options, "reduceOp", None)
        if reduce_op is not None:
            noted.append(("op", getattr(getattr(reduce_op, "op", reduce_op), "name", str(reduce_op))))
        if name in _SPLITS and len(args) >= 4:
            noted += [("output_split_sizes", str(list(args[2]) or None)),
                      ("input_split_sizes", str(list(args[3]) or None))]  # [] (None in the call): equal pieces
        self._keep(key, tuple(noted))
        return key

    def _keep(self, key: tuple[str, int], noted: tuple[tuple[str, str], ...]) -> None:
        self.arguments[key] = noted
        while len(self.arguments) > self.keep:  # as the recorder does, forget the oldest
            del self.arguments[next(iter(self.arguments))]

    def _record(self, name: str, group: Any, args: tuple, key: tuple[str, int]) -> dict[str, Any]:
        """The call as the Flight Recorder would have recorded it (the fields :mod:`dtlib.live.doctor` reads)."""
        inputs, outputs = _tensors(name, args)
        entry = {"process_group": (key[0], getattr(group, "group_desc", "") or key[0]),
                 "profiling_name": name, "collective_seq_id": key[1], "time_created_ns": time.monotonic_ns(),
                 "frames": [{"filename": _C10D, "name": call} for call in [_outermost_call()] if call],
                 "input_sizes": [list(t.shape) for t in inputs], "input_dtypes": [_dtype(t) for t in inputs],
                 "retired": False}
        if outputs is not None:
            entry |= {"output_sizes": [list(t.shape) for t in outputs], "output_dtypes": [_dtype(t) for t in outputs]}
        self.newest[key[0]] = entry
        return entry

    def entries(self) -> list[dict[str, Any]] | None:
        """Under DETAIL, each group's newest call in the Flight Recorder's format; otherwise None (the recorder's
        own dump is right). Example: ``[{"process_group": ("0", "default_pg"), "collective_seq_id": 3, ...}]``."""
        return [dict(entry) for entry in list(self.newest.values())] if self.detail else None

    def raised_in(self, error: BaseException) -> tuple | None:
        """``(call, group name, group, number, started, exception type)`` when ``error`` came from inside a
        torch.distributed call, else None. ``started``: gloo or NCCL began it (the recorder has it)."""
        frames = [tb for tb in _tracebacks(error.__traceback__) if tb.tb_frame.f_code.co_filename.endswith(_C10D)]
        if not frames:
            return None
        inner = frames[-1].tb_frame.f_locals  # the function that called the process group
        group = inner.get("group")
        if not isinstance(group, dist.ProcessGroup):
            group = dist.group.WORLD
        now = group._get_sequence_number_for_group()
        failed, self._failed = self._failed, None
        if failed is not None and failed[0] == group.group_name:
            number, started = failed[1], failed[2]  # raised inside the process group's method
        else:  # a work to wait on: gloo or NCCL started it; none: it raised before
            number, started = (now, True) if inner.get("work") is not None else (now + 1, False)
        return (frames[0].tb_frame.f_code.co_name, group.group_name, getattr(group, "group_desc", ""), number,
                started, type(error).__qualname__)


def _tracebacks(tb: TracebackType | None) -> list[TracebackType]:
    found = []
    while tb is not None:
        found.append(tb)
        tb = tb.tb_next
    return found




_OUTPUTS_FIRST = {"allgather", "_allgather_base", "all_gather_single", "allgather_coalesced",
                  "allgather_into_tensor_coalesced", "all_gather_single_coalesced", "reduce_scatter",
                  "_reduce_scatter_base", "reduce_scatter_single", "reduce_scatter_tensor_coalesced",
                  "reduce_scatter_single_coalesced", "alltoall", "alltoall_base", "all_to_all_single"}


def _tensors(name: str, args: tuple) -> tuple[list[Any], list[Any] | None]:
    """A ProcessGroup call's input tensors and output tensors (None where ranks differ by design)."""
    def flat(value: Any) -> list[Any]:
        if isinstance(value, torch.Tensor):
            return [value]
        if isinstance(value, list | tuple):
            return [t for item in value for t in flat(item)]
        return []

    if name in _OUTPUTS_FIRST and len(args) >= 2:
        return flat(args[1]), flat(args[0])
    if name == "gather" and len(args) >= 2:  # outputs only on dst
        return flat(args[1]), None
    if name == "scatter" and args:  # inputs only on src
        return flat(args[0]), None
    return (flat(args[0]), flat(args[0])) if args else ([], [])  # in place: all_reduce, broadcast, reduce


def _dtype(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _outermost_call() -> str:
    """The torch.distributed function that the learner's code called: the outermost ``distributed_c10d`` frame."""
    frame, found = sys._getframe(2), ""
    while frame is not None:
        if frame.f_code.co_filename.endswith(_C10D):
            found = frame.f_code.co_name
        frame = frame.f_back
    return found


def _retire_when_done(entry: dict[str, Any], work: Any) -> None:
    """Mark ``entry`` retired once ``work`` completes (at once where its future cannot be had)."""
    # GPU run must confirm: under NCCL with DETAIL, the work's future completes when the GPU finishes it (so a
    # rank whose GPU waits in an all-reduce reads "waits"), and DETAIL's gloo helper group starts beside NCCL.
    try:
        work.get_future().add_done_callback(lambda _: entry.__setitem__("retired", True))
    except Exception:  # noqa: BLE001 - no future: say done rather than "waits" for ever
        entry["retired"] = True
