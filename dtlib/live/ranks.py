"""``dtlib.LiveRanks``: ranks that stay alive between cells, so you can step through distributed code.

:func:`dtlib.spawn` runs a whole function per call: right for a job. ``LiveRanks`` keeps the
ranks (and their process group) alive, runs one piece of code at a time on every rank, and
lets you look at each rank's variables in between::

    ranks = dtlib.LiveRanks(world_size=2)
    ranks.run("t = torch.tensor([rank + 1.0], device=device)")
    ranks.run("dist.all_reduce(t); t")      # [tensor([3.]), tensor([3.])] (on the CPU)
    ranks.close()

Every rank's namespace starts with ``rank``, ``world_size``, ``device``, ``torch``, ``dist`` and
``nn``. A cell that runs past its timeout is explained by the hang doctor (:mod:`dtlib.live.doctor`):
which collective each rank waits in, and where the ranks disagree. The magics ``%ranks`` and
``%%ranks`` (:mod:`dtlib.live.magics`, after ``%load_ext dtlib``) drive the same object from cells.
"""

from __future__ import annotations

import ast
import pickle
import re
import sys
import threading
import time
import weakref
from typing import Any

from dtlib import arguments, compat
from dtlib.errors import RankFailure, WorkerError, WorkerTimeout
from dtlib.launch import joblog, pickling
from dtlib.launch.processes import HeldInterrupts
from dtlib.launch.spawn import rank_environment, resolve_backend, resolve_start_method, valid_world_size
from dtlib.live import doctor, server
from dtlib.live.generation import Generation, close_quietly
from dtlib.live.pushed import MeshSpec, ShardsByRank, to_send
from dtlib.live.server import RemoteRepr
from dtlib.live.stepping import Posts, RankStep, StepView, Trace, ran_to_the_end, step_past, unmet, will_wait

START_TIMEOUT_S = 120.0  # a hang guard for starting the ranks (a cold start imports torch in each)
CLOSE_WAIT_S = 30.0  # close() from another thread: how long it waits for the running call to stop its ranks
ABORT_WAIT_S = 10.0  # how long paused ranks may take to unwind their cell after %ranks abort
PAUSED = ("a stepped cell is paused on the ranks: end it with %ranks continue (ranks.resume()) or %ranks abort "
          "(ranks.abort()) before you {what}")
LOST = "the ranks were restarted with a fresh process group, so every rank's variables are gone"


#: What ``check_collectives`` sets in every rank's environment: torch's DETAIL debug mode wraps the process group
#: so that each collective first all-gathers a fingerprint (its op, shapes, dtypes and devices) on a helper gloo
#: group, and a mismatch raises on every rank ("Detected mismatch between collectives on ranks") instead of
#: hanging or, worse, returning garbage (a float32 all-reduce against an int32 one). It does not compare a root
#: (``src``, ``dst``) or a reduce op: a broadcast from different roots still hangs, and the hang doctor names the
#: roots. The cost: a barrier and an all-gather more per collective, on gloo (``python -m dtlib.bench live``
#: measures it: 3.8 ms against 1.4 ms for 4 floats on a 2-core CPU), too much for a benchmark.
COLLECTIVE_CHECK = ("TORCH_DISTRIBUTED_DEBUG", "DETAIL")


class LiveRanks:
    """``world_size`` ranks that stay alive between calls, each with its own namespace.

    Args:
        world_size: the number of ranks.
        backend: ``auto`` (NCCL with one GPU per rank, else gloo), ``gloo`` or ``nccl``.
        timeout: seconds a call may run before the hang doctor explains it and stops it;
            ``None`` waits for ever.
        check_collectives: compare every collective's call, shapes and dtypes across ranks before it runs
            (:data:`COLLECTIVE_CHECK`, torch's DETAIL mode), so that a mismatch raises at once, naming both
            sides, instead of hanging or returning garbage. ``None`` (the default): on, as befits a place to
            learn, wherever this torch's check works (:func:`dtlib.compat.collective_check_works`: 2.13 and
            newer); ``False`` (``%ranks start N --no-check``) runs collectives as a job does: a small all-reduce
            took 1.4 ms unchecked against 3.8 ms checked on a 2-core CPU.

    Example::

        with dtlib.LiveRanks(2) as ranks:
            ranks.push(scale=10)
            ranks.run("rank * scale")    # [0, 10]
    """

    def __init__(self, world_size: int = 2, *, backend: str = "auto", timeout: float | None = 30.0,
                 check_collectives: bool | None = None) -> None:
        self.world_size, self.backend, self.timeout = self.settings(world_size, backend, timeout)
        if check_collectives is not None and not isinstance(check_collectives, bool):
            raise TypeError(f"check_collectives must be True, False or None, got {check_collectives!r}")
        #: whether each collective is checked across ranks first (None asked for: where this torch can)
        self.check_collectives = compat.collective_check_works() if check_collectives is None else check_collectives
        self._env = rank_environment(backend, self.backend)  # CPU ranks on a GPU machine see no GPU
        self._asked = backend
        if self.check_collectives:  # torch's own check: every collective's op, shapes and dtypes compared across ranks
            self._env[COLLECTIVE_CHECK[0]] = COLLECTIVE_CHECK[1]
        self._method = resolve_start_method("auto")
        self._cells = 0
        self._sources: dict[str, list[str]] = {}
        self._holder: list[Generation | None] = [None]
        self._finalizer = weakref.finalize(self, close_quietly, self._holder)
        self._busy = threading.RLock()  # held by the thread inside a call: only it drives the ranks' event loop
        self._closing = threading.Event()  # close() from another thread asked that call to stop
        self._steps: dict[int, RankStep] | None = None  # while a stepped cell runs: each rank's state
        self._posted: Posts = {}  # ...and the calls stepped past that peers have still to meet (step_past)
        self.started_in_s = self._start()

    @staticmethod
    def settings(world_size: int, backend: str, timeout: float | None) -> tuple[int, str, float | None]:
        """The checked ``(world_size, backend, timeout)`` the constructor would use, or its ValueError: what
        ``%ranks start`` asks before it stops the running ranks. Example: ``settings(2, "auto", 30)``."""
        world_size = valid_world_size(world_size)
        return world_size, resolve_backend(backend, world_size), arguments.seconds("timeout", timeout)

    # -- life -----------------------------------------------------------------
    def _start(self) -> float:
        began = time.monotonic()
        joblog.record("live", self.world_size, self._asked, self.backend)
        ranks = Generation(self.world_size, self.backend, self._method, self._env)
        self._holder[0] = ranks
        owing = ranks.wait(set(range(self.world_size)), began + START_TIMEOUT_S)
        dead = ranks.dead()
        if owing or dead:
            stacks = ranks.job.collect_stacks(ranks=sorted(owing)) if owing and not dead else {}
            self.close()
            if dead:
                raise WorkerError(dead, note="the live ranks could not start")
            raise WorkerTimeout(START_TIMEOUT_S, stacks, [], outcome="the ranks did not start and were stopped.")
        ranks.flush_output()
        return time.monotonic() - began

    def _ranks(self) -> Generation:
        ranks = self._holder[0]
        if ranks is None:
            raise RuntimeError("these live ranks are closed; start new ones with dtlib.LiveRanks(...)")
        return ranks

    def _restart(self) -> None:
        """Close this generation and start the next; a Ctrl-C meanwhile waits until the new ranks are up (a
        half-started generation would take the next command before it could run it)."""
        held = HeldInterrupts()
        try:
            with held:
                ranks, self._holder[0] = self._holder[0], None
                if ranks is not None:
                    ranks.close()
                self._stop_if_closing()
                self._start()
        finally:
            held.deliver()

    def close(self) -> None:
        """Stop every rank; safe to call twice. Also runs at ``with``'s end, garbage collection and exit.

        From another thread while a call runs, it kills the ranks at once (their cell is lost, as the
        call's RuntimeError says), waits for that call to end, and leaves no process behind.
        """
        if not self._busy.acquire(blocking=False):
            self._closing.set()
            ranks = self._holder[0]
            if ranks is not None:
                ranks.kill()  # signals only, safe from any thread; the calling thread sees the deaths
            if not self._busy.acquire(timeout=CLOSE_WAIT_S):
                return  # that call will still stop and release everything when its event loop wakes
        try:
            ranks, self._holder[0] = self._holder[0], None
            waiting = self._steps is not None and any(row.state == "waiting" for row in self._steps.values())
            self._steps = None
            if ranks is not None:  # a rank waiting inside a collective cannot take "exit": no grace to wait out
                ranks.close(graceful=not self._closing.is_set() and not waiting)
            self._finalizer.detach()
        finally:
            self._busy.release()

    def _stop_if_closing(self) -> None:
        """In the calling thread: if close() came from another thread, release every rank and say so."""
        if self._closing.is_set():
            ranks, self._holder[0] = self._holder[0], None
            if ranks is not None:
                ranks.close()
            self._finalizer.detach()
            raise RuntimeError("these live ranks were closed by close() from another thread while this "
                               "run ran; its cell did not finish. Start new ones with dtlib.LiveRanks(...)")

    @property
    def closed(self) -> bool:
        return self._holder[0] is None

    def __enter__(self) -> LiveRanks:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "running"
        return f"LiveRanks(world_size={self.world_size}, backend={self.backend!r}, {state})"

    # -- calls ----------------------------------------------------------------
    def run(self, code: str, *, timeout: float | None = None, step: bool = False) -> Any:
        """Run ``code`` on every rank; each rank's value of a last bare expression (else None), by rank.

        With ``step=True`` every rank pauses just before its first collective instead, and a :class:`StepView`
        comes back: each rank's call and line, and what the ranks disagree on. :meth:`step` moves on,
        :meth:`peek` looks into the paused frames, :meth:`resume` runs to the end, :meth:`abort` ends the cell.

        Raises:
            SyntaxError: the code does not parse (checked here, before any rank runs it).
            WorkerError: a rank raised; the ranks and their variables stay, unless a rank died.
            WorkerTimeout: the code ran past ``timeout`` (default: the object's); says which
                collective each rank waits in, and whether the ranks had to be restarted.
        """
        __tracebackhide__ = True  # IPython shows the error, not dtlib's frames that carried it
        if not isinstance(code, str):
            raise TypeError(f"code must be a str of Python source, got {type(code).__name__}")
        self._refuse_while_paused("run another cell")
        self._cells += 1
        filename = server.CELL_FILENAME.format(number=self._cells)
        ast.parse(code, filename)  # a syntax error is the same on every rank: say it here
        self._sources[filename] = code.splitlines()
        if step:
            self._steps = {rank: RankStep(rank, "running") for rank in range(self.world_size)}
            self._posted = {}
            return self._stepped(("run", (code, self._cells, True)), set(range(self.world_size)), timeout)
        return self._call(("run", (code, self._cells)), timeout, "run")

    # -- stepping -------------------------------------------------------------
    @property
    def paused(self) -> bool:
        """Whether a stepped cell is under way (some rank paused before, or waiting inside, a collective)."""
        return self._steps is not None

    def _refuse_while_paused(self, what: str) -> None:
        if self._steps is not None:
            raise RuntimeError(PAUSED.format(what=what))

    def _paused_rows(self, what: str) -> dict[int, RankStep]:
        if self._steps is None:
            raise RuntimeError(f"nothing is paused, so there is nothing to {what}: start a stepped cell with "
                               "%%ranks --step (ranks.run(code, step=True))")
        ranks = self._holder[0]
        if ranks is not None and any(row.state == "waiting" for row in self._steps.values()):
            ranks.job.step(0.0)  # a rank shown waiting may have gone on since (its call returned at once): look
            for rank, row in list(self._steps.items()):
                if row.state == "waiting" and rank in ranks.answers:
                    self._steps[rank] = self._answered(rank, ranks.answers[rank])
            if all(not row.active for row in self._steps.values()):  # the cell ended by itself (a timeout): say so
                self._steps, self._posted = None, {}
                errors = self._errors(ranks)
                ranks.answers.clear()
                if errors:
                    raise WorkerError(_unique(errors), note="the stepped cell ended; the ranks keep their variables.")
                raise RuntimeError(f"nothing is paused, so there is nothing to {what}: the stepped cell has ended on "
                                   "every rank")
        return self._steps

    def step(self, count: int = 1, *, rank: int | None = None, timeout: float | None = None) -> StepView:
        """Move every paused rank (or ``rank`` alone) past its collective to the next one, ``count`` times.

        A rank whose peers stay paused waits inside its collective; the view says for whom, and the step returns
        at once. Example: ``ranks.step()``, ``ranks.step(rank=1)``."""
        __tracebackhide__ = True
        count = arguments.count("count", count, 1)
        view = self._view()
        for done in range(count):
            rows = self._paused_rows("step")
            if rank is not None and (not isinstance(rank, int) or rank not in rows):
                raise ValueError(f"rank must be one of 0..{self.world_size - 1}, got {rank!r}")
            moving = {r for r, row in rows.items() if row.state == "paused" and (rank is None or r == rank)}
            if not moving and done:
                break  # the steps so far left no rank paused: the view says why
            if not moving:
                waiting = "; ".join(f"rank {r} {state}" for r, state in view.states().items()
                                    if rows[r].state == "waiting")
                state = view.states()[rank] if rank is not None else "no rank is paused" + (
                    f" ({waiting})" if waiting else "")
                raise RuntimeError(f"nothing to step: {f'rank {rank} ' if rank is not None else ''}{state}")
            view = self._stepped(("step", None), moving, timeout)
            if view.finished:
                break
        return view

    def trace(self, code: str, *, timeout: float | None = None) -> Trace:
        """Run ``code`` stepped, collective by collective, to its end, and return every rank's calls in order.
        A disagreement ends it before anything is sent: the cell is aborted and a RuntimeError names it.
        Example: ``ranks.trace("model(x).sum().backward()").calls[0]`` -> DDP's or FSDP's calls on rank 0."""
        __tracebackhide__ = True
        view = self.run(code, timeout=timeout, step=True)
        calls: dict[int, list[Any]] = {rank: [] for rank in range(self.world_size)}
        while not view.finished:
            if view.problems:
                said = self.abort()
                raise RuntimeError("the trace stopped before anything was sent: " + " | ".join(view.problems)
                                   + f" ({said})")
            for rank, row in view.rows.items():
                if row.state == "paused" and row.call is not None:
                    calls[rank].append(row.call)
            view = self.step(timeout=timeout)
        return Trace(calls, view.values, server.CELL_FILENAME.format(number=self._cells))

    def resume(self, *, timeout: float | None = None) -> list[Any]:
        """``%ranks continue``: run every paused rank to the end of the cell without pausing; each rank's value of
        the last expression, as :meth:`run` returns it."""
        __tracebackhide__ = True
        return self._resumed(timeout).values or []

    def _resumed(self, timeout: float | None) -> StepView:
        """:meth:`resume`'s view of the end, its note saying how many collectives ran after the pause."""
        __tracebackhide__ = True
        rows = self._paused_rows("continue")
        paused = {r for r, row in rows.items() if row.state == "paused"}
        before = {r: row.call.index for r, row in rows.items() if row.call is not None}
        view = self._stepped(("continue", None), paused, timeout, to_the_end=True)
        return StepView(view.rows, note=ran_to_the_end(view.rows, before), checked=self.check_collectives)

    def abort(self) -> str:
        """End the stepped cell on every rank: each paused rank raises inside its cell, and the ranks keep their
        variables (what the cell assigned before the pause included). A rank waiting inside a collective cannot
        be reached: then every rank is restarted. Returns what became of the ranks."""
        __tracebackhide__ = True
        with self._busy:
            rows = self._paused_rows("abort")
            ranks = self._ranks()
            paused = {r for r, row in rows.items() if row.state == "paused"}
            owing: set[int] = set()
            for _ in range(3):  # a cell's bare `except:` may catch the abort and pause again: abort it again
                with HeldInterrupts():
                    ranks.send(("abort", None), paused)
                owing = ranks.wait(paused, time.monotonic() + ABORT_WAIT_S)
                paused = {r for r in paused - owing if ranks.answers[r][0] == "paused"}
                if not paused:
                    break
            swallowed = sorted(paused)  # paused again after every abort: the cell catches it (a bare except)
            ranks.flush_output()
            self._steps = None
            inside = sorted(r for r, row in rows.items() if row.state == "waiting") + sorted(owing)
            never = unmet(self._posted)
            self._posted = {}
            if swallowed:
                self._restart()
                who = f"rank {swallowed[0]}'s cell" if len(swallowed) == 1 else f"the cells of ranks {swallowed}"
                return (f"aborted; {who} caught the abort three times and paused again (an `except BaseException` "
                        f"or a bare `except:` around a collective?): {LOST}")
            if inside or ranks.dead():
                self._restart()
                who = f"rank {inside[0]} waited" if len(inside) == 1 else f"ranks {inside} waited"
                return f"aborted; {who} inside a collective, where nothing reaches it: {LOST}"
            if never:  # a posted call cannot be taken back: the peers' next call of its kind would meet it
                self._restart()
                return (f"aborted; {', '.join(never)} {'was' if len(never) == 1 else 'were'} posted and never met, "
                        f"and a process group cannot take a posted call back (the peers' next call of its kind would "
                        f"meet it instead of its own): {LOST}")
            ranks.answers.clear()
            return "aborted the cell on every rank; the ranks keep their variables"

    def peek(self, expression: str) -> list[Any]:
        """``expression`` evaluated on every rank in its paused frame (locals included), by rank; a rank that
        waits inside a collective cannot answer (its entry says so). Example: ``ranks.peek("x.sum()")``."""
        __tracebackhide__ = True
        if not isinstance(expression, str):
            raise TypeError(f"expression must be a str, got {type(expression).__name__}")
        try:
            compile(expression, "<peek>", "eval")
        except SyntaxError:
            raise ValueError(f"peek takes an expression, such as x.sum(), not a statement: {expression!r}; "
                             "nothing was run") from None
        return self._look("peek", expression)

    def where(self) -> dict[int, str]:
        """``%ranks where``: each rank's state and its Python stack now, innermost call last, from the cell's line
        in. A thread in each rank answers, so a rank blocked inside gloo or NCCL answers too. Example:
        ``{0: "paused before all_reduce #1 (SUM, float32[4])\n  File ...", 1: "idle, between cells"}``."""
        with self._busy:
            ranks = self._ranks()
            stacks = ranks.ask_doctor("where")
            states = StepView(self._steps).states() if self._steps is not None else {}
            said = {}
            for rank in range(self.world_size):
                stack = stacks.get(rank)
                state = states.get(rank) or ("no answer" if stack is None else "in a cell" if stack else
                                             "idle, between cells")
                said[rank] = state + (f"\n{stack}" if stack else "")
            return said

    def _look(self, kind: str, body: str) -> list[Any]:
        with self._busy:
            rows = self._paused_rows(kind)
            ranks = self._ranks()
            asked = {r for r, row in rows.items() if row.state != "waiting"}
            kept = {r: ranks.answers[r] for r in asked if r in ranks.answers}  # their step answers, kept
            with HeldInterrupts():
                ranks.send((kind, body), asked)
            owing = ranks.wait(asked, time.monotonic() + (self.timeout or START_TIMEOUT_S))
            ranks.flush_output()
            values: list[Any] = []
            failures = []
            for r in range(self.world_size):
                if r not in asked:
                    inside = rows[r].call.what() if rows[r].call else "a collective"
                    values.append(RemoteRepr(f"<rank {r} waits inside {inside}>", "waiting"))
                elif r in owing:
                    values.append(RemoteRepr(f"<rank {r} did not answer>", "?"))
                else:
                    status, body_ = ranks.answers.pop(r)
                    if status == "error":
                        failures.append(RankFailure(r, body_["type"], body_["message"], body_["traceback"]))
                        values.append(None)
                    else:
                        values.append(self._unpickle(r, body_))
            ranks.answers.update(kept)  # what each rank answered the step that paused it: its state
            if failures:
                raise WorkerError(failures, note="the cell stays paused; the ranks keep their variables.")
            return values

    def _view(self) -> StepView:
        return StepView(self._paused_rows("step"), checked=self.check_collectives, posted=self._posted)

    def _stepped(self, message: tuple[str, Any], moving: set[int], timeout: float | None,
                 to_the_end: bool = False) -> StepView:
        """Send ``message`` to the ``moving`` ranks, wait until every rank that can answer has (paused again,
        finished or raised), and return the new view. A rank that will block inside its collective (a peer
        stays paused) is not waited for; past ``timeout`` the ranks hang, and are explained and restarted."""
        __tracebackhide__ = True
        with self._busy:
            ranks = self._ranks()
            rows = self._steps or {}
            if ranks.dead():
                failures = ranks.dead()
                self._steps = None
                self._restart()
                raise WorkerError(failures, note=f"this happened while the cell was paused; {LOST}.")
            stepping = message[0] == "step" and not to_the_end
            stuck = will_wait(rows, moving, self.check_collectives, self._posted) if stepping else {}
            going = moving | {r for r, row in rows.items() if row.state in ("waiting", "running")}
            limit = self.timeout if timeout is None else arguments.seconds("timeout", timeout)
            if stepping:
                step_past(self._posted, rows, moving, self.check_collectives)
            with HeldInterrupts() as held:
                ranks.send(message, moving)
            try:
                held.deliver()
                # While stepping, a rank pauses before any collective, so it cannot block on a peer that raised:
                # wait for every answer. Run to the end, a rank can: an error then shortens the wait.
                deadline = time.monotonic() + (limit or float("inf"))
                owing = ranks.wait(going - set(stuck), deadline, stop_early=to_the_end,
                                   stop_on="paused" if to_the_end else "")
                while to_the_end:  # a rank that waited inside a call when continue came pauses at its next: on
                    again = {r for r in going if ranks.answers.get(r, ("",))[0] == "paused"}
                    if not again:
                        break
                    with HeldInterrupts():
                        ranks.send(message, again)
                    owing = ranks.wait(going, deadline, stop_early=True, stop_on="paused")
            except KeyboardInterrupt:
                self._steps = None
                with HeldInterrupts():
                    said = self._interrupted(ranks, going, rows)
                print(f"dtlib.LiveRanks: interrupted while stepping; {said}", file=sys.stderr)
                raise
            ranks.flush_output()
            new: dict[int, RankStep] = {}
            for r in range(self.world_size):
                if r in ranks.answers:
                    new[r] = self._answered(r, ranks.answers[r])
                elif r in stuck:
                    new[r] = RankStep(r, "waiting", rows[r].call, waiting_for=stuck[r])
                else:
                    new[r] = rows.get(r, RankStep(r, "running"))
            if owing or ranks.dead():
                self._steps = None
                self._end_stepping(ranks, owing, new, limit)
            self._steps = None if all(not row.active for row in new.values()) else new
            if self._steps is None:  # the cell ended on every rank: one that raised says so, as a plain cell does
                errors = self._errors(ranks)
                ranks.answers.clear()
                if errors:
                    raise WorkerError(_unique(errors), note="the stepped cell ended; the ranks keep their variables.")
            return StepView(new, checked=self.check_collectives, posted=self._posted)

    def _answered(self, rank: int, answer: tuple[str, Any]) -> RankStep:
        status, body = answer
        if status == "paused":
            return RankStep(rank, "paused", pickle.loads(body))
        if status == "error":
            return RankStep(rank, "raised", error=f"{body['type']}: {body['message']}".split("\n")[0][:300])
        data, count = body if isinstance(body, tuple) else (body, None)  # a stepped cell's end: its count too
        return RankStep(rank, "finished", value=self._unpickle(rank, data), collectives=count)

    def _end_stepping(self, ranks: Generation, owing: set[int], rows: dict[int, RankStep],
                      limit: float | None) -> None:
        """A stepped cell that hung or failed: explain it, end the cell on every rank, raise. Ranks that run
        Python code are interrupted and the paused ones aborted, keeping every rank's variables; a rank inside a
        collective, or one that died, restarts them all."""
        __tracebackhide__ = True
        errors = self._errors(ranks)
        dead = {failure.rank for failure in ranks.dead()}
        states = {r: "died" if r in dead else "running" if r in owing or rows[r].state == "waiting"
                  else "paused" if rows[r].state == "paused" else "failed" if rows[r].state == "raised"
                  else "finished" for r in range(self.world_size)}
        stacks = ({r: self._annotate(stack) for r, stack in ranks.job.collect_stacks(ranks=sorted(owing)).items()}
                  if owing and not dead else {})
        last = ranks.ask_doctor()
        lines, verdict = doctor.explain(states, last, stacks, checked=self.check_collectives)
        failures = _unique(ranks.dead() + errors)
        outcome = f"{LOST}."
        if self._ended_in_python(ranks, states, last):
            outcome = "each rank's cell was interrupted or aborted; the ranks kept their variables."
        else:
            self._restart()
        if failures:
            raise WorkerError(failures, note=f"{'; '.join(lines)}: {verdict}. {outcome[:1].upper()}{outcome[1:]}")
        raise WorkerTimeout(limit or 0.0, stacks, sorted(set(range(self.world_size)) - owing),
                            collectives=lines, verdict=verdict, outcome=outcome)

    def _interrupted(self, ranks: Generation, going: set[int], rows: dict[int, RankStep]) -> str:
        """A Ctrl-C while a step or continue waits: end the cell as a plain cell's interrupt does, keeping the
        variables where every rank still in the cell runs Python code or is paused; else restart. What became."""
        def state(r: int) -> str:  # what it answered last; else what it was doing when the step began
            status = ranks.answers.get(r, ("",))[0]
            if status:
                return {"paused": "paused", "error": "failed"}.get(status, "finished")
            if r in going:
                return "running"
            return "paused" if r in rows and rows[r].state == "paused" else "finished"

        states = {r: state(r) for r in range(self.world_size)}
        if self._ended_in_python(ranks, states, ranks.ask_doctor()):
            return "each rank's cell was interrupted or aborted, and the ranks kept their variables."
        self._restart()
        return f"{LOST}."

    def _ended_in_python(self, ranks: Generation, states: dict[int, str], last: dict[int, Any]) -> bool:
        """End a stepped cell without a restart where it can be: every running rank is in Python code, not inside
        a collective (SIGINT reaches it), the paused ones take an abort, and no call was posted that a peer never
        met (a process group cannot take it back). Whether every rank left the cell."""
        running = {r for r, state in states.items() if state == "running"}
        never, self._posted = unmet(self._posted), {}
        if never or ranks.dead() or any(last.get(r) is not None and not last[r].done for r in running):
            return False
        stuck = ranks.interrupt(running) if running else set()
        paused = {r for r, state in states.items() if state == "paused"}
        with HeldInterrupts():
            ranks.send(("abort", None), paused)
        stuck |= ranks.wait(paused, time.monotonic() + ABORT_WAIT_S)
        ranks.flush_output()
        if stuck or ranks.dead() or any(ranks.answers.get(r, ("",))[0] == "paused" for r in paused):
            return False
        ranks.answers.clear()
        return True

    def push(self, **values: Any) -> None:
        """Copy ``values`` (pickled by value, functions included) into every rank's namespace.

        A list of every rank's :class:`~dtlib.launch.shards.LocalShard` (a pulled DTensor) gives each rank its
        own shard back, rebuilt as a DTensor; a list of every rank's :class:`~dtlib.launch.shards.LocalMesh` (a
        pulled DeviceMesh) gives every rank the mesh back. What a rank could not rebuild as it is (one rank's part
        alone, a shard whose shape does not fit its placement) is refused here, before anything is sent
        (:func:`dtlib.live.pushed.to_send`). Example: ``ranks.push(lr=0.1, model=model)``.
        """
        __tracebackhide__ = True
        self._refuse_while_paused("push")
        values = {name: to_send(name, value, self.world_size) for name, value in values.items()}
        payload = pickling.dumps(values, parts=[(repr(name), value) for name, value in values.items()],
                                  refusal="cannot push {part} to the ranks")
        self._call(("push", payload), None, "push")
        for name, value in values.items():
            if isinstance(value, ShardsByRank):
                print(f"{name}: each rank got its own shard back, as a DTensor on a new mesh of the same ranks")
            elif isinstance(value, MeshSpec):
                dims = f", dims {value.mesh_dim_names}" if value.mesh_dim_names else ""
                print(f"{name}: every rank got the DeviceMesh back, rebuilt on the same ranks ({value.device_type}"
                      f"{dims})")

    def pull(self, name: str) -> list[Any]:
        """Every rank's value of ``name``, by rank. Example: ``ranks.pull("loss")`` -> ``[0.71, 0.69]``.

        Each value travels pickled: while it is rebuilt, this process holds the ranks' bytes and the values
        built so far, about world_size + 1 copies of one value at the peak, and no bytes once it returns."""
        __tracebackhide__ = True
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"name must be a Python identifier, got {name!r}")
        if self._steps is not None:
            return self._look("pull", name)
        return self._call(("pull", name), None, "pull")

    def _call(self, message: tuple[str, Any], timeout: float | None, what: str) -> list[Any]:
        __tracebackhide__ = True
        with self._busy:
            self._ranks()
            return self._call_held(message, timeout, what)

    def _call_held(self, message: tuple[str, Any], timeout: float | None, what: str) -> list[Any]:
        __tracebackhide__ = True
        ranks = self._ranks()
        if ranks.dead():  # died between calls (killed, out of memory): say so, start afresh
            failures = ranks.dead()
            self._restart()
            raise WorkerError(failures, note=f"this happened before the {what}, which did not run; {LOST}.")
        limit = self.timeout if timeout is None else arguments.seconds("timeout", timeout)
        everyone = set(range(self.world_size))
        with HeldInterrupts() as held:  # every rank gets the command, or none does
            ranks.send(message)
        try:
            held.deliver()  # a Ctrl-C during the send stops the cell as one during the wait does
            owing = ranks.wait(everyone, time.monotonic() + (limit or float("inf")), stop_early=True)
        except KeyboardInterrupt:
            with HeldInterrupts() as held:
                note = self._after_interrupt(ranks, everyone)
            print(f"dtlib.LiveRanks: interrupted; {note}", file=sys.stderr)
            held.deliver()
            raise
        # From here the ranks may still be in the cell (timed out, or waiting for a rank that failed or died): a
        # Ctrl-C while the doctor asks them and they are stopped waits until every rank is out of the cell or
        # restarted, then raises. Cut short, a rank would stay in the cell and answer it during the next one.
        held = HeldInterrupts()
        try:
            with held:
                self._settle(ranks, owing, limit)
        finally:
            if held.count:
                kept = "they kept their variables" if self._holder[0] is ranks else LOST
                print(f"dtlib.LiveRanks: interrupted; the interrupt waited until the ranks were out of the cell: "
                      f"{kept}.", file=sys.stderr)
            held.deliver()  # a KeyboardInterrupt, with the call's error (if any) as its context
        values = []
        for rank in range(self.world_size):  # each rank's bytes dropped once its value is built: a pull of
            values.append(self._unpickle(rank, ranks.answers.pop(rank)[1]))  # N large values peaks near N + 1
        return values

    def _settle(self, ranks: Generation, owing: set[int], limit: float | None) -> None:
        """After the wait: raise what went wrong, once every rank is out of the cell (stopped, or restarted)."""
        __tracebackhide__ = True
        self._stop_if_closing()
        ranks.flush_output()
        if ranks.dead():
            failures = _unique(ranks.dead() + self._errors(ranks))
            lines, verdict = doctor.explain(self._states(ranks, owing), ranks.ask_doctor(),
                                            checked=self.check_collectives)
            self._restart()
            raise WorkerError(failures, note=f"{'; '.join(lines)}: {verdict}. {LOST[:1].upper()}{LOST[1:]}.")
        errors = self._errors(ranks)
        if owing:
            lines, verdict, stacks, outcome = self._stop(ranks, owing)
            if errors:  # the others waited for the rank that failed: say where, not "timed out"
                raise WorkerError(errors, note=f"{'; '.join(lines)}: {verdict}. {outcome}")
            raise WorkerTimeout(limit or 0.0, stacks, sorted(set(range(self.world_size)) - owing),
                                collectives=lines, verdict=verdict, outcome=outcome)
        if errors:
            raise WorkerError(errors, note="the ranks are still running, with their variables.")

    def _after_interrupt(self, ranks: Generation, everyone: set[int]) -> str:
        owing = everyone - set(ranks.answers)
        last = ranks.ask_doctor()
        stuck = ranks.interrupt(owing) if owing else set()
        ranks.flush_output()
        states = {rank: "running" if rank in stuck else "finished" for rank in everyone}
        if stuck or ranks.dead() or doctor.group_is_broken(states, last):
            self._restart()
            return f"{LOST}."
        return "every rank stopped its cell and kept its variables."

    def _stop(self, ranks: Generation, owing: set[int]) -> tuple[list[str], str, dict[int, str], str]:
        """Explain why ``owing`` ranks are still in the cell, then stop them: by an interrupt when
        none waits inside a collective (SIGINT cannot reach a rank blocked in gloo or NCCL), else
        by restarting every rank. Returns the doctor's lines and verdict, the stacks, and the outcome."""
        states = self._states(ranks, owing)
        last = ranks.ask_doctor()
        stacks = {rank: self._annotate(stack) for rank, stack in ranks.job.collect_stacks(ranks=sorted(owing)).items()}
        lines, verdict = doctor.explain(states, last, stacks, checked=self.check_collectives)
        blocked = any(last.get(rank) is not None and not last[rank].done for rank in owing)
        stuck = owing if blocked else ranks.interrupt(owing)
        ranks.flush_output()
        after = {rank: "running" if rank in stuck else "finished" for rank in range(self.world_size)}
        if stuck or ranks.dead() or doctor.group_is_broken(after, ranks.ask_doctor()):
            self._restart()
            return lines, verdict, stacks, f"{LOST}."
        return lines, verdict, stacks, "each rank's cell was interrupted; the ranks kept their variables."

    def _states(self, ranks: Generation, owing: set[int]) -> dict[int, str]:
        """Each rank's state for the doctor: died, running (still in the cell), failed or finished."""
        dead = {failure.rank for failure in ranks.dead()}
        return {rank: "died" if rank in dead else "running" if rank in owing else
                "failed" if ranks.answers[rank][0] == "error" else "finished" for rank in range(self.world_size)}

    def _errors(self, ranks: Generation) -> list[RankFailure]:
        failures = []
        for rank, (status, body) in sorted(ranks.answers.items()):
            if status == "error":
                failures.append(RankFailure(rank, body["type"], body["message"], body["traceback"]))
        return failures

    def _unpickle(self, rank: int, data: bytes) -> Any:
        try:
            return pickle.loads(data)
        except Exception as exc:  # noqa: BLE001 - a class this kernel cannot import, say
            return RemoteRepr(f"<a value that could not be rebuilt here: {exc}>", "?")  # the same text on each rank

    def _annotate(self, stack: str) -> str:
        """Add each cell line's source under faulthandler's ``File "<rank cell 3>", line 2`` lines."""
        def add_source(match: re.Match[str]) -> str:
            lines = self._sources.get(match.group(1), [])
            number = int(match.group(2))
            source = lines[number - 1].strip() if 0 < number <= len(lines) else ""
            return match.group(0) + (f"\n      {source}" if source else "")

        return re.sub(r'File "(<rank cell \d+>)", line (\d+)[^\n]*', add_source, stack)


def _unique(failures: list[RankFailure]) -> list[RankFailure]:
    by_rank: dict[int, RankFailure] = {}
    for failure in failures:
        by_rank.setdefault(failure.rank, failure)
    return list(by_rank.values())

