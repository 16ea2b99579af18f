"""The checker of notebook 03's exercise: one phase of the ring all-reduce, written with ``ring_shift``.

The learner's phase runs inside ``dtlib.ring.send_recv.ring_all_reduce`` on live gloo ranks, beside
dtlib's own other phase; the buffer must come out equal to ``dist.all_reduce``'s, and how the
phase changed the chunks says what went wrong.

Example: ``dtlib.checks.ring_phase(dtlib.ring.send_recv.ring_all_gather_phase)`` is ✓.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dtlib.checks.skeleton import ON_GLOO
from dtlib.errors import WorkerError, WorkerTimeout
from dtlib.feedback import Feedback
from dtlib.launch.entry import rank_device
from dtlib.launch.spawn import spawn
from dtlib.measure.counting import count_collectives
from dtlib.ring import chunk_bounds
from dtlib.ring import send_recv as collectives


def _ring_with_your_phase(rank: int, world_size: int, phase: Callable[..., None], which: str,
                          length: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    data = torch.arange(length, dtype=torch.float64, device=rank_device()) * 10.0**rank  # rank r: 10^r x [0, 1, ...]
    expected = data.clone()
    dist.all_reduce(expected)
    ours = data.clone()
    seen: dict[str, Any] = {}

    def watched(chunks: list[Any], rank: int, world_size: int) -> None:
        views = list(chunks)  # views of the buffer: the list may hold other tensors afterwards
        seen["before"] = [view.tolist() for view in views]
        _, seen["calls"] = count_collectives(phase, chunks, rank, world_size)
        seen["after"] = [view.tolist() for view in views]
        seen["replaced"] = [i for i, (view, now) in enumerate(zip(views, chunks, strict=False)) if view is not now]

    collectives.ring_all_reduce(ours, **{which: watched})
    return {"ours": ours.tolist(), "expected": expected.tolist(), "input": data.tolist(), **seen}


def _ring_diagnosis(reports: list[dict[str, Any]], which: str, where: str) -> str | None:
    """What the learner's phase did wrong, read from how it changed the chunks (None: no telling)."""
    name, write = which.replace("_", "-"), ("chunks[receive].copy_(incoming)" if which == "all_gather"
                                            else "chunks[receive] += incoming")
    for rank, report in enumerate(reports):
        shifts = report["calls"].get("send", 0)
        if not shifts and not report["calls"].get("recv", 0):
            return (f"{where}: some ranks' contributions never reached it, because your {name} phase never "
                    f"called ring_shift on rank {rank}. Each of the {len(reports) - 1} steps sends one chunk to "
                    "the right and receives one from the left.")
        if report["replaced"] and report["before"] == report["after"]:
            return (f"{where}: on rank {rank} your {name} phase put new tensors into the list (chunks[i] = ...), "
                    "so what arrived never landed in the buffer: the chunks are views of it, and assignment "
                    f"replaces the view. Write in place: {write}.")
        if report["before"] == report["after"]:
            did = ("never landed in chunks: copy it in with copy_" if which == "all_gather"
                   else "was never added to chunks: add it in place")
            return (f"{where}: on rank {rank} your {name} phase called ring_shift {shifts} times but left every "
                    f"chunk as it was, so what arrived {did} after each ring_shift ({write}).")
    return None


def ring_phase(phase: Callable[..., None], which: str = "all_gather", world_size: int = 4,
               length: int = 10, timeout: float = 30.0) -> Feedback:
    """Notebook 03: your ``phase(chunks, rank, world_size)`` inside ``ring_all_reduce``.

    ``which`` is "all_gather" or "reduce_scatter": the phase you wrote; dtlib's own
    implementation does the other one. The buffer (``length`` elements, uneven chunks
    on 4 ranks) must come out equal to ``dist.all_reduce``'s, with ``world_size`` ranks
    and with one more (which refuses a phase written for one world size), and each rank
    must pass its chunks with ``ring_shift``, N-1 times.

    Example: ``ring_phase(dtlib.ring.send_recv.ring_all_gather_phase)`` is ✓.
    """
    if which not in ("all_gather", "reduce_scatter"):
        return Feedback(False, f"which must be 'all_gather' or 'reduce_scatter', not {which!r}.")
    if not callable(phase):
        return Feedback(False, f"Pass your function itself, not {type(phase).__name__}.")
    sizes = (world_size, world_size + 1)
    for size in sizes:
        wrong = _wrong_with(phase, which, size, length, timeout)
        if wrong and size != world_size:
            return Feedback(False, f"Your phase works with {world_size} ranks but not with {size}: use world_size "
                                   f"everywhere, never the number {world_size}. With {size} ranks: {wrong}")
        if wrong:
            return Feedback(False, wrong)
    return Feedback(True, f"Equal to dist.all_reduce with {sizes[0]} ranks (uneven chunks) and with {sizes[1]}, "
                          f"one ring_shift per step: your {which.replace('_', '-')} phase works.")


def _wrong_with(phase: Callable[..., None], which: str, world_size: int, length: int, timeout: float) -> str | None:
    """What is wrong with ``phase`` on ``world_size`` ranks (None: nothing)."""
    try:
        reports = spawn(_ring_with_your_phase, world_size, args=(phase, which, length), timeout=timeout,
                        output="none", **ON_GLOO)
    except WorkerTimeout:
        return ("The ring hung: on every step each rank must call ring_shift exactly once, sending one chunk and "
                f"receiving one, and all ranks must take the same number of steps ({world_size - 1}).")
    except WorkerError as err:
        headlines = [failure.headline() for failure in err.failures]
        aborted = [h for h in headlines if "SIGABRT" in h]
        cut_off = [f"rank {f.rank} lost its connection to a peer" for f in err.failures
                   if "Connection reset" in f.message or "Connection closed" in f.message]
        if aborted or cut_off:
            said = (aborted + cut_off)[0].rstrip()
            said += "" if said.endswith((".", "?", "!")) else "."
            return (f"{said} gloo aborts a rank when a send and the receive it meets differ in "
                    "size, and its peers then lose the connection: with uneven chunks, the chunk you send must be "
                    "the one your right-hand neighbour expects to receive.")
        return f"Your phase raised on a rank:\n{headlines[0]}"

    for rank, report in enumerate(reports):
        for chunk, (start, stop) in enumerate(chunk_bounds(length, world_size)):
            got, want = report["ours"][start:stop], report["expected"][start:stop]
            if got == want:
                continue
            where = f"On rank {rank}, chunk {chunk} holds {got} but should hold {want}"
            diagnosis = _ring_diagnosis(reports, which, where)
            if diagnosis:
                return diagnosis
            # Every input is >= 0 (rank r holds 10^r x [0, 1, ...]), so too much or too little is telling.
            if all(g >= w for g, w in zip(got, want, strict=True)):
                return (f"{where}: more than the sum, so some contribution was added twice. "
                        "Reduce-scatter adds the incoming chunk; all-gather copies it (copy_).")
            if all(g <= w for g, w in zip(got, want, strict=True)):
                return (f"{where}: less than the sum, so some ranks' contributions never reached it. Check which "
                        "chunk you send and which you receive at each step (dtlib.ring.simulate_all_reduce shows "
                        "them).")
            return (f"{where}. Step through dtlib.ring.simulate_all_reduce on a small input to see which chunk "
                    "should move at each step.")
    return _not_a_ring(reports, which, world_size)


def _not_a_ring(reports: list[dict[str, Any]], which: str, world_size: int) -> str | None:
    """A right buffer reached some other way than N-1 ring_shift calls on every rank (None: it was the ring)."""
    name = which.replace("_", "-")
    for rank, report in enumerate(reports):
        calls = report["calls"]
        others = sorted(call for call in calls if call not in ("send", "recv", "barrier"))  # a barrier moves no data
        if others:
            return (f"The buffer is right, but on rank {rank} your {name} phase called {', '.join(others)}: the "
                    f"exercise is the ring itself, in which each rank passes one chunk per step with ring_shift, "
                    f"{world_size - 1} steps for {world_size} ranks.")
        if calls.get("send", 0) != world_size - 1 or calls.get("recv", 0) != world_size - 1:
            return (f"The buffer is right, but rank {rank} sent {calls.get('send', 0)} chunks and received "
                    f"{calls.get('recv', 0)}: the ring takes {world_size - 1} steps for {world_size} ranks, one "
                    "ring_shift each; every extra one moves bytes that no rank needs.")
    return None
