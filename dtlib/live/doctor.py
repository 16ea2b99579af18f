"""The hang doctor: which collective each live rank is in, and where the ranks disagree.

Each rank's record comes from torch's own Flight Recorder (``TORCH_FR_BUFFER_SIZE``), which notes every
collective a process group starts: its number in the group, the group, the Python stack that called it (so
gloo's ``all_reduce`` that runs a ``reduce_scatter_tensor`` is named as the call you wrote), its tensors' sizes
and dtypes, and whether it has finished. What the recorder leaves out (a broadcast's ``src``, a reduce's ``dst``
and ``op``, an all-to-all's split sizes, the ranks of a group) each rank notes as the collective starts
(:class:`dtlib.live.notes.CallNotes`), under the same group and number; a rank that raised inside a call says
which. A rank answers :func:`last_collectives` from a thread of its own, so it answers even while its main
thread waits inside gloo or NCCL.

gloo and NCCL keep separate recorders (``_dump_fr_trace`` and, in CUDA builds, ``_dump_nccl_trace``,
the same format). Under NCCL a collective or a send only queues work on the GPU and returns, so the
CPU runs ahead: the rank is stuck in its oldest unfinished NCCL record, not its newest, and a
send or recv is recorded (gloo's recorder notes none). Where NCCL's recorder cannot be read, the
doctor says that it has no record rather than judge from the CPU's stack alone.

:func:`explain` turns the ranks' answers into one line per rank and a verdict, e.g. *rank 0 waits in
all_reduce #3 (float32[4]); rank 1 finished the cell after all_reduce #2: rank 0 is alone in collective #3*.
It compares every field of the collective across the ranks that reached it (finished, waiting or raised
inside it), says "the same arguments" only when every field was recorded and matched, and names the rest.

Used by :class:`dtlib.LiveRanks` (:mod:`dtlib.live.ranks`) and, in each rank, :mod:`dtlib.live.server`.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, replace
from typing import Any

import torch.distributed as dist

from dtlib.errors import C10_DTYPES, torch_call_in

#: How many collectives each rank's Flight Recorder keeps (a ring buffer; ~1 KB each).
FR_BUFFER_SIZE = 2000
#: The environment that keeps the recorder on, with room for FR_BUFFER_SIZE records, whatever the job's own
#: environment says (0 would switch it off; torch 2.13 records by default).
FR_ENV = {"TORCH_FR_BUFFER_SIZE": str(FR_BUFFER_SIZE)}

#: gloo's and NCCL's names for what they ran -> the torch.distributed call, where the recorder kept no Python
#: stack that names the call itself (gloo runs every reduce-scatter as an "all_reduce": only the stack tells).
_PROFILING_CALLS = {"_allgather_base": "all_gather_into_tensor", "_all_gather_base": "all_gather_into_tensor",
                    "_reduce_scatter_base": "reduce_scatter_tensor", "all_reduce_barrier": "barrier",
                    "_broadcast_oop": "broadcast", "_reduce_oop": "reduce",
                    "allreduce_coalesced": "all_reduce_coalesced"}
#: The arguments beside tensors and group that every rank must pass alike, and the calls that take each.
ARGUMENTS = {"src": {"broadcast", "scatter", "broadcast_object_list", "scatter_object_list"},
             "dst": {"reduce", "gather", "gather_object"},
             "op": {"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
                    "all_reduce_coalesced"},
             "input_split_sizes": {"all_to_all_single"}, "output_split_sizes": {"all_to_all_single"}}
_SAID = {"tensors": "tensors", "outputs": "output sizes", "group": "group"}  # a field, as a learner says it


@dataclass(frozen=True)
class Collective:
    """One collective as a rank's Flight Recorder saw it, with what the rank noted beside it.

    Example: ``Collective("all_reduce", 3, "default_pg", ("float32[4]",), done=False).describe()``
    is ``"all_reduce #3 (float32[4])"``.
    """

    op: str  # the torch.distributed call: "reduce_scatter_tensor", not gloo's "all_reduce"
    seq: int  # the group's collective number (point-to-point calls count separately)
    group: str  # "default_pg" for the world
    tensors: tuple[str, ...]  # "float32[4]" per input tensor
    done: bool  # False: the rank started it and has not got past it
    recorded: bool = True  # False: a stand-in where NCCL's Flight Recorder could not be read (NO_NCCL_RECORD)
    outputs: tuple[str, ...] | None = None  # per output tensor; None: not recorded
    members: tuple[int, ...] | None = None  # the group's ranks, by group rank; None: not recorded
    arguments: tuple[tuple[str, str], ...] | None = None  # (("src", "1"),) as ARGUMENTS names them; None: not noted
    raised: str = ""  # the exception's type when this rank raised inside this call
    started: bool = True  # False: it raised before gloo or NCCL started it (no Flight Recorder record)
    group_id: str = ""  # the recorder's name of the group ("0" for the world); "" in records made by hand
    others: tuple[Collective, ...] = ()  # this rank's newest record on each other group

    def describe(self, number: bool = True, show: tuple[str, ...] = ()) -> str:
        """The call as a line says it; ``show`` adds those fields (``"outputs"``, ``"src"``, ...)."""
        where = "" if self.group == "default_pg" else f" on group {self.group_label()}"
        args = [", ".join(self.tensors)] if self.tensors else []
        if "outputs" in show and self.outputs is not None:
            args = [" -> ".join([", ".join(self.tensors) or "-", ", ".join(self.outputs) or "-"])]
        noted = dict(self.arguments or ())
        args += [f"{name}={noted[name]}" for name in show if name in noted]
        listed = f" ({', '.join(args)})" if args else ""
        return f"{self.op}{f' #{self.seq}' if number else ''}{listed}{where}"

    def group_label(self) -> str:
        """``"[0, 1]"`` (its ranks), ``"tp [0, 1]"`` with a description, else the recorder's name."""
        ranks = "" if self.members is None else f"[{', '.join(map(str, self.members))}]"
        name = "" if self.group in ("undefined", "default_pg", "") else self.group
        return " ".join(part for part in (name, ranks) if part) or self.group_id or self.group

    def fields(self) -> dict[str, str | None]:
        """Every field two ranks' calls of one collective must agree on; None where it was not recorded."""
        found: dict[str, str | None] = {"call": self.op, "tensors": ", ".join(self.tensors)}
        if self.outputs is not None:
            found["outputs"] = ", ".join(self.outputs)
        world = self.group == "default_pg" and self.members is None  # by hand: the world, whoever is in it
        found["group"] = "world" if world else None if self.members is None else self.group_label()
        noted = dict(self.arguments or ())
        for name, calls in ARGUMENTS.items():  # only what the call takes: a note under the wrong number shows as such
            if self.op in calls:
                found[name] = noted.get(name)
        return found

    def on(self, key: tuple[str, str]) -> Collective | None:
        """This rank's record on the group ``key`` (:func:`_key`): this one, or its newest there."""
        return next((record for record in (self, *self.others) if _key(record) == key), None)


#: What a rank answers under NCCL when NCCL's Flight Recorder cannot be read: nothing is known of its collectives.
NO_NCCL_RECORD = Collective("no record", 0, "default_pg", (), True, recorded=False)
POINT_TO_POINT = ("send", "recv")


def _key(record: Collective) -> tuple[str, str]:
    return record.group_id, record.group


def _tensor(size: list[int], dtype: str) -> str:
    return f"{C10_DTYPES.get(dtype, dtype)}[{', '.join(map(str, size))}]"


def _call(entry: dict[str, Any]) -> str:
    """The torch.distributed call that started a record: the outermost ``distributed_c10d`` frame of its stack."""
    # "gloo:all_reduce" -> "all_reduce"; NCCL names a transfer with its peers: "nccl:send 0->1" -> "send"
    name = str(entry.get("profiling_name", "?")).split(":", 1)[-1].split(" ", 1)[0]
    frames = [frame.get("name", "") for frame in entry.get("frames") or []  # innermost first
              if str(frame.get("filename", "")).endswith("distributed_c10d.py")]
    if frames and not entry.get("is_p2p"):  # a send stays "send" (batch_isend_irecv posts it)
        return frames[-1]
    return _PROFILING_CALLS.get(name, name)


def _record(entry: dict[str, Any], arguments: dict | None, members: dict[str, tuple[int, ...]]) -> Collective:
    group_id, group = (list(entry.get("process_group", ("0", "default_pg"))) + ["default_pg"])[:2]
    p2p = bool(entry.get("is_p2p"))
    seq = int((entry.get("p2p_seq_id") if p2p else entry.get("collective_seq_id")) or 0)

    def tensors(sizes: str, dtypes: str) -> tuple[str, ...]:
        shapes, kinds = entry.get(sizes, []), entry.get(dtypes, [])
        if isinstance(kinds, str):  # one dtype for every tensor, as torch's own Flight Recorder tests write it
            kinds = [kinds] * len(shapes)
        return tuple(_tensor(size, dtype) for size, dtype in zip(shapes, kinds, strict=False))
    outputs = tensors("output_sizes", "output_dtypes") if "output_sizes" in entry else None
    noted = None if arguments is None or p2p else arguments.get((str(group_id), seq))
    return Collective(_call(entry), seq, str(group), tensors("input_sizes", "input_dtypes"), _done(entry),
                      outputs=outputs, members=members.get(str(group_id)), arguments=noted, group_id=str(group_id))


def from_flight_recorder(dump: dict[str, Any], arguments: dict | None = None,
                         members: dict[str, tuple[int, ...]] | None = None,
                         raised: tuple | None = None) -> Collective | None:
    """Where a Flight Recorder dump (``pickle.loads(_dump_fr_trace(...))``) says the rank is, or None.

    ``arguments`` maps ``(group name, number)`` to what the rank noted of that call, ``members`` a group name to
    its ranks, ``raised`` is ``(call, group name, group, number, started, exception type)`` for a call that raised
    (:class:`dtlib.live.notes.CallNotes`). The answer carries the rank's newest record on every other group.
    """
    entries = dump.get("entries", [])  # collectives and point-to-point calls (send, recv) alike
    known = {**_pg_config_members(dump.get("pg_config")), **(members or {})}

    def order(e: dict[str, Any]) -> tuple[int, int]:
        return e.get("time_created_ns") or 0, e.get("record_id") or 0

    newest: dict[str, dict[str, Any]] = {}
    for entry in sorted(entries, key=order):
        newest[str(entry.get("process_group", ("0",))[0])] = entry
    # Under NCCL the CPU queues work and runs on: the GPU works through the queue in order, so the rank
    # is held by its oldest unfinished record. A gloo call returns only when done: its newest record.
    queued = [e for e in entries if str(e.get("profiling_name", "")).startswith("nccl:") and not _done(e)]
    records = {group_id: _record(entry, arguments, known) for group_id, entry in newest.items()}
    current = _record(min(queued, key=order), arguments, known) if queued else None
    if current is None and entries:
        current = records[str(max(entries, key=order).get("process_group", ("0",))[0])]
    if raised is not None:
        call, group_id, group, seq, started, error = raised
        there = records.get(group_id)
        if started and there is not None and there.seq == seq:
            current = replace(there, raised=error)
        else:  # it raised before the backend started it: only the call and its group are known
            current = Collective(call, seq, group, (), True, members=known.get(group_id), raised=error,
                                 started=False, group_id=group_id)
    if current is None:
        return None
    return replace(current, others=tuple(record for record in records.values() if _key(record) != _key(current)))


def _pg_config_members(config: Any) -> dict[str, tuple[int, ...]]:
    """Each group's ranks where the recorder keeps them (NCCL: ``{"1": {"ranks": "[0, 1]"}}``; gloo: none)."""
    found = {}
    for group_id, group in (config or {}).items():
        try:
            ranks = tuple(int(rank) for rank in str(group.get("ranks", "")).strip("[]").split(",") if rank.strip())
        except (AttributeError, ValueError):
            continue
        if group_id and ranks:
            found[str(group_id)] = ranks
    return found


def _done(entry: dict[str, Any]) -> bool:
    """Whether a record's work has finished: retired, or its end seen (for NCCL, its end event on the GPU)."""
    return bool(entry.get("retired")) or entry.get("state") == "completed"


def last_collectives(arguments: dict | None = None, members: dict[str, tuple[int, ...]] | None = None,
                     raised: tuple | None = None, entries: list[dict[str, Any]] | None = None) -> Collective | None:
    """Inside a rank: the collective its Flight Recorders say it is in, or its newest (None before the first);
    :data:`NO_NCCL_RECORD` under NCCL when NCCL's recorder cannot be read. The other arguments are what the rank
    noted (:func:`from_flight_recorder`); ``entries``, where given, stand in for the recorders (torch's DETAIL
    mode, :meth:`dtlib.live.notes.CallNotes.entries`)."""
    if entries is not None:
        nccl = _nccl_dump() if _uses_nccl() else None
        if nccl is not None:  # DETAIL's notes say done when NCCL queues a call: NCCL's own records know better
            return from_flight_recorder({"entries": merge_nccl(entries, nccl.get("entries", [])),
                                         "pg_config": nccl.get("pg_config")}, arguments, members, raised)
        return from_flight_recorder({"entries": entries}, arguments, members, raised)
    dump: dict[str, Any] = {"entries": []}
    try:
        from torch._C._distributed_c10d import _dump_fr_trace

        dump = pickle.loads(_dump_fr_trace(True, True, False))  # with each record's Python stack: it names the call
    except Exception:  # noqa: BLE001 - no recorder in this build, or nothing recorded: no record
        pass
    if _uses_nccl():
        # GPU run must confirm: torch 2.13's CUDA build exposes _dump_nccl_trace with _dump_fr_trace's arguments
        # and format, FR_ENV's TORCH_FR_BUFFER_SIZE switches NCCL's recorder on too, an unfinished send reads
        # state "scheduled" (not retired) while the GPU waits in it, and a dump from this thread is safe while
        # the rank's main thread waits in a CUDA synchronize; and that notebook 02's send-first ring of 4 floats
        # hangs on the GPU at all (NCCL may complete a small send into its buffers, or block the CPU in send).
        nccl = _nccl_dump()
        if nccl is None:  # not in this build, or it failed: say so rather than guess
            return NO_NCCL_RECORD
        dump = {"entries": dump.get("entries", []) + nccl.get("entries", []),
                "pg_config": {**(dump.get("pg_config") or {}), **(nccl.get("pg_config") or {})}}
    return from_flight_recorder(dump, arguments, members, raised)


def _nccl_dump() -> dict[str, Any] | None:
    """NCCL's Flight Recorder, read from this rank (None where this build has none or the read failed)."""
    try:
        from torch._C._distributed_c10d import _dump_nccl_trace

        return pickle.loads(_dump_nccl_trace(True, True, False))
    except Exception:  # noqa: BLE001 - not in this build, or it failed
        return None


def merge_nccl(noted: list[dict[str, Any]], nccl: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Under torch's DETAIL mode on NCCL: NCCL's own records, and the notes' records of calls NCCL has none of.

    DETAIL's wrapper completes a work's future as soon as NCCL queues it, and returns no work for a blocking
    call, so :class:`dtlib.live.notes.CallNotes` marks every NCCL call done at once: a rank whose GPU waits in an
    all-reduce would read "finished". NCCL's recorder knows each call's state (scheduled, started, completed) and
    also holds what C++ issued (DDP's reducer), so its record of a ``(group, number)`` wins; a note stays only
    for a call NCCL never recorded (one that raised before NCCL started it). GPU run must confirm: that DETAIL's
    wrapped group keeps the group name and numbering NCCL's recorder uses.
    """
    def key(entry: dict[str, Any]) -> tuple[str, int, bool]:  # a transfer by the group's count of transfers
        p2p = bool(entry.get("is_p2p"))
        return (str(entry.get("process_group", ("0",))[0]),
                int(entry.get("p2p_seq_id" if p2p else "collective_seq_id") or 0), p2p)

    recorded = {key(entry) for entry in nccl}
    return [*nccl, *(entry for entry in noted if key(entry) not in recorded)]


def _uses_nccl() -> bool:
    """Whether this rank's default process group runs NCCL (alone, or beside gloo for CPU tensors)."""
    try:
        return dist.is_initialized() and "nccl" in str(dist.get_backend()).lower()
    except Exception:  # noqa: BLE001 - a group being torn down: no NCCL to read
        return False


def point_to_point(stack: str) -> str | None:
    """``"send"`` or ``"recv"`` when a rank's stack shows it inside that blocking call, else None.

    gloo's Flight Recorder records no point-to-point call, so the stack is where a blocked send shows.
    Example: ``point_to_point('File ".../distributed_c10d.py", line 2753 in send')`` is ``"send"``.
    """
    call = torch_call_in(stack)
    return call if call in ("send", "recv") else None


def explain(states: dict[int, str], last: dict[int, Collective | None],
            stacks: dict[int, str] | None = None, *, checked: bool = False) -> tuple[list[str], str]:
    """One line per rank and a verdict, from each rank's state, newest collective and, if given, stack.

    ``checked``: the ranks ran under the collective check (``LiveRanks(check_collectives=True)``, torch's DETAIL
    mode), which can itself hold up a right program: the verdict then says so, and how to run without it.

    ``states[rank]`` is ``"running"`` (still in the cell), ``"paused"`` (a stepped cell's rank paused before its
    next collective: in the cell, but in no collective), ``"finished"``, ``"failed"`` (raised) or ``"died"``.
    Example: with rank 0 running in an unfinished ``all_reduce #3`` and rank 1 finished after
    ``#2``, the verdict is ``"rank 0 is alone in collective #3: rank 1 never called it ..."``.
    """
    lines = []
    blocked_in: dict[int, str] = {}  # rank -> "send" or "recv": a running rank held by a point-to-point call
    unrecorded = []  # running ranks under NCCL whose recorder could not be read
    for rank in sorted(states):
        record, state = last.get(rank), states[rank]
        if state == "died":  # its recorder died with it
            lines.append(f"rank {rank} died")
            continue
        if state == "paused":  # its notes may hold the call it is paused before: it has not started it
            lines.append(f"rank {rank} is paused before its next collective (nothing sent)")
            continue
        if state == "running" and record is not None and not record.done:
            if record.op in POINT_TO_POINT:  # NCCL records them (gloo does not): said as a stack would say it
                blocked_in[rank] = record.op
                lines.append(f"rank {rank} waits in {record.op}")
                continue
            lines.append(f"rank {rank} waits in {record.describe()}")
            continue
        call = point_to_point((stacks or {}).get(rank, "")) if state == "running" else None
        if call is not None:
            blocked_in[rank] = call
            lines.append(f"rank {rank} waits in {call}")
            continue
        if state == "failed" and record is not None and record.raised:
            lines.append(f"rank {rank} raised {record.raised} inside {record.describe()}")
            continue
        doing = {"running": "runs Python code", "finished": "finished the cell",
                 "failed": "raised an error"}.get(state, state)
        if record is not None and not record.recorded:
            unrecorded += [rank] if state == "running" else []
            lines.append(f"rank {rank} {doing} (no record of its NCCL calls)")
            continue
        after = f"after {record.describe()}" if record is not None else "before any collective"
        lines.append(f"rank {rank} {doing} {after}")
    verdict = _point_to_point_verdict(states, last, blocked_in)
    if verdict is None and unrecorded:
        verdict = (f"no verdict: under NCCL a collective or a send only queues work on the GPU, and this torch's "
                   f"NCCL Flight Recorder could not be read on {_ranks(unrecorded)}, so where each GPU waits is "
                   "not known; the stacks below show only where each CPU waits (a line that reads a CUDA "
                   "tensor, or a synchronize, is waiting for the GPU)")
    verdict = verdict or _verdict(states, last, blocked_in)
    if checked and _check_may_hold_up(states, last, blocked_in, stacks or {}):
        verdict += CHECK_HOLDS_UP
    return lines, verdict


#: Added to the verdict where the collective check may be what holds the ranks up.
CHECK_HOLDS_UP = (". If the program is right, the collective check is what holds it up: with the check on (the live "
                  "ranks' default), every collective first waits until every rank has reached it, even one posted "
                  "with async_op=True, so a send or recv that a peer needs before its own collective never comes. "
                  "Run the cell unchecked: `%ranks start N --no-check` (LiveRanks(N, check_collectives=False))")


def _check_may_hold_up(states: dict[int, str], last: dict[int, Collective | None], blocked_in: dict[int, str],
                       stacks: dict[int, str]) -> bool:
    """Whether one running rank waits in a collective while another waits in a send or recv: a right program
    (an async collective, then a transfer its peer needs first) deadlocks that way under the check alone."""
    in_collective = [rank for rank, state in states.items() if state == "running" and rank not in blocked_in
                     and ((last.get(rank) is not None and not last[rank].done)
                          or torch_call_in(stacks.get(rank, "")) not in (None, "send", "recv"))]
    return bool(in_collective) and bool(blocked_in)


def _point_to_point_verdict(states: dict[int, str], last: dict[int, Collective | None],
                            blocked_in: dict[int, str]) -> str | None:
    """The verdict when every running rank is blocked in a send or a recv (and none in a collective)."""
    running = [rank for rank, state in states.items() if state == "running"]
    in_collective = any(last.get(rank) is not None and not last[rank].done and last[rank].op not in POINT_TO_POINT
                        for rank in running)
    if not blocked_in or in_collective or set(running) != set(blocked_in):
        return None
    calls = set(blocked_in.values())
    if calls == {"send"}:
        return ("every running rank waits in a blocking send, and none in a recv: on gloo and NCCL a send completes "
                "only once its peer receives, so ranks that all send first wait for each other for ever. Let half "
                "of them receive first, or post isend and irecv together and wait on both")
    if calls == {"recv"}:
        return "every running rank waits in a blocking recv, and none sends: nothing will ever arrive"
    return ("the ranks wait in sends and recvs that do not pair up: check each call's peer rank, the order of the "
            "calls on each side, and that the tensors' sizes match")


def _position(record: Collective | None) -> int:
    """The collective number a rank is at on a group, given its record there: the one it waits in (or raised in
    before it started), else the one after its last."""
    if record is None:
        return 1
    return record.seq + 1 if record.done and record.started else record.seq


def _members(key: tuple[str, str], last: dict[int, Collective | None], ranks: list[int]) -> tuple[list[int], bool]:
    """The group's ranks, and whether they were recorded (the world's are every rank's)."""
    for record in last.values():
        there = record.on(key) if record is not None else None
        if there is not None and there.members is not None:
            return sorted(there.members), True
    return ranks, key[1] == "default_pg"


def _compare(records: list[Collective]) -> tuple[list[str], list[str], list[str]]:
    """The fields on which ``records`` differ, those some rank did not record, and those that match."""
    fields = [record.fields() for record in records]
    differ, unrecorded, same = [], [], []
    for name in dict.fromkeys(name for found in fields for name in found):
        values = [found[name] for found in fields if name in found]
        recorded = [value for value in values if value is not None]
        (differ if len(set(recorded)) > 1 else unrecorded if len(recorded) < len(values) else same).append(name)
    return differ, unrecorded, same


def _verdict(states: dict[int, str], last: dict[int, Collective | None],
             blocked_in: dict[int, str] | None = None) -> str:
    died = [rank for rank, state in sorted(states.items()) if state == "died"]
    if died:
        who = ", ".join(map(str, died))
        return (f"a process group cannot go on without rank {who} (the error names what it said last, if anything: "
                "an error in native code, a signal, running out of memory, or gloo or NCCL aborting it)")
    waiting = {rank: record for rank, record in last.items()
               if states.get(rank) == "running" and record is not None and not record.done}
    if not waiting:
        if any(state == "running" for state in states.values()):
            return ("no rank waits in a collective that the Flight Recorder saw: the stacks below show where each "
                    "running rank is (slow code, a Python loop, or a send or recv, which gloo does not record)")
        return "no rank waits in a collective"
    key = _key(waiting[min(waiting)])  # the group the lowest waiting rank waits on, at its lowest number there
    first = min(record.seq for record in waiting.values() if _key(record) == key)
    at_first = sorted(rank for rank, record in waiting.items() if _key(record) == key and record.seq == first)
    members, known = _members(key, last, sorted(states))
    there = {rank: last[rank].on(key) if last.get(rank) is not None else None for rank in members}
    label = waiting[at_first[0]].group_label()
    where = f"collective #{first}" + ("" if key[1] == "default_pg" else f" on group {label}")
    # Every member's record of that collective, the ranks that got past it or raised inside it included: a rank
    # that finished it with other arguments (gloo lets a shorter tensor through) is where the ranks disagree.
    called = {rank: record for rank, record in there.items() if record is not None and record.seq == first
              and record.started and states.get(rank) in ("running", "finished", "failed")}
    raised = sorted(rank for rank, record in there.items() if record is not None and record.raised
                    and record.seq == first and states.get(rank) == "failed")
    differ, unrecorded, same = _compare(list(called.values()))
    inside_raised = f"; {_ranks(raised)} raised an error inside it (its traceback is above)" if raised else ""
    if differ:
        show = tuple(name for name in differ if name not in ("call", "tensors", "group"))
        if "tensors" in differ:
            show = tuple(name for name in show if name != "outputs")
        calls = ", ".join(f"rank {rank} calls {record.describe(number=False, show=show)}"
                          for rank, record in sorted(called.items()))
        past = sorted(rank for rank, record in called.items() if record.done and not record.raised)
        wrong = (f"; {_ranks(past)} got past it, so what {'it' if len(past) == 1 else 'they'} received is wrong"
                 if past else "")
        return f"the ranks disagree at {where}: {calls}{wrong}{inside_raised}"
    waits = "waits" if len(at_first) == 1 else "wait"
    if raised:
        return (f"{_ranks(at_first)} {waits} in {where}, inside which {_ranks(raised)} raised an error (its traceback "
                f"is above), so {'it' if len(raised) == 1 else 'they'} will never finish it: fix that error")
    missing = [rank for rank in members if rank not in at_first and _position(there[rank]) <= first]
    if missing:
        return _alone(at_first, where, missing, states, last, members if known else [], blocked_in or {})
    later = {rank: record for rank, record in waiting.items() if _key(record) == key and record.seq != first}
    if later:
        ahead = ", ".join(f"rank {rank} at #{record.seq}" for rank, record in sorted(later.items()))
        return (f"the ranks are at different collectives ({where}, {ahead}): "
                "they called different numbers of collectives")
    past = sorted(rank for rank, record in called.items() if record.done)
    if past:
        return (f"{_ranks(at_first)} {waits} in {where}, which {_ranks(past)} finished {_same(unrecorded, same)}: "
                "the rest is below Python (a peer's network, or a device)")
    everyone = "every rank" if len(members) == len(states) else "every rank of the group"
    return (f"{everyone} waits in {where} {_same(unrecorded, same)}: it is stuck below Python (a peer's network, "
            "or a device)")


def _alone(at_first: list[int], where: str, missing: list[int], states: dict[int, str],
           last: dict[int, Collective | None], members: list[int], blocked_in: dict[int, str]) -> str:
    """The verdict when members of the group have not reached the collective that ``at_first`` wait in."""
    said = []
    gone = [rank for rank in missing if states.get(rank) == "finished"]
    failed = [rank for rank in missing if states.get(rank) == "failed"]
    elsewhere = {rank: last[rank] for rank in missing if states.get(rank) == "running" and last.get(rank) is not None
                 and not last[rank].done}
    transfers = {rank: blocked_in[rank] for rank in missing if rank in blocked_in and rank not in elsewhere}
    late = [rank for rank in missing if states.get(rank) == "running" and rank not in elsewhere
            and rank not in transfers]
    if gone:
        said.append(f"rank {', '.join(map(str, gone))} never called it (a collective under `if rank == ...`, "
                    "or a rank that returned early?)")
    if failed:
        said.append(f"{_ranks(failed)} raised an error before calling it (its traceback is above)")
    for rank, record in sorted(elsewhere.items()):
        world = " on the world group" if record.group == "default_pg" else ""
        said.append(f"rank {rank} waits in {record.describe()}{world} instead (a group= left out, or collectives "
                    "called in a different order?)")
    for rank, call in sorted(transfers.items()):
        said.append(f"rank {rank} waits in a blocking {call} instead, before calling it (its peer must "
                    f"{'receive' if call == 'send' else 'send'} first)")
    paused = [rank for rank in missing if states.get(rank) == "paused"]
    if paused:
        said.append(f"{_ranks(paused)} {'is' if len(paused) == 1 else 'are'} paused before it: step "
                    f"{'it' if len(paused) == 1 else 'them'} too")
    if late:
        said.append(f"rank {', '.join(map(str, late))} is late: it has not called it yet and still runs Python code "
                    "(slow work before the collective, or a loop that never reaches it: its stack is below)")
    outside = [rank for rank in sorted(states) if members and rank not in members]
    if outside:
        said.append(f"{_ranks(outside)} {'is' if len(outside) == 1 else 'are'} not in that group")
    alone = "is alone" if len(at_first) == 1 else "are alone"
    return f"{_ranks(at_first)} {alone} in {where}: " + "; ".join(said)


def _same(unrecorded: list[str], same: list[str]) -> str:
    """"with the same arguments" only when every field was recorded and matched; else which were not recorded."""
    if not unrecorded:
        return "with the same arguments"
    one = len(unrecorded) == 1
    return (f"with the same {_listed(same)} ({_listed(unrecorded)} {'was' if one else 'were'} not recorded: check "
            f"on every rank that {'it is' if one else 'they are'} the same)")


def _listed(names: list[str]) -> str:
    """"call", "call and tensors", "call, tensors and group", in a learner's words."""
    said = [_SAID.get(name, name) for name in names]
    return ", ".join(said[:-1]) + f" and {said[-1]}" if len(said) > 1 else "".join(said)


def _ranks(ranks: list[int]) -> str:
    """"rank 1", "ranks 1 and 2", "ranks 1, 2 and 3"."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def group_is_broken(states: dict[int, str], last: dict[int, Collective | None]) -> bool:
    """After an interrupt: can the process group still be used? Not if a rank is still inside a collective, or if
    the members of a group have finished different numbers of its collectives."""
    if any(state == "running" for state in states.values()):
        return True
    records = [record for record in last.values() if record is not None and record.recorded]
    if any(not record.done for record in records):
        return True
    keys = {_key(there) for record in records for there in (record, *record.others)}
    for key in keys:
        members, known = _members(key, last, sorted(states))
        there = {rank: last[rank].on(key) if last.get(rank) is not None else None for rank in members
                 if last.get(rank) is None or last[rank].recorded}
        done = {_position(record) for record in there.values() if known or record is not None}
        if len(done) > 1:
            return True
    return False
