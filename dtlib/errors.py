"""The exceptions :func:`dtlib.spawn` raises when ranks fail or hang, and a reader for torch's mismatch errors."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class RankFailure:
    """What went wrong on one rank.

    ``exc_type`` is the original exception's class name (``"ValueError"``), or
    ``None`` when the process died without raising (a crash, ``os._exit``, a signal).
    """

    rank: int
    exc_type: str | None
    message: str
    traceback: str
    exitcode: int | None = None

    def headline(self) -> str:
        """One line: ``rank 1 raised ValueError: bad shape``."""
        if self.exc_type is None:
            return f"rank {self.rank} {self.message}"
        return f"rank {self.rank} raised {self.exc_type}: {self.message}"


class ChangedFile(ValueError):
    """A file whose SHA-256 is not the one recorded when dtlib wrote it: changed or cut short since
    (``dtlib.train.checkpoint.verify_digests``); the message names the file. Example: ``except dtlib.ChangedFile``."""


#: What a rank's error says when it only followed from another rank leaving: gloo's words for a lost peer.
FOLLOWED_FROM_A_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


class WorkerError(RuntimeError):
    """One or more ranks failed; ``failures`` holds every failed rank, in rank order.

    Example::

        try:
            dtlib.spawn(fn, world_size=2)
        except dtlib.WorkerError as err:
            print(err.failures[0].rank, err.failures[0].exc_type)
    """

    def __init__(self, failures: list[RankFailure], note: str = "") -> None:
        self.failures = sorted(failures, key=lambda failure: failure.rank)
        self.rank = self.failures[0].rank
        self.note = note  # what happened to the ranks afterwards (live ranks: kept, or restarted)
        super().__init__(self._describe() + (f"\n{note}" if note else ""))

    def cause(self) -> RankFailure:
        """The failure to read first: a rank that died without raising (it exited, or was killed), else one whose
        error is its own, not a peer's loss ("Connection closed by peer", "Connection reset by peer": what a rank
        says when another one left), else the lowest rank's. Example: ``err.cause().headline()``."""
        def followed(failure: RankFailure) -> bool:
            return any(words in failure.message for words in FOLLOWED_FROM_A_PEER)

        return (next((f for f in self.failures if f.exc_type is None), None)
                or next((f for f in self.failures if not followed(f)), None) or self.failures[0])

    def _describe(self) -> str:
        if len(self.failures) == 1:
            head = self.failures[0].headline()
        else:
            ranks = ", ".join(str(failure.rank) for failure in self.failures)
            lines = "\n".join("  " + failure.headline() for failure in self.failures)
            head = f"{len(self.failures)} ranks failed ({ranks}):\n{lines}"
        parts = [head]
        for failure in self.failures:
            if failure.traceback:
                parts.append(f"--- remote traceback of rank {failure.rank} ---\n{failure.traceback.rstrip()}")
        return "\n".join(parts)


class WorkerTimeout(WorkerError, TimeoutError):
    """Ranks were still running after ``timeout`` seconds; every rank was stopped.

    ``stacks`` maps each rank that was still running to its Python stack at that
    moment, so the report shows which rank waited in which collective. Live ranks
    (:class:`dtlib.LiveRanks`) add the hang doctor's findings: ``collectives``, one line
    per rank (``"rank 0 waits in all_reduce #3 (float32[4])"``), and ``verdict``, where
    the ranks disagree; ``outcome`` says what became of the ranks.
    """

    def __init__(self, timeout: float, stacks: dict[int, str], finished: list[int], *,
                 collectives: list[str] | None = None, verdict: str = "",
                 outcome: str = "every rank was stopped.") -> None:
        self.timeout = timeout
        self.stacks = dict(sorted(stacks.items()))
        self.running_ranks = list(self.stacks)
        self.finished_ranks = sorted(finished)
        self.collectives = list(collectives or [])
        self.verdict = verdict
        self.outcome = outcome
        failures = [
            RankFailure(rank, None, f"was still running after {timeout:g} s", stack)
            for rank, stack in self.stacks.items()
        ]
        super().__init__(failures)

    def _describe(self) -> str:
        running = ", ".join(map(str, self.running_ranks))
        done = ", ".join(map(str, self.finished_ranks)) or "none"
        if self.collectives:  # the hang doctor's findings say more than the rank numbers
            parts = [f"timed out after {self.timeout:g} s: {'; '.join(self.collectives)}."]
            if self.verdict:
                parts.append(f"The hang doctor: {self.verdict}.")
            parts.append(self.outcome[:1].upper() + self.outcome[1:])
        else:
            parts = [
                f"timed out after {self.timeout:g} s: rank(s) {running} still running "
                f"(finished: {done}); {self.outcome}"
            ]
        for rank, stack in self.stacks.items():
            parts.append(f"--- Python stack of rank {rank} at the timeout ---\n{stack.rstrip()}")
        return "\n".join(parts)


_TORCH_CALL = re.compile(r'distributed_c10d\.py", line \d+ in (\w+)')  # a torch.distributed frame of a stack


def torch_call_in(stack: str) -> str | None:
    """The ``torch.distributed`` function a rank's faulthandler stack is inside (most recent call first), or None.

    Example: ``torch_call_in('File ".../distributed_c10d.py", line 5356 in barrier')`` is ``"barrier"``.
    """
    match = _TORCH_CALL.search(stack)
    return match.group(1) if match else None


def fingerprint_summary(message: str) -> str:
    """``TORCH_DISTRIBUTED_DEBUG=DETAIL``'s "Detected mismatch between collectives" error, one clause a line
    and without each tensor's ``TensorOptions(...)`` repeated. Example::

        fingerprint_summary(str(err)).splitlines()[0]   # "Detected mismatch between collectives on ranks."
    """
    short = re.sub(r", TensorDeviceTypes=TensorOptions\(.*?memory_format=\(\w+\)\)", "", message)
    short = re.sub(r"\s+", " ", short).replace("on ranks. Rank", "on ranks.\nRank")
    short = short.replace("), but Rank", "),\nbut Rank").replace(").Collectives differ", ").\nCollectives differ")
    return short.strip()


#: c10's names of dtypes (the Flight Recorder's, DETAIL mode's) -> torch's, which learners know.
C10_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16", "Long": "int64",
              "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8", "Bool": "bool",
              "ComplexFloat": "complex64", "ComplexDouble": "complex128"}
_FINGERPRINT = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=\d+,? ?"
                          r"OpType=(\w+)(?:, TensorShape=\[([^\]]*)\])?(?:, TensorDtypes=(\w+))?")


def collective_mismatch(message: str) -> str | None:
    """Torch's DETAIL-mode error for collectives that differ across ranks, as live ranks say it; None for another.

    Only the raising rank's own call is named: torch's account of the other side can be wrong (a barrier's check
    has reported its peer's all-reduce as a "GATHER"), and every rank raises, each naming its own. Example: torch's
    ``"Detected mismatch between collectives on ranks. Rank 0 is running collective: CollectiveFingerPrint(
    SequenceNumber=0, OpType=ALLREDUCE, TensorShape=[4], TensorDtypes=Float, ...), but Rank 1 ..."`` ->
    ``"this rank's all_reduce (float32[4]) does not match the collective another rank called at this point; ..."``.
    """
    if not message.startswith("Detected mismatch between collectives"):
        return None
    found = _FINGERPRINT.search(message)
    if found is None:
        return None
    _, op, shape, dtype = found.groups()
    tensor = f"{C10_DTYPES.get(dtype, dtype)}[{shape}]" if dtype else ""
    call = f"{_OPS.get(op, op.lower())}{f' ({tensor})' if tensor else ''}"
    return (f"this rank's {call} does not match the collective another rank called at this point (each rank's "
            "line names its own). Live ranks compare every collective's call, shapes and dtypes across ranks "
            "before it runs, so this raised before any data moved; a job without the check would hang here or, "
            "where the sizes agree, compute garbage. torch's own message is in the traceback; "
            "`%ranks start N --no-check` turns the check off")


_OPS = {"ALLREDUCE": "all_reduce", "ALLGATHER": "all_gather", "_ALLGATHER_BASE": "all_gather_into_tensor",
        "REDUCE_SCATTER": "reduce_scatter", "_REDUCE_SCATTER_BASE": "reduce_scatter_tensor", "ALLTOALL": "all_to_all",
        "ALLTOALL_BASE": "all_to_all_single", "BROADCAST": "broadcast", "REDUCE": "reduce", "GATHER": "gather",
        "SCATTER": "scatter", "BARRIER": "barrier", "ALLGATHER_COALESCED": "all_gather_coalesced",
        "ALLREDUCE_COALESCED": "all_reduce_coalesced"}
