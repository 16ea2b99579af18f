"""The relay of every rank's output to this process's ``sys.stdout`` and ``sys.stderr``.

Used by :class:`dtlib.launch.job.Job`, which reads the ranks' pipes and feeds what it reads here.
"""

from __future__ import annotations

import codecs
import collections
import contextlib
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

FLUSH_INTERVAL_S = 0.2  # relayed output is written at most 5 times a second per stream (one Jupyter message each)
FLUSH_AT_CHARS = 1 << 22  # ... or as soon as this much waits, which bounds the relay's memory
RECENT_STDERR_LINES, RECENT_LINE_CHARS = 20, 2000  # the stderr tail quoted when a rank dies


@dataclass(eq=False)
class _Source:
    """One rank's stdout or stderr, as the relay sees it."""

    prefix: str  # "[rank 3] "
    stream: str  # "out" or "err"
    shown: bool
    decoder: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))
    held: list[str] = field(default_factory=list)  # the start of a line not shown yet
    tail: str = ""  # the current line's last characters (stderr only, for death reports)
    recent: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=RECENT_STDERR_LINES))
    said: str = ""  # the last "what():" line: a C++ exception's reason as native code aborted the rank


class Relay:
    """Every rank's output, prefixed ``[rank N] `` line by line, written in batches.

    Each rank's bytes are cut into lines as they are read; whole lines wait at most
    ``FLUSH_INTERVAL_S`` and are written to ``sys.stdout``/``sys.stderr`` together, one
    write and one flush per stream, so that Jupyter sends a few messages a second rather
    than one per line (its server drops output above 1000 messages a second). A line
    without its newline yet (a progress bar) is shown once it has waited that long.
    ``write(stream, text)`` does the writing (tests record it).
    Example: ``relay.feed(0, "out", b"hi\\n"); relay.flush(final=True)`` prints ``[rank 0] hi``.
    """

    def __init__(self, output: str, clock: Callable[[], float] = time.monotonic,
                 write: Callable[[str, str], None] | None = None) -> None:
        self.output = output
        self.clock = clock
        self.write = write or write_to_sys
        self.sources: dict[tuple[int, str], _Source] = {}
        self.pending: dict[str, list[str]] = {"out": [], "err": []}
        self.pending_chars = 0
        self.open: dict[str, _Source | None] = {"out": None, "err": None}  # whose line is unfinished on screen
        self.waiting: dict[_Source, float] = {}  # sources holding part of a line, and since when
        self.next_flush = 0.0

    def _source(self, rank: int, stream: str) -> _Source:
        key = (rank, stream)
        if key not in self.sources:
            shown = self.output == "all" or (self.output == "rank0" and rank == 0)
            self.sources[key] = _Source(f"[rank {rank}] ", stream, shown)
        return self.sources[key]

    def feed(self, rank: int, stream: str, data: bytes) -> None:
        """Take what was read from a rank's pipe; ``b""`` means the pipe reached its end."""
        source = self._source(rank, stream)
        text = source.decoder.decode(data, final=not data)
        if stream == "err":
            self._remember(source, text)
        if not source.shown:
            return
        if not data:  # end of file: an unterminated last line becomes a line
            text, source.held = "".join(source.held) + text, []
            self.waiting.pop(source, None)
            if text or self.open[stream] is source:
                self._emit(source, text + "\n")
            return
        end = text.rfind("\n")
        if end < 0:
            if text:
                source.held.append(text)
                self.waiting.setdefault(source, self.clock())
            return
        self._emit(source, "".join(source.held) + text[:end + 1])
        source.held = [text[end + 1:]] if end + 1 < len(text) else []
        self.waiting.pop(source, None)
        if source.held:
            self.waiting[source] = self.clock()

    def _remember(self, source: _Source, text: str) -> None:
        end = text.rfind("\n")
        if end < 0:
            source.tail = (source.tail + text)[-RECENT_LINE_CHARS:]
            return
        lines = (source.tail + text[:end]).split("\n")
        source.said = next((line[-RECENT_LINE_CHARS:] for line in reversed(lines) if "what():" in line), source.said)
        source.recent.extend(line[-RECENT_LINE_CHARS:] for line in lines[-RECENT_STDERR_LINES:])
        source.tail = text[end + 1:][-RECENT_LINE_CHARS:]

    def last_words(self, rank: int) -> str | None:
        """The reason rank ``rank`` gave as native code aborted it, or None.

        A C++ exception nobody caught (gloo's size and dtype checks, NCCL's errors) ends a rank with
        ``terminate called ...`` and ``what():  [enforce fail at file:line] reason``, then the stacks
        faulthandler writes: the reason, without the source location, is what the error should say.
        Example: after ``what():  [enforce fail at pair.cc:456] 8 vs 4. Sizes differ.``, ``"8 vs 4. Sizes differ."``.
        """
        reason = self._source(rank, "err").said.partition("what():")[2]
        return re.sub(r"^\s*\[enforce fail at [^\]]*\]\s*", "", reason).strip() or None

    def recent_stderr(self, rank: int) -> str:
        """The last lines rank ``rank`` wrote to stderr (quoted when it dies)."""
        source = self._source(rank, "err")
        return "\n".join([*source.recent, source.tail] if source.tail else source.recent)

    def _emit(self, source: _Source, text: str) -> None:
        if not text:
            return
        stream, prefix = source.stream, source.prefix
        continued = self.open[stream] is source
        if self.open[stream] is not None and not continued:
            self._add(stream, "\n")  # end another rank's unfinished line first
        if "\r" in text:  # a carriage return starts the line again: keep the prefix visible
            text = text.replace("\r\n", "\n").replace("\r", "\r" + prefix)
        ends_line = text.endswith("\n")
        body = text[:-1] if ends_line else text
        text = ("" if continued else prefix) + body.replace("\n", "\n" + prefix)
        self._add(stream, text + "\n" if ends_line else text)
        self.open[stream] = None if ends_line else source

    def _add(self, stream: str, text: str) -> None:
        self.pending[stream].append(text)
        self.pending_chars += len(text)

    def due_in(self) -> float:
        """Seconds until output waits to be flushed (inf when nothing waits)."""
        if not (self.pending_chars or self.waiting):
            return float("inf")
        return max(0.0, self.next_flush - self.clock())

    def flush_if_due(self) -> None:
        if self.pending_chars >= FLUSH_AT_CHARS or (self.due_in() == 0.0):
            self.flush()

    def flush(self, final: bool = False) -> None:
        """Write what waits; partial lines that waited ``FLUSH_INTERVAL_S`` too (all of them if ``final``)."""
        now = self.clock()
        for source, since in list(self.waiting.items()):
            if final or now - since >= FLUSH_INTERVAL_S:
                del self.waiting[source]
                text, source.held = "".join(source.held), []
                self._emit(source, text + ("\n" if final else ""))
        for stream, source in self.open.items():
            if final and source is not None:
                self._add(stream, "\n")
                self.open[stream] = None
        for stream, pieces in self.pending.items():
            if pieces:
                self.write(stream, "".join(pieces))
                pieces.clear()
        self.pending_chars = 0
        self.next_flush = now + FLUSH_INTERVAL_S


def write_to_sys(stream: str, text: str) -> None:
    """Write to this process's ``sys.stdout`` (``"out"``) or ``sys.stderr``, as they are now."""
    with contextlib.suppress(AttributeError, OSError, ValueError):  # no stream, or a closed one
        target: Any = sys.stdout if stream == "out" else sys.stderr
        target.write(text)
        target.flush()
