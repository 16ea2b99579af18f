"""The kernel's side of stepping: each rank's state, what a step will leave waiting, and the table.

:class:`dtlib.LiveRanks` keeps one :class:`RankStep` per rank while a stepped cell runs (``run(code, step=True)``,
``%%ranks --step``). Before it moves any rank, :func:`will_wait` says which ranks will block inside their
collective (a peer stays paused, or calls something else), so that a step answers at once instead of waiting
for a rank that cannot move. :func:`disagreements` names what the ranks' next calls get wrong before anything is
sent. :class:`StepView` is what a step returns and a notebook shows: one row per rank.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

import torch

from dtlib.live.stepper import C10D_CALLS, UNEQUAL_TENSORS, Call

#: Calls that return before their peer arrives: the wait comes later, in ``work.wait()``, where no pause is.
NON_BLOCKING = {"isend", "irecv", "batch_isend_irecv"}
WORLD_NAME = "0"  # the default group's name in torch: the table shows its ranks alone


@dataclass(frozen=True)
class RankStep:
    """One rank in a stepped cell. ``state``: ``"paused"`` (before ``call``), ``"waiting"`` (inside ``call``, for
    ``waiting_for``), ``"finished"`` (the cell's ``value``) or ``"raised"`` (``error``)."""

    rank: int
    state: str
    call: Call | None = None
    value: Any = None
    error: str = ""
    waiting_for: tuple[int, ...] = ()
    collectives: int | None = None  # once finished: the collectives its cell ran in all, continued ones included

    @property
    def active(self) -> bool:
        return self.state in ("paused", "waiting")


def matches(call: Call, other: Call, rank: int, peer: int) -> bool:
    """Whether ``peer``'s ``other`` is the call that completes ``rank``'s ``call``: the same collective on the
    same group, or the other end of a transfer."""
    if call.p2p or other.p2p:
        return (call.p2p and other.p2p and call.root in (peer, None) and other.root in (rank, None)
                and call.transfer != other.transfer)
    return call.group == other.group and (call.kind or call.op) == (other.kind or other.op)


def will_wait(rows: dict[int, RankStep], moving: set[int], checked: bool = False,
              posted: Posts | None = None) -> dict[int, tuple[int, ...]]:
    """The ranks that will block inside their call once ``moving`` (paused ranks) are stepped, each with the
    peers it waits for. A rank waits while a peer it needs is not moving too, or moves into another call.
    ``checked`` (the collective check, torch's DETAIL mode): ranks that all move into different collectives of
    one group do not wait; the check compares their calls and raises on each, at once. ``posted``: a peer that
    posted its part earlier (:func:`step_past`) is there already."""
    going = {rank for rank in moving if rows[rank].state == "paused"} | {
        rank for rank, row in rows.items() if row.state == "waiting"}
    stuck: dict[int, tuple[int, ...]] = {}
    for rank in sorted(going):
        call = rows[rank].call
        if call is None or not blocking(call, checked):
            continue
        missing = tuple(peer for peer in call.peers if peer != rank and posted_by(posted, peer, rank, call) is None
                        and (peer not in going or rows[peer].call is None
                             or not matches(call, rows[peer].call, rank, peer)))
        if checked and missing and all(caught_by_the_check(call, rows[peer].call) for peer in missing
                                       if peer in going):
            missing = tuple(peer for peer in missing if peer not in going)
        if missing:  # a peer in the same call is no reason: whatever holds it is among this call's peers too
            stuck[rank] = missing
    return stuck


def blocking(call: Call, checked: bool = False) -> bool:
    """Whether ``call`` blocks until its peers arrive: not an ``isend``, ``irecv`` or ``batch_isend_irecv``,
    nor a collective called with ``async_op=True`` or a functional one (the wait comes later, in ``work.wait()``
    or when the result is read), unless ``checked``: the collective check compares every collective across the
    ranks before it starts, async or not, so there a collective blocks."""
    return call.op not in NON_BLOCKING and (not call.async_op or (checked and not call.p2p))


def caught_by_the_check(call: Call, other: Call | None) -> bool:
    """Whether the collective check raises on both ranks when one calls ``call`` and the other ``other``: two
    different collectives of one group (torch's wrapper compares each call's operation and its tensors' shapes
    and dtypes before either runs; not its root or reduce op)."""
    return other is not None and not call.p2p and not other.p2p and call.group == other.group


def _differ(calls: dict[int, Call]) -> str:
    """What the ranks' calls of one collective disagree on, or ''."""
    first_rank = min(calls)
    first = calls[first_rank]
    # Split sizes are not compared: an uneven all-to-all's differ by rank by design (what rank r sends to rank i
    # is what i expects from r), and so do its tensors.
    for field, label in (("kind", "operations"), ("root", "roots"), ("reduce_op", "reduce ops"),
                         ("tensors", "tensors")):
        if field == "tensors" and (_underlying(first) in UNEQUAL_TENSORS or first.splits):
            continue
        values = {rank: getattr(call, field) for rank, call in calls.items()}
        if len(set(values.values())) > 1:
            return f"different {label}: " + ", ".join(f"rank {rank} calls {calls[rank].what(field == 'tensors')}"
                                                      for rank in sorted(calls))
    return _splits_disagree(calls)


def _splits(call: Call) -> tuple[list[int], list[int]] | None:
    """An all-to-all's output and input split sizes, from ``"splits out [1, 3] in [2, 2]"`` (None: not given)."""
    if not call.splits.startswith("splits out "):
        return None
    out, _, into = call.splits.removeprefix("splits out ").partition(" in ")
    try:
        return [int(size) for size in out.strip("[]").split(",") if size.strip()], \
            [int(size) for size in into.strip("[]").split(",") if size.strip()]
    except ValueError:
        return None


def _splits_disagree(calls: dict[int, Call]) -> str:
    """Where an uneven all-to-all's split sizes do not pair up: what rank r expects from rank j
    (``output_split_sizes[j]`` on r) must be what j sends to r (``input_split_sizes[r]`` on j), or ''."""
    members = next(iter(calls.values())).members
    given = {rank: _splits(call) for rank, call in calls.items()}
    if set(calls) != set(members) or any(split is None or not split[0] or not split[1] for split in given.values()):
        return ""  # not every rank here, or even splits (empty lists): nothing to pair
    for r in members:
        for j in members:
            expects, sends = given[r][0][members.index(j)], given[j][1][members.index(r)]  # type: ignore[index]
            if expects != sends:
                return (f"split sizes that do not pair up: rank {r} expects {expects} from rank {j} "
                        f"(output_split_sizes[{members.index(j)}]), and rank {j} sends it {sends} "
                        f"(input_split_sizes[{members.index(r)}])")
    return ""


def _underlying(call: Call) -> str:
    """The collective ``call`` runs, whatever the cell called: ``gather`` for a ``gather_object``."""
    return C10D_CALLS.get(call.kind.removeprefix("c10d."), call.op) if call.kind.startswith("c10d.") else call.op


@dataclass
class Posted:
    """A call a rank stepped past that returned before its peers came to theirs (an isend or irecv, a collective
    with ``async_op=True``, a functional one): ``awaiting``, the peers whose part of it is still to come."""

    call: Call
    awaiting: set[int]


Posts = dict[int, list[Posted]]  # rank -> the calls it posted that peers have still to meet, oldest first


def posted_by(posted: Posts | None, peer: int, rank: int, call: Call) -> Call | None:
    """``peer``'s posted call that ``rank``'s ``call`` is its part of (the other end of a transfer, the same
    collective), or None."""
    return next((entry.call for entry in (posted or {}).get(peer, [])
                 if rank in entry.awaiting and matches(call, entry.call, rank, peer)), None)


def step_past(posted: Posts, rows: dict[int, RankStep], moving: set[int], checked: bool) -> None:
    """Note that the ``moving`` ranks step past their calls: each meets its peers' posted calls that it completes,
    and a call that returns before its peers come (:func:`blocking`) is posted, awaiting the peers not yet at
    theirs (a peer waiting inside its part, moving now, or posted before, is there)."""
    calls = {rank: rows[rank].call for rank in moving if rows[rank].call is not None}
    there = {rank: row.call for rank, row in rows.items() if row.state == "waiting" and row.call is not None}
    there.update(calls)
    met: dict[int, set[int]] = {}
    for rank, call in calls.items():
        for peer in call.peers:
            entry = next((entry for entry in posted.get(peer, []) if peer != rank and rank in entry.awaiting
                          and matches(call, entry.call, rank, peer)), None)
            if entry is not None:
                entry.awaiting.discard(rank)
                met.setdefault(rank, set()).add(peer)
    for rank, call in calls.items():
        if blocking(call, checked) or (call.p2p and call.root is None):  # a recv from any: the first sender meets it
            continue
        awaiting = {peer for peer in call.peers if peer != rank and peer not in met.get(rank, set())
                    and not (peer in there and matches(call, there[peer], rank, peer))}
        if awaiting:
            posted.setdefault(rank, []).append(Posted(call, awaiting))
    for rank in list(posted):
        posted[rank] = [entry for entry in posted[rank] if entry.awaiting]
        if not posted[rank]:
            del posted[rank]


def unmet(posted: Posts) -> list[str]:
    """Each posted call still awaiting a peer, in words: ``rank 0's isend #1 (dst=1, float32[2])``."""
    return [f"rank {rank}'s {entry.call.what()}" for rank, entries in sorted(posted.items()) for entry in entries]


def disagreements(rows: dict[int, RankStep], checked: bool = False, posted: Posts | None = None) -> list[str]:
    """What will go wrong when the ranks' next calls run, found before any of them runs: ranks of one group
    calling different collectives, roots, reduce ops or shapes, and ranks that will wait for ever (a peer in
    another call, finished or raised). Each problem is one sentence. ``checked``: under the collective check, ranks
    of one group in different collectives raise instead of waiting for each other (:func:`will_wait`).
    ``posted``: the calls the ranks stepped past that their peers have still to meet (:func:`step_past`): a
    transfer's other end posted earlier, inside ``batch_isend_irecv`` say, or a peer's part of a collective it
    posted with ``async_op=True``, is compared in place of the peer's next call."""
    problems: list[str] = []
    named: set[int] = set()
    cycle = _cycle(_waits_for(rows, posted))
    ring = _blocking_ring(rows, cycle)  # named once, below, rather than as one unmatched transfer per rank
    for rank, row in sorted(rows.items()):
        call = row.call
        if not row.active or call is None or rank in named:
            continue
        if call.p2p:
            peer = call.root
            if peer is None or peer not in rows:
                continue
            earlier = posted_by(posted, peer, rank, call)
            if earlier is not None:  # the other end is posted already: it waits for this one
                if not _alike(earlier, call):
                    problems.append(f"rank {rank}'s {call.what()} and rank {peer}'s {earlier.what()}, posted "
                                    f"earlier, move different tensors: {_mismatched_transfer(call, earlier)}")
                continue
            other = rows[peer]
            if not other.active and blocking(call):
                problems.append(f"rank {rank}'s {call.what()} waits for ever: rank {peer} {_ended(other)}")
            elif other.active and other.call is not None and matches(call, other.call, rank, peer) \
                    and not _alike(call, other.call):
                named |= {rank, peer}  # the pair, once
                problems.append(f"rank {rank}'s {call.what()} and rank {peer}'s {other.call.what()} move different "
                                f"tensors: {_mismatched_transfer(call, other.call)}")
            elif other.active and other.call is not None and not matches(call, other.call, rank, peer) \
                    and blocking(call) and blocking(other.call):
                if other.call.p2p and other.call.root == rank and other.call.transfer == call.transfer:
                    if rank < peer:  # the pair, once: each waits in its own blocking call for the other's
                        problems.append(f"ranks {rank} and {peer} both {call.transfer} to each other before either "
                                        f"{'receives' if call.transfer == 'send' else 'sends'}: a deadlock")
                elif rank not in ring:
                    problems.append(f"rank {rank}'s {call.what()} is not matched: rank {peer} calls "
                                    f"{other.call.what()}")
            continue
        on_group = {peer: rows[peer].call for peer in call.members if peer in rows and rows[peer].active
                    and rows[peer].call is not None and not rows[peer].call.p2p
                    and rows[peer].call.group == call.group
                    and posted_by(posted, rank, peer, rows[peer].call) is None}  # not its part of an earlier one
        for peer in call.members:  # a peer's part posted earlier (async_op=True) stands for it
            earlier_part = posted_by(posted, peer, rank, call) if peer != rank else None
            if earlier_part is not None:
                on_group[peer] = earlier_part
        elsewhere = [peer for peer in call.members if peer in rows and peer not in on_group]
        named |= set(on_group)
        difference = _differ(on_group)  # type: ignore[arg-type]
        if difference:
            problems.append(f"ranks {list(call.members)}: {difference}" if call.group == WORLD_NAME else
                            f"group {call.group} {list(call.members)}: {difference}")
        for peer in elsewhere:  # a peer in another call is a wait (it may finish it and come), unless a cycle
            other = rows[peer]
            if not other.active:
                problems.append(f"{_ranks(sorted(on_group))} will wait for ever in {_named(call)}: rank {peer} "
                                f"{_ended(other)}")
    caught = checked and all(caught_by_the_check(rows[rank].call, rows[cycle[(i + 1) % len(cycle)]].call)
                             for i, rank in enumerate(cycle))
    hops = "; ".join(f"rank {rank} in {_named(rows[rank].call)} for rank {cycle[(i + 1) % len(cycle)]}"
                     for i, rank in enumerate(cycle))
    if ring:
        first, then = ("send", "receive") if rows[cycle[0]].call.transfer == "send" else ("receive", "send")
        problems.append(f"{_ranks(sorted(cycle))} each {first} before they {then}, in a ring: a deadlock, each "
                        f"waiting for the next: {hops}. Post both ends in one dist.batch_isend_irecv, or let even "
                        f"ranks send first and odd ranks receive first")
    elif cycle and not caught and not all(rows[rank].call.p2p for rank in cycle):  # a pair of sends: named above
        problems.append(f"{_ranks(sorted(cycle))} will wait for ever, each for the next: {hops}")
    return problems


def _blocking_ring(rows: dict[int, RankStep], cycle: list[int]) -> set[int]:
    """The ranks of ``cycle`` when it is a ring of three or more blocking transfers of one kind (each rank sends
    to the next, or each receives from the next, and nobody the other way), else none."""
    calls = [rows[rank].call for rank in cycle]
    if len(cycle) < 3 or any(call is None or not call.p2p or not blocking(call) for call in calls):
        return set()
    if len({call.transfer for call in calls}) != 1:  # type: ignore[union-attr]
        return set()
    return set(cycle)


def _alike(send: Call, receive: Call) -> bool:
    """Whether a transfer's two ends move the same bytes as the same dtype: the same tensors, or tensors that
    differ in shape alone (a 0-d tensor into one of one element, as torch 2.11's pipeline schedules send)."""
    dtypes = [[tensor.split("[", 1)[0] for tensor in call.tensors] for call in (send, receive)]
    return send.tensors == receive.tensors or (dtypes[0] == dtypes[1] and send.elements() == receive.elements())


def _bytes(call: Call) -> int:
    """The bytes ``call``'s tensors hold: ``("float32[4]",)`` -> 16."""
    sizes = [getattr(torch, tensor.split("[", 1)[0]).itemsize for tensor in call.tensors]
    return sum(size * count for size, count in zip(sizes, call.elements(), strict=True))


def _mismatched_transfer(call: Call, other: Call) -> str:
    """What a send and a receive of different tensors do: the receiver's buffer decides."""
    send, receive = (call, other) if call.transfer == "send" else (other, call)
    if _bytes(send) > _bytes(receive):
        return ("more bytes arrive than the receiving buffer holds: gloo aborts the receiver, and on NCCL the "
                "result is undefined")
    return ("the receiver gets the sender's bytes read as its own dtype and shape, and no error (gloo); on NCCL the "
            "result is undefined")


def _named(call: Call) -> str:
    """The call, with its group where it is not the world's."""
    return call.what() + (f" on group {call.group}" if call.group != WORLD_NAME else "")


def _waits_for(rows: dict[int, RankStep], posted: Posts | None = None) -> dict[int, list[int]]:
    """Each paused or waiting rank -> the peers its blocking call needs that are in another call now (and did not
    post their part earlier)."""
    graph: dict[int, list[int]] = {}
    for rank, row in rows.items():
        call = row.call
        if not row.active or call is None or not blocking(call):
            continue
        graph[rank] = [peer for peer in call.peers if peer != rank and peer in rows and rows[peer].active
                       and rows[peer].call is not None and not matches(call, rows[peer].call, rank, peer)
                       and posted_by(posted, peer, rank, call) is None]
    return graph


def _cycle(graph: dict[int, list[int]]) -> list[int]:
    """One cycle of the wait-for graph, in order, or []: ranks that each wait for the next, for ever."""
    state: dict[int, int] = {}  # 1: on the current path, 2: done

    def visit(node: int, path: list[int]) -> list[int]:
        state[node] = 1
        path.append(node)
        for peer in graph.get(node, []):
            if state.get(peer) == 1:
                return path[path.index(peer):]
            if peer not in state:
                found = visit(peer, path)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [])
            if found:
                return found
    return []


def _ended(row: RankStep) -> str:
    return "has finished the cell" if row.state == "finished" else f"raised {row.error}"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(rank) for rank in ranks)


def _state(row: RankStep, rows: dict[int, RankStep]) -> str:
    if row.state == "paused":
        return f"paused before {row.call.what()}" if row.call else "paused"
    if row.state == "waiting" and row.call is not None:
        why: dict[str, list[int]] = {}  # the reason -> the peers it holds, so that eight ranks take one clause
        for peer in row.waiting_for:
            other = rows.get(peer)
            if other is None:
                continue
            if other.state == "paused" and other.call is not None:
                reason = "still paused before it" if matches(row.call, other.call, row.rank, peer) \
                    else f"paused before {other.call.what()}"
            else:
                reason = f"which {_ended(other) if not other.active else 'waits too'}"
            why.setdefault(reason, []).append(peer)
        return f"waits in {row.call.what()} for " + "; ".join(f"{_ranks(peers)}, {reason}"
                                                               for reason, peers in why.items())
    if row.state == "finished":
        ran = "" if row.collectives is None else f" after {_collectives(row.collectives)}"
        return f"finished the cell{ran}"
    return f"raised {row.error}"


def _collectives(count: int) -> str:
    return f"{count:,} collective{'' if count == 1 else 's'}"


def ran_to_the_end(rows: dict[int, RankStep], before: dict[int, int]) -> str:
    """What ``%ranks continue`` ran unseen: each rank's collectives after the one it was paused before
    (``before``: rank -> that collective's number), in one line. Example: "every rank finished the cell: 9,995
    more collectives each, 10,000 in all"."""
    more = {rank: row.collectives - before.get(rank, 0) + 1 for rank, row in rows.items()
            if row.state == "finished" and row.collectives is not None and rank in before}
    if not more:
        return ""
    if len(set(more.values())) == 1 and len({rows[rank].collectives for rank in more}) == 1:
        count = next(iter(more.values()))
        return (f"{'every rank' if len(more) == len(rows) else _ranks(sorted(more))} finished the cell: "
                f"{count:,} more collective{'' if count == 1 else 's'} each after the pause, "
                f"{_collectives(rows[next(iter(more))].collectives)} in all")
    return "; ".join(f"rank {rank} finished after {count:,} more ({_collectives(rows[rank].collectives)} in all)"
                     for rank, count in sorted(more.items()))


class StepView:
    """Every rank's state in a stepped cell, one row each: its state, its call, the line of the cell it stands
    on and what issued the call, then what the ranks disagree on. ``values``: each rank's value of the cell's
    last expression once every rank finished (else None)."""

    def __init__(self, rows: dict[int, RankStep], note: str = "", checked: bool = False,
                 posted: Posts | None = None) -> None:
        self.rows = dict(sorted(rows.items()))
        self.problems = disagreements(self.rows, checked, posted)
        self.note = note
        self.checked = checked  # the ranks run under the collective check: a group's calls that differ raise

    @property
    def finished(self) -> bool:
        return all(not row.active for row in self.rows.values())

    @property
    def values(self) -> list[Any] | None:
        return [row.value for row in self.rows.values()] if self.finished else None

    def states(self) -> dict[int, str]:
        """Each rank's state in words, as the table shows it. Example: ``{0: "paused before all_reduce #1 (SUM,
        float32[4])", 1: "waits in all_reduce #1 (SUM, float32[4]) for rank 0, still paused before it"}``."""
        return {rank: _state(row, self.rows) for rank, row in self.rows.items()}

    def _cells(self) -> list[tuple[str, str, str, str]]:
        rows = []
        for rank, state in self.states().items():
            call = self.rows[rank].call if self.rows[rank].active else None
            where = f"{call.line}  {call.source}" if call is not None and call.line else ""
            group = "" if call is None else f"{list(call.members)}" if call.group == WORLD_NAME else \
                f"group {call.group} {list(call.members)}"
            rows.append((f"rank {rank}", state, group, where + (f"  ← {call.issuer}" if call and call.issuer else "")))
        return rows

    def _verdict(self) -> str:
        raised = [rank for rank, row in self.rows.items() if row.state == "raised"]
        if self.finished:
            return "every rank finished the cell" if not raised else f"the cell ended: {_ranks(raised)} raised"
        if self.problems:
            if any(row.state == "waiting" for row in self.rows.values()):
                return "the ranks cannot all go on: " + " | ".join(self.problems) + ". End it with %ranks abort"
            if self.checked and all(": different operations" in problem for problem in self.problems):
                then = "the collective check would raise on every rank of the group, before anything is sent"
            elif self.checked and all(": different operations" in problem or ": different tensors" in problem
                                      for problem in self.problems):
                then = ("the collective check raises where it compares the tensors that differ (most collectives' "
                        "inputs), gloo where it checks their sizes; elsewhere they wait until the timeout restarts "
                        "the ranks")
            else:
                then = "wait until the timeout restarts the ranks"
            return (f"before anything is sent: {' | '.join(self.problems)}. End it with %ranks abort: a step would "
                    f"run these calls, and {then}")
        if all(row.state == "paused" for row in self.rows.values()):
            return "the ranks agree: %ranks step runs these calls"
        if not any(row.state == "waiting" for row in self.rows.values()):
            return "the ranks agree: %ranks step runs the paused ranks' calls"
        return ("the ranks agree: %ranks step moves the paused ranks on, and the waiting ones complete their call "
                "with them")

    def __repr__(self) -> str:
        cells = [("rank", "state", "group", "line of the cell  ← what issued it"), *self._cells()]
        widths = [max(len(row[i]) for row in cells) for i in range(3)]
        lines = ["  ".join(row[i].ljust(widths[i]) for i in range(3)) + "  " + row[3] for row in cells]
        return "\n".join([line.rstrip() for line in lines] + [self._verdict()] + ([self.note] if self.note else []))

    def _repr_html_(self) -> str:
        head = "".join(f"<th style='text-align:left'>{name}</th>" for name in ("rank", "state", "group", "line"))
        body = "".join("<tr>" + "".join(f"<td style='text-align:left'><code>{html.escape(cell)}</code></td>"
                                        for cell in row) + "</tr>" for row in self._cells())
        colour = "#b00020" if self.problems else "inherit"
        note = f"<div>{html.escape(self.note)}</div>" if self.note else ""
        return (f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
                f"<div style='color:{colour}'>{html.escape(self._verdict())}</div>{note}")


class Trace:
    """Every collective each rank called in one cell, in order (:meth:`dtlib.LiveRanks.trace`, ``%%ranks
    --trace``): ``calls[rank]`` is a list of :class:`Call`, ``values`` each rank's value of the cell's last
    expression. Shown one line per collective, with the ranks that called the same thing on one line."""

    def __init__(self, calls: dict[int, list[Call]], values: list[Any] | None, cell: str = "") -> None:
        self.calls = calls
        self.values = values
        self.cell = cell  # the traced cell's name, <rank cell N>

    def lines(self) -> list[str]:
        """One line per collective number, the ranks that called the same thing on one line, named only where
        the ranks differ: ``#3 reduce_scatter_single (AVG, float32[36], float32[72]), line 1, from
        torch/.../_fsdp_collectives.py in foreach_reduce``."""
        lines = []
        for index in range(max((len(calls) for calls in self.calls.values()), default=0)):
            said: dict[str, list[int]] = {}
            for rank, calls in sorted(self.calls.items()):
                if index < len(calls):
                    call = calls[index]
                    where = ""
                    if call.line:  # a line of the traced cell by its number; of another cell, by both
                        cell, number = call.line.rsplit(":", 1)
                        where = f", line {number}" if cell == self.cell else f", {cell} line {number}"
                    issuer = f", from {call.issuer}" if call.issuer else ""
                    details = f" ({call.details()})" if call.details() else ""
                    said.setdefault(f"{call.op}{details}{where}{issuer}", []).append(rank)
            parts = [text + ("" if len(said) == 1 and len(ranks) == len(self.calls) else f" on {_ranks(ranks)}")
                     for text, ranks in said.items()]
            lines.append(f"#{index + 1} " + " | ".join(parts))
        return lines

    def __repr__(self) -> str:
        return "\n".join(self.lines() or ["no collective was called"])
