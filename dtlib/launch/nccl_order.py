"""Would these ranks' transfers finish on NCCL? Replay the order each rank posted them in, as NCCL runs it.

gloo buffers a send: ``dist.send`` returns once the bytes are on their way, whether or not the peer has
reached its ``recv``. NCCL does not. A rank's transfers run one after another on its group's stream, in the
order they were posted (under eager initialisation, with ``device_id``: one communicator for the group), and a
send can only finish while the peer's matching receive runs (small messages may slip through NCCL's buffers;
large ones cannot, so code may not rely on it). A ring where every rank first sends to the next and then
receives from the previous one therefore runs on gloo and hangs on NCCL: each rank's send waits for a
receive that sits behind its peer's own send. ``batch_isend_irecv`` posts its transfers together, so they run
at once.

Strict mode (:mod:`dtlib.launch.strict`) notes what a rank posts while :func:`recording` is on: each
point-to-point call, each ``batch_isend_irecv``, each collective, with its group. :func:`deadlock` replays every
rank's notes under NCCL's rules and says who waits for whom, or None when everything finishes. The checkers
refuse an answer whose replay hangs.

The same pairing settles tags. gloo pairs a send with the receive of the same tag; NCCL ignores tags and pairs
the k-th send from a to b with b's k-th receive from a. Where those two differ in tag, the program meant gloo's
pairing, and on GPUs each receive gets another message: :func:`tags_disagree` names the first such pair.
NCCL also needs the two ends of a pair to move the same bytes (it counts its own types, and torch hands it bool
as uint8 and a complex tensor as its real view); gloo fills the start of a larger receive and says nothing:
:func:`sizes_disagree` names the first pair that differs.

Example::

    ring = [[("send", 1), ("recv", 2)], [("send", 2), ("recv", 0)], [("send", 0), ("recv", 1)]]
    deadlock([[launch(kind, peer) for kind, peer in rank] for rank in ring])
    # 'On NCCL these transfers hang: rank 0 waits in dist.send to rank 1, ...'
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

#: The group a call went to: its members' global ranks, in order.
Group = tuple[int, ...]


@dataclass(frozen=True)
class Op:
    """One transfer or collective as posted: ``kind`` is "send", "recv" or a collective's name; ``peer`` the other
    rank of a transfer (global), None for a collective; ``call`` the call the learner wrote, as :mod:`dtlib.calls`
    spells it ("isend", "all_reduce", "batch_isend_irecv's isend"): messages add the ``dist.`` themselves."""

    kind: str
    peer: int | None
    group: Group
    call: str
    reduce_op: str = ""  # a reduction's op as ReduceOp names it ("SUM", "AVG"), where the call has one
    tag: int = 0  # a transfer's tag as the learner wrote it (strict mode passes 0 on, as NCCL ignores it)
    size: tuple[int, str, int] | None = None  # a transfer's tensor: its elements, dtype ("float32") and bytes
    comm: str = ""  # the group's name (torch's group_name), which tells apart two groups of the same members


#: One launch on a stream: the ops posted together (one call, or one batch_isend_irecv).
Launch = tuple[Op, ...]

_notes: list[Launch] | None = None  # this process's notes while recording() is on


@contextlib.contextmanager
def recording() -> Iterator[list[Launch]]:
    """Inside a rank: note what strict mode sees posted in this block; yields the list the notes go into."""
    global _notes
    kept, _notes = _notes, []
    try:
        yield _notes
    finally:
        _notes = kept


def note(*ops: Op) -> None:
    """Strict mode's hook: ``ops`` were posted together (a no-op unless :func:`recording` is on)."""
    if _notes is not None and ops:
        _notes.append(tuple(ops))


def launch(kind: str, peer: int | None = None, group: Group = (), call: str = "") -> Launch:
    """One op posted alone (``group=()`` stands for the default group)."""
    return (Op(kind, peer, group, call or kind),)


def _stream(op: Op, world_size: int) -> tuple[Group, str]:
    """The communicator ``op`` runs on: its group's members and name. Two groups of the same members are two
    communicators, each with its own stream, as on NCCL."""
    return op.group or tuple(range(world_size)), op.comm


def _key(rank: int, op: Op, world_size: int) -> tuple[tuple[Group, str], int, int]:
    """A transfer's channel: its communicator, sender and receiver (global ranks); its k-th op there meets the
    peer's k-th."""
    sender, receiver = (rank, op.peer) if op.kind == "send" else (op.peer, rank)
    return _stream(op, world_size), sender, receiver


def _nth(k: int) -> str:
    return f"{k}{'th' if 10 <= k % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(k % 10, 'th')}"


def _channels(ranks: Sequence[Sequence[Launch]]) -> dict[tuple[tuple[Group, str], int, int],
                                                         tuple[list[Op], list[Op]]]:
    """Every channel's sends and receives, each in the order posted: NCCL pairs the k-th of one with the k-th of
    the other."""
    channels: dict[tuple[tuple[Group, str], int, int], tuple[list[Op], list[Op]]] = {}
    for rank, launches in enumerate(ranks):
        for op in (op for ops in launches for op in ops if op.peer is not None):
            sends, receives = channels.setdefault(_key(rank, op, len(ranks)), ([], []))
            (sends if op.kind == "send" else receives).append(op)
    return dict(sorted(channels.items()))


def _by_tag(tags: list[int], k: int, others: list[int]) -> int | None:
    """Where gloo pairs the k-th (from 1) of one side of a channel, whose tags are ``tags``: the place (from 1) on
    the other side, tagged ``others``, of its n-th op of the same tag, n counting this one's; None where none is."""
    tag = tags[k - 1]
    places = [place for place, other in enumerate(others, start=1) if other == tag]
    nth = tags[: k - 1].count(tag)
    return places[nth] if nth < len(places) else None


def sizes_disagree(ranks: Sequence[Sequence[Launch]]) -> str | None:
    """The first send whose tensor holds other bytes than that of the receive NCCL pairs it with, in the
    learner's terms; None where every pair agrees (or a size was not noted). NCCL needs the two ends to agree
    (torch hands it bool as uint8 and a complex tensor as its real view, so bytes are what it compares); gloo
    fills the start of a larger receive and leaves the rest as it was."""
    for (_, sender, receiver), (sends, receives) in _channels(ranks).items():
        for k, (send, recv) in enumerate(zip(sends, receives, strict=False), start=1):  # unmatched: deadlock()'s
            if send.size is None or recv.size is None or send.size[2] == recv.size[2]:
                continue
            (sent, sent_dtype, sent_bytes), (room, room_dtype, room_bytes) = send.size, recv.size
            return (f"Rank {sender}'s {_nth(k)} dist.{send.call} to rank {receiver} sends {sent} {sent_dtype} "
                    f"({sent_bytes} bytes), and the receive NCCL pairs it with, rank {receiver}'s {_nth(k)} "
                    f"dist.{recv.call} from rank {sender}, takes {room} {room_dtype} ({room_bytes} bytes). NCCL "
                    "needs both ends to agree in count and type: on GPUs such a pair may hang or leave numbers "
                    "unwritten. gloo filled the start of the receive and said nothing. Receive into a tensor of the "
                    "sent one's shape and dtype.")
    return None


def tags_disagree(ranks: Sequence[Sequence[Launch]]) -> str | None:
    """The first pair NCCL makes (the k-th send from a to b in a group, and b's k-th receive from a there) whose
    tags differ and whose send or receive gloo, pairing by tag, would give another partner, in the learner's
    terms; None where the two pairings agree: tags unused, used in the order posted, or matching nothing at all
    (gloo would wait, and NCCL's order is the only pairing there is). Such a program's meaning rests on what NCCL
    ignores."""
    for (_, sender, receiver), (sends, receives) in _channels(ranks).items():
        sent, received = [op.tag for op in sends], [op.tag for op in receives]
        for k, (send, recv) in enumerate(zip(sends, receives, strict=False), start=1):
            if send.tag == recv.tag or {_by_tag(sent, k, received), _by_tag(received, k, sent)} <= {k, None}:
                continue
            return (f"Rank {sender}'s {_nth(k)} dist.{send.call} to rank {receiver} has tag={send.tag}, and "
                    f"rank {receiver}'s {_nth(k)} dist.{recv.call} from rank {sender} has tag={recv.tag}. "
                    "NCCL ignores tags: it pairs the k-th send with the k-th receive between two ranks, so on "
                    "GPUs that receive gets this message, where gloo alone pairs by tag (strict mode paired them "
                    "as NCCL does). Post the sends and the receives in the same order on both ranks, and leave "
                    "tags out.")
    return None


def _said(rank: int, op: Op) -> str:
    if op.peer is None:
        return f"rank {rank} waits in dist.{op.call}"
    towards = "to" if op.kind == "send" else "from"
    return f"rank {rank} waits in dist.{op.call} {towards} rank {op.peer}"


def deadlock(ranks: Sequence[Sequence[Launch]]) -> str | None:
    """Replay each rank's launches in the order posted, one stream per (rank, communicator); a transfer runs when
    its match (the k-th send from a to b meets b's k-th receive from a, in the same group) is at the head of the
    peer's stream too, a collective when every member has its k-th collective of that group at its head.
    Returns what is left waiting, in the learner's terms, or None when every launch finishes."""
    streams: dict[tuple[int, tuple[Group, str]], list[list[tuple[Op, tuple]]]] = {}
    counts: dict[tuple, int] = {}
    posted: set[tuple[int, tuple]] = set()
    for rank, launches in enumerate(ranks):
        for ops in launches:
            keyed = []
            for op in ops:
                if op.peer is None:
                    key: tuple = ("collective", _stream(op, len(ranks)))
                else:
                    key = ("p2p", *_key(rank, op, len(ranks)), op.kind)
                index = counts.get((rank, key), 0)
                counts[(rank, key)] = index + 1
                keyed.append((op, (*key, index)))
                posted.add((rank, (*key, index)))
            streams.setdefault((rank, _stream(ops[0], len(ranks))), []).append(keyed)

    def heads() -> set[tuple[int, tuple]]:
        return {(rank, key) for (rank, _), queue in streams.items() if queue for _, key in queue[0]}

    while True:
        at_head = heads()
        runs = set()
        for rank, key in at_head:
            if key[0] == "collective":
                if all((member, key) in at_head for member in key[1][0]):
                    runs.add((rank, key))
            elif _match(rank, key) in at_head:
                runs.add((rank, key))
        if not runs:
            break
        for (rank, _), queue in streams.items():
            if queue:
                queue[0] = [(op, key) for op, key in queue[0] if (rank, key) not in runs]
                if not queue[0]:
                    queue.pop(0)
    waiting = [(rank, queue[0][0]) for (rank, _), queue in sorted(streams.items()) if queue]
    if not waiting:
        return None
    unmatched = [(rank, op) for rank, (op, key) in waiting if key[0] == "p2p" and
                 _match(rank, key) not in posted]
    if unmatched:
        rank, op = unmatched[0]
        side = "receive" if op.kind == "send" else "send"
        towards = "to" if op.kind == "send" else "from"
        return (f"Rank {rank}'s dist.{op.call} {towards} rank {op.peer} is never matched: rank {op.peer} posts no "
                f"{side} for it. gloo lets the job end with it pending; on NCCL it waits forever.")
    shown = ", ".join(_said(rank, op) for rank, (op, _) in waiting[:6]) + (", ..." if len(waiting) > 6 else "")
    return (f"On NCCL these transfers hang: {shown}. NCCL runs a rank's transfers one after another, in the order "
            "posted, and a send ends only while its receive runs. Post each rank's sends and receives together, in "
            "one dist.batch_isend_irecv, or order them so that each pair meets: even ranks send first, odd ranks "
            "receive first.")


def _match(rank: int, key: tuple) -> tuple[int, tuple]:
    """The (rank, key) of the transfer that matches ``rank``'s transfer ``key``."""
    _, group, sender, receiver, kind, index = key
    return (receiver if kind == "send" else sender,
            ("p2p", group, sender, receiver, "recv" if kind == "send" else "send", index))
