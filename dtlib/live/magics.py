"""``%ranks`` and ``%%ranks``: live ranks from notebook cells (load with ``%load_ext dtlib``).

- ``%ranks start N [--backend B] [--timeout S]``: start N live ranks (closing any running ones).
- ``%%ranks [--timeout S]``: run the cell on every rank; output arrives live, ``[rank N]`` on each
  line, and the ranks' last-expression values are shown side by side (:class:`RankValues`).
- ``%ranks push NAME ...``: copy kernel variables to every rank.
- ``%ranks pull NAME ...``: every rank's ``NAME``, as a list under ``NAME`` in the kernel, shown side by side.
  With ``--quiet`` nothing is shown and the lists are returned instead: ``before, x = %ranks pull --quiet before x``.
- ``%%ranks --step``: run the cell with every rank paused before its first collective; a table shows each rank's
  call and line (:class:`dtlib.live.stepping.StepView`). ``%ranks step [K] [--rank R]`` moves on,
  ``%ranks peek EXPR`` evaluates an expression in every paused frame, ``%ranks continue`` runs to the end,
  ``%ranks abort`` ends the cell, ``%ranks where`` shows each rank's state and Python stack. ``%%ranks --trace [NAME]``
  steps the cell to its end, lists every collective each rank called, in order, and keeps the
  :class:`dtlib.live.stepping.Trace` under NAME (``trace`` by default): ``traces = %ranks traces`` returns them.
- ``%ranks stop``; ``%ranks`` alone says what is running.
"""

from __future__ import annotations

import argparse
import functools
import shlex
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.display import display

from dtlib.live.ranks import LiveRanks
from dtlib.live.rankview import RankValues


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would exit the kernel
        raise UsageError(f"%ranks: {message}\n{self.format_usage()}")


UNCHECKED = " (collectives not checked)"


@functools.cache
def _cell_parser() -> _Parser:
    """The options of a ``%%ranks`` cell, built once."""
    parser = _Parser(prog="%%ranks", add_help=False)
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--step", action="store_true")
    parser.add_argument("--trace", nargs="?", const="trace", default=None)  # the name %ranks traces gives it
    return parser


#: What a ``%%ranks`` cell without options parses to.
_PLAIN_CELL = argparse.Namespace(timeout=None, step=False, trace=None)


def _parser() -> _Parser:
    parser = _Parser(prog="%ranks", add_help=False)
    sub = parser.add_subparsers(dest="command")
    start = sub.add_parser("start", add_help=False)
    start.add_argument("world_size", type=int)
    start.add_argument("--backend", default="auto")
    start.add_argument("--timeout", type=float, default=30.0)
    # --no-check: no comparing of each collective's call, shapes and dtypes across ranks before it runs
    start.add_argument("--check", action=argparse.BooleanOptionalAction, default=None)
    sub.add_parser("push", add_help=False).add_argument("names", nargs="+")
    pull = sub.add_parser("pull", add_help=False)
    pull.add_argument("--quiet", action="store_true")
    pull.add_argument("names", nargs="+")
    sub.add_parser("stop", add_help=False)
    step = sub.add_parser("step", add_help=False)
    step.add_argument("count", type=int, nargs="?", default=1)
    step.add_argument("--rank", type=int, default=None)
    sub.add_parser("continue", add_help=False)
    sub.add_parser("abort", add_help=False)
    sub.add_parser("where", add_help=False)
    sub.add_parser("traces", add_help=False)
    return parser


@magics_class
class RanksMagics(Magics):
    """The ``ranks`` magic; one set of live ranks per kernel, in ``self.live``."""

    live: LiveRanks | None = None

    def __init__(self, shell: Any = None) -> None:
        super().__init__(shell=shell)
        self.traces: dict[str, Any] = {}  # %%ranks --trace NAME -> its Trace, for %ranks traces

    @line_cell_magic
    def ranks(self, line: str, cell: str | None = None) -> Any:
        __tracebackhide__ = True  # IPython leaves dtlib's own frames out of the traceback: the error is the news
        if cell is not None:
            return self._run_cell(line, cell)
        if line.strip().split(" ", 1)[0] == "peek":  # the rest of the line is Python, not options
            expression = line.strip()[len("peek"):].strip()
            if not expression:
                raise UsageError("%ranks peek: give an expression to evaluate on every paused rank: "
                                 "%ranks peek x.sum()")
            display(RankValues(self._stepping().peek(expression), name=expression))
            return None
        args = _parser().parse_args(shlex.split(line))
        if args.command is None:
            print(self.live if self.live is not None and not self.live.closed else "no live ranks")
        elif args.command == "start":
            try:  # checked before the running ranks stop: a refused start must not lose their variables
                LiveRanks.settings(args.world_size, args.backend, args.timeout)
            except ValueError as exc:
                raise UsageError(f"%ranks start: {exc} (the running ranks, if any, keep going)") from None
            self._stop()
            try:
                self.live = LiveRanks(args.world_size, backend=args.backend, timeout=args.timeout,
                                      check_collectives=args.check)
            except ValueError as exc:
                raise UsageError(f"%ranks start: {exc}") from None
            print(f"{self.live.world_size} live ranks on {self.live.backend}, "
                  f"started in {self.live.started_in_s:.1f} s{'' if self.live.check_collectives else UNCHECKED}")
        elif args.command == "step":
            view = self._stepping().step(args.count, rank=args.rank)
            display(view)
            if view.values is not None and any(value is not None for value in view.values):
                display(RankValues(view.values))
        elif args.command == "continue":
            view = self._stepping()._resumed(None)
            if view.note:
                print(view.note)
            if any(value is not None for value in view.values or []):
                display(RankValues(view.values))
        elif args.command == "traces":  # traces = %ranks traces; traces["first"].calls[0]
            return dict(self.traces)
        elif args.command == "where":
            for rank, said in self._live().where().items():
                print(f"rank {rank}: {said}")
        elif args.command == "abort":
            print(self._stepping().abort())
        elif args.command == "stop":
            print("stopped the live ranks" if self._stop() else "no live ranks to stop")
        elif args.command == "push":
            missing = [name for name in args.names if name not in self.shell.user_ns]
            if missing:
                raise UsageError(f"%ranks push: no variable named {', '.join(missing)} in this kernel")
            self._live().push(**{name: self.shell.user_ns[name] for name in args.names})
        elif args.command == "pull":
            pulled = []
            for name in args.names:
                values = self._live().pull(name)
                self.shell.user_ns[name] = values
                pulled.append(values)
                if not args.quiet:
                    display(RankValues(values, name=name))
            if args.quiet:  # the data, for a figure: one list, or a tuple of lists
                return pulled[0] if len(pulled) == 1 else tuple(pulled)
        return None

    def _run_cell(self, line: str, cell: str) -> Any:
        __tracebackhide__ = True
        # A plain cell (no options, nearly every one) skips argparse: building and running a parser cost a
        # plain cell's round trip about a tenth (docs/results/live_cpu.md).
        args = _cell_parser().parse_args(shlex.split(line)) if line.strip() else _PLAIN_CELL
        if args.trace is not None:
            trace = self.traces[args.trace] = self._live().trace(cell, timeout=args.timeout)
            print(trace)
            if trace.values and any(value is not None for value in trace.values):
                display(RankValues(trace.values))
            return None
        if args.step:
            display(self._live().run(cell, timeout=args.timeout, step=True))
            return None
        values = self._live().run(cell, timeout=args.timeout)
        if any(value is not None for value in values):
            display(RankValues(values))
        return None

    def _live(self) -> LiveRanks:
        if self.live is None or self.live.closed:
            raise UsageError("no live ranks: start them first with %ranks start 2")
        return self.live

    def _stepping(self) -> LiveRanks:
        """The live ranks, with a stepped cell paused on them (else a UsageError that says how to start one)."""
        live = self._live()
        if not live.paused:
            raise UsageError("%ranks: nothing is paused; run a cell with %%ranks --step first")
        return live

    def _stop(self) -> bool:
        live, self.live = self.live, None
        if live is None or live.closed:
            return False
        live.close()
        return True


_loaded: list[RanksMagics] = []


def load(ipython: Any) -> None:
    """Register the magics. The ranks stop with the kernel (``LiveRanks`` closes itself at exit)."""
    if not _loaded:
        _loaded.append(RanksMagics(ipython))
        ipython.register_magics(_loaded[0])


def unload(ipython: Any) -> None:
    """``%unload_ext dtlib``: stop the live ranks."""
    if _loaded:
        _loaded[0]._stop()
