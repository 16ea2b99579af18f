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
    (``dtlib.launch.files.verify_digests``); the message names the file. Example: ``except dtlib.ChangedFile``."""


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
