"""The kernel's side of one generation of live ranks: their job, and their answers.

:class:`dtlib.LiveRanks` starts a generation, sends it commands and, when a collective leaves the
process group unusable, closes it and starts the next. The ranks' side is :mod:`dtlib.live.server`.
"""

from __future__ import annotations

import itertools
import pickle
import signal
import time
from typing import Any

import cloudpickle

from dtlib.errors import RankFailure
from dtlib.launch.job import Job, RankState
from dtlib.launch.processes import HeldInterrupts, end_tree, send
from dtlib.launch.spawn import finish, start_job
from dtlib.live import doctor, server

INTERRUPT_WAIT_S = 2.0  # after SIGINT, how long a rank may take to stop its cell before the ranks restart
DOCTOR_WAIT_S = 1.0  # how long to wait for the ranks' Flight Recorder answers
ERROR_GRACE_S = 1.0  # after one rank's error, how long the others may take to finish the cell
EXIT_GRACE_S = 10.0  # at close, how long ranks may take to leave their process group


class Generation:
    """One generation of live ranks: the job, and what each rank answered to the current command.

    Every command carries a number, and every answer the number of the command it answers; only a rank's answer to
    the newest command it was sent counts. A rank left behind in an earlier cell (one the kernel gave up on)
    answers that cell late, and its answer is dropped: it is never taken for the next cell's. A command may go to
    some ranks only (stepping one rank, :mod:`dtlib.live.stepper`): the others keep waiting for their own. The
    doctor's questions are numbered the same way.
    """

    def __init__(self, world_size: int, backend: str, method: str, env: dict[str, str] | None = None) -> None:
        self.job = Job(world_size, "all", method, channels=2)
        self.answers: dict[int, tuple[str, Any]] = {}
        self.doctor: dict[int, Any] = {}
        self.command = 0  # the newest command's number; 0: the ranks' first "ready"
        self.expected: dict[int, int] = dict.fromkeys(range(world_size), 0)  # by rank: the answer that counts
        self.dropped: dict[int, int] = {}  # by rank: late answers to earlier commands, dropped
        self._asked = b"0"  # the doctor's newest question
        self._questions = itertools.count(1)
        payload = cloudpickle.dumps((server.serve, (), {}))
        try:
            start_job(self.job, method, payload, {}, backend, env={**doctor.FR_ENV, **(env or {})})
            for state in self.job.ranks:
                commands, answers = state.channels
                self.job.watch(state, commands, self._take_answer)
                self.job.watch(state, answers, self._take_doctor)
        except BaseException:
            self.close()
            raise

    def _take_answer(self, state: RankState) -> None:
        try:
            number, status, body = pickle.loads(state.channels[0].recv_bytes())
        except (EOFError, OSError):
            self.job.unwatch(state.channels[0])  # the rank died: its exit is reported by the job
            return
        if number == self.expected.get(state.rank):
            self.answers[state.rank] = (status, body)
        else:  # an earlier cell's answer, from a rank that was still in it: never this command's
            self.dropped[state.rank] = self.dropped.get(state.rank, 0) + 1

    def _take_doctor(self, state: RankState) -> None:
        try:
            asked, last = pickle.loads(state.channels[1].recv_bytes())
        except (EOFError, OSError):
            self.job.unwatch(state.channels[1])
            return
        except Exception:  # noqa: BLE001 - an answer this kernel cannot read is no answer
            asked, last = self._asked, None
        if asked == self._asked:  # a late answer to an earlier question says nothing of now
            self.doctor[state.rank] = last

    def dead(self) -> list[RankFailure]:
        return self.job.failures()

    def send(self, message: tuple[str, Any], ranks: set[int] | None = None) -> None:
        """Send one command to every rank, or to ``ranks``, under a new number: from now on only their answers to
        it count (the other ranks' answers, given or owed, stay). A rank that died just now cannot take it; the
        event loop then reports its exit."""
        self.command += 1
        data = pickle.dumps((self.command, *message))
        for state in self.job.ranks:
            if ranks is not None and state.rank not in ranks:
                continue
            self.expected[state.rank] = self.command
            self.answers.pop(state.rank, None)
            try:
                state.channels[0].send_bytes(data)
            except OSError:  # BrokenPipeError and the like: the rank is gone
                pass

    def wait(self, ranks: set[int], until: float, stop_early: bool = False, stop_on: str = "") -> set[int]:
        """Run the event loop until ``ranks`` have answered, a rank died, or ``until``; the ranks still owing.

        With ``stop_early``, an error answer shortens the wait to ``ERROR_GRACE_S``. With ``stop_on``, an answer of
        that status (``"paused"``) ends it at once.
        """
        while True:
            owing = {rank for rank in ranks if rank not in self.answers}
            now = time.monotonic()
            if not owing or self.dead() or now >= until:
                return owing
            if stop_on and any(self.answers[rank][0] == stop_on for rank in ranks if rank in self.answers):
                return owing
            if stop_early and any(self.answers[r][0] == "error" for r in ranks if r in self.answers):
                until = min(until, now + ERROR_GRACE_S)
                stop_early = False
            self.job.step(until - now)

    def flush_output(self) -> None:
        """Relay what the ranks wrote before they answered (it is in the pipes already)."""
        self.job.step(0.0)
        self.job.relay.flush(final=True)

    def ask_doctor(self, question: str = "") -> dict[int, Any]:
        """Each rank's newest collective (None: no answer within ``DOCTOR_WAIT_S``), by rank; with ``question``
        ``"where"``, each rank's main Python stack instead (:func:`dtlib.live.server.main_stack`)."""
        self.doctor.clear()
        self._asked = f"{question}{next(self._questions)}".encode()
        for state in self.job.ranks:
            try:
                state.channels[1].send_bytes(self._asked)
            except OSError:
                pass
        until = time.monotonic() + DOCTOR_WAIT_S
        while len(self.doctor) < len(self.job.ranks) and time.monotonic() < until:
            self.job.step(until - time.monotonic())
        return {rank: self.doctor.get(rank) for rank in range(len(self.job.ranks))}

    def interrupt(self, ranks: set[int]) -> set[int]:
        """SIGINT the ranks still in a cell and wait for them to stop; the ranks that did not."""
        for state in self.job.ranks:
            if state.rank in ranks and state.started():
                send(state.process.pid, signal.SIGINT, group=False)  # KeyboardInterrupt inside the cell
        return self.wait(ranks, time.monotonic() + INTERRUPT_WAIT_S)

    def kill(self) -> None:
        """SIGKILL every rank and what it started: signals only, so any thread may call it while another
        runs the event loop (which then sees the deaths and releases the rest)."""
        for state in self.job.ranks:
            if state.started() and not state.exited:
                end_tree(state.process.pid)  # the rank, its group, and what left them

    def close(self, graceful: bool = False) -> None:
        """Stop every rank (politely first with ``graceful``) and release everything; safe to repeat."""
        with HeldInterrupts() as held:
            try:
                if graceful and not self.dead() and not self.job.stopped:
                    try:
                        self.send(("exit", None))
                        self.job.wait(EXIT_GRACE_S)
                        self.job.stop(grace_s=EXIT_GRACE_S)
                    except OSError:
                        pass
            finally:
                finish(self.job)
        held.deliver()


def close_quietly(holder: list[Generation | None]) -> None:
    """At garbage collection or interpreter exit: no rank outlives the kernel."""
    ranks, holder[0] = holder[0], None
    if ranks is not None:
        ranks.close()
