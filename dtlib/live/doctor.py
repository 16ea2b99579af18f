"""The hang doctor: which collective each live rank is in, and where the ranks disagree.

Each rank's record comes from torch's own Flight Recorder (``TORCH_FR_BUFFER_SIZE``), which
notes every collective a process group starts, with its sequence number, operation, tensor
shapes and dtypes, and whether it has finished; nothing in the user's code is patched. A
rank answers :func:`last_collectives` from a thread of its own, so it answers even while
its main thread waits inside gloo or NCCL.

gloo and NCCL keep separate recorders (``_dump_fr_trace`` and, in CUDA builds, ``_dump_nccl_trace``,
the same format). Under NCCL a collective or a send only queues work on the GPU and returns, so the
CPU runs ahead: the rank is stuck in its oldest unfinished NCCL record, not its newest, and a
send or recv is recorded (gloo's recorder notes none). Where NCCL's recorder cannot be read, the
doctor says that it has no record rather than judge from the CPU's stack alone.

:func:`explain` turns the ranks' answers into one line per rank and a verdict, e.g. *rank 0 waits in
all_reduce #3 (float32[4]); rank 1 finished the cell after all_reduce #2: rank 0 is alone in collective #3*.

Used by :class:`dtlib.LiveRanks` (:mod:`dtlib.live.ranks`) and, in each rank, :mod:`dtlib.live.rank`.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

from dtlib.errors import torch_call_in

#: How many collectives each rank's Flight Recorder keeps (a ring buffer; ~1 KB each).
FR_BUFFER_SIZE = 2000
#: The environment that keeps the recorder on, with room for FR_BUFFER_SIZE records, whatever the job's own
#: environment says (0 would switch it off; torch 2.13 records by default).
FR_ENV = {"TORCH_FR_BUFFER_SIZE": str(FR_BUFFER_SIZE)}

# The Flight Recorder names dtypes as c10 does; learners know torch's names.
_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16", "Long": "int64",
           "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8", "Bool": "bool",
           "ComplexFloat": "complex64", "ComplexDouble": "complex128"}


@dataclass(frozen=True)
class Collective:
    """One collective as a rank's Flight Recorder saw it.

    Example: ``Collective("all_reduce", 3, "default_pg", ("float32[4]",), done=False).describe()``
    is ``"all_reduce #3 (float32[4])"``.
    """

    op: str
    seq: int  # the group's collective number (point-to-point calls count separately)
    group: str  # "default_pg" for the world
    tensors: tuple[str, ...]  # "float32[4]" per input tensor
    done: bool  # False: the rank started it and has not got past it
    recorded: bool = True  # False: a stand-in where NCCL's Flight Recorder could not be read (NO_NCCL_RECORD)

    def describe(self, number: bool = True) -> str:
        where = "" if self.group == "default_pg" else f" on group {self.group}"
        args = f" ({', '.join(self.tensors)})" if self.tensors else ""
        return f"{self.op}{f' #{self.seq}' if number else ''}{args}{where}"

    def signature(self) -> tuple[str, str, tuple[str, ...]]:
        """What every rank's call of the same collective must agree on: the operation, the group, and each
        tensor's dtype and shape (the Flight Recorder's fields)."""
        return self.op, self.group, self.tensors


#: What a rank answers under NCCL when NCCL's Flight Recorder cannot be read: nothing is known of its collectives.
NO_NCCL_RECORD = Collective("no record", 0, "default_pg", (), True, recorded=False)
POINT_TO_POINT = ("send", "recv")


def _tensor(size: list[int], dtype: str) -> str:
    return f"{_DTYPES.get(dtype, dtype)}[{', '.join(map(str, size))}]"


def from_flight_recorder(dump: dict[str, Any]) -> Collective | None:
    """The newest collective of a Flight Recorder dump (``pickle.loads(_dump_fr_trace(...))``), or None."""
    entries = dump.get("entries", [])  # collectives and point-to-point calls (send, recv) alike
    if not entries:
        return None

    def order(e: dict[str, Any]) -> tuple[int, int]:
        return e.get("time_created_ns") or 0, e.get("record_id") or 0

    # Under NCCL the CPU queues work and runs on: the GPU works through the queue in order, so the rank
    # is held by its oldest unfinished record. A gloo call returns only when done: its newest record.
    queued = [e for e in entries if str(e.get("profiling_name", "")).startswith("nccl:") and not _done(e)]
    entry = min(queued, key=order) if queued else max(entries, key=order)
    group = entry.get("process_group", ("0", "default_pg"))
    # "gloo:all_reduce" -> "all_reduce"; NCCL names a transfer with its peers: "nccl:send 0->1" -> "send"
    name = str(entry.get("profiling_name", "?")).split(":", 1)[-1].split(" ", 1)[0]
    seq = entry.get("p2p_seq_id") if entry.get("is_p2p") else entry.get("collective_seq_id")
    tensors = tuple(_tensor(size, dtype) for size, dtype in
                    zip(entry.get("input_sizes", []), entry.get("input_dtypes", []), strict=False))
    return Collective(name, int(seq or 0), str(group[1] if len(group) > 1 else group[0]), tensors, _done(entry))


def _done(entry: dict[str, Any]) -> bool:
    """Whether a record's work has finished: retired, or its end seen (for NCCL, its end event on the GPU)."""
    return bool(entry.get("retired")) or entry.get("state") == "completed"


def last_collectives() -> Collective | None:
    """Inside a rank: the collective its Flight Recorders say it is in, or its newest (None before the first, or
    without torch); :data:`NO_NCCL_RECORD` under NCCL when NCCL's recorder cannot be read."""
    import sys

    if "torch.distributed" not in sys.modules:
        return None
    try:
        from torch._C._distributed_c10d import _dump_fr_trace

        entries = pickle.loads(_dump_fr_trace(True, False, False)).get("entries", [])
    except Exception:  # noqa: BLE001 - no recorder in this build, or nothing recorded: no record
        entries = []
    if _uses_nccl():
        # GPU run must confirm: torch 2.13's CUDA build exposes _dump_nccl_trace with _dump_fr_trace's arguments
        # and format, FR_ENV's TORCH_FR_BUFFER_SIZE switches NCCL's recorder on too, an unfinished send reads
        # state "scheduled" (not retired) while the GPU waits in it, and a dump from this thread is safe while
        # the rank's main thread waits in a CUDA synchronize; and that notebook 02's send-first ring of 4 floats
        # hangs on the GPU at all (NCCL may complete a small send into its buffers, or block the CPU in send).
        try:
            from torch._C._distributed_c10d import _dump_nccl_trace

            entries = entries + pickle.loads(_dump_nccl_trace(True, False, False)).get("entries", [])
        except Exception:  # noqa: BLE001 - not in this build, or it failed: say so rather than guess
            return NO_NCCL_RECORD
    return from_flight_recorder({"entries": entries})


def _uses_nccl() -> bool:
    """Whether this rank's default process group runs NCCL (alone, or beside gloo for CPU tensors)."""
    import torch.distributed as dist

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
            stacks: dict[int, str] | None = None) -> tuple[list[str], str]:
    """One line per rank and a verdict, from each rank's state, newest collective and, if given, stack.

    ``states[rank]`` is ``"running"`` (still in the cell), ``"finished"``, ``"failed"`` (raised) or ``"died"``.
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
    return lines, verdict or _verdict(states, last)


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


def _position(record: Collective | None, waiting: bool) -> int:
    """The collective number a rank is at: the one it waits in, else the one after its last."""
    if record is None:
        return 1
    return record.seq if waiting else record.seq + 1


def _verdict(states: dict[int, str], last: dict[int, Collective | None]) -> str:
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
    first = min(record.seq for record in waiting.values())
    at_first = {rank: record for rank, record in waiting.items() if record.seq == first}
    group = next(iter(at_first.values())).group
    # Every rank's record of that collective, the ranks that got past it included: a rank that finished it
    # with other arguments (gloo lets a shorter tensor through) is where the ranks disagree.
    called = {rank: record for rank, record in last.items() if record is not None and record.seq == first
              and record.group == group and states.get(rank) != "died"}
    if len({record.signature() for record in called.values()}) > 1:
        calls = ", ".join(f"rank {rank} calls {record.describe(number=False)}"
                          for rank, record in sorted(called.items()))
        past = sorted(rank for rank, record in called.items() if record.done)
        wrong = (f"; {_ranks(past)} got past it, so what {'it' if len(past) == 1 else 'they'} received is wrong"
                 if past else "")
        return f"the ranks disagree at collective #{first}: {calls}{wrong}"
    missing = [rank for rank in sorted(states) if rank not in waiting
               and _position(last.get(rank), waiting=False) <= first]
    if missing:
        inside = ", ".join(map(str, sorted(at_first)))
        alone = "is alone" if len(at_first) == 1 else "are alone"
        busy = [rank for rank in missing if states.get(rank) == "running"]
        gone = [rank for rank in missing if rank not in busy]
        said = []
        if gone:
            said.append(f"rank {', '.join(map(str, gone))} never called it (a collective under `if rank == ...`, "
                        "or a rank that returned early?)")
        if busy:
            said.append(f"rank {', '.join(map(str, busy))} has not called it yet and still runs Python code (slow "
                        "work before the collective, or a loop that never reaches it: its stack is below)")
        return f"rank {inside} {alone} in collective #{first}: " + "; ".join(said)
    later = {rank: record for rank, record in waiting.items() if record.seq != first}
    if later:
        ahead = ", ".join(f"rank {rank} at #{record.seq}" for rank, record in sorted(later.items()))
        return (f"the ranks are at different collectives (collective #{first}, {ahead}): "
                "they called different numbers of collectives")
    past = sorted(rank for rank, record in called.items() if record.done)
    if past:
        inside = _ranks(sorted(at_first))
        return (f"{inside} {'waits' if len(at_first) == 1 else 'wait'} in collective #{first}, which {_ranks(past)} "
                "finished with the same arguments: the rest is below Python (a peer's network, or a device)")
    return (f"every rank waits in collective #{first} with the same arguments: it is stuck below Python "
            "(a peer's network, or a device)")


def _ranks(ranks: list[int]) -> str:
    """"rank 1", "ranks 1 and 2", "ranks 1, 2 and 3"."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def group_is_broken(states: dict[int, str], last: dict[int, Collective | None]) -> bool:
    """After an interrupt: can the process group still be used? Not if a rank is still inside a
    collective, or if the ranks have finished different numbers of collectives on the world group."""
    if any(state == "running" for state in states.values()):
        return True
    if any(record is not None and not record.done for record in last.values()):
        return True
    done = {record.seq if record is not None and record.group == "default_pg" else 0 for record in last.values()}
    return len(done) > 1
