"""The checker of notebook 03's exercise: one phase of the ring all-reduce, written with ``ring_shift``.

The learner's phase runs inside ``dtlib.ring.send_recv.ring_all_reduce`` on live gloo ranks (in strict
mode), beside dtlib's own other phase; the buffer must come out equal to ``dist.all_reduce``'s, and how the
phase changed the chunks says what went wrong. Before each ring step the ranks tell each other the sizes
they send and receive, so a send that meets a receive of another size is named by step, rank and chunk,
the same on gloo and NCCL, instead of by gloo's abort.

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


class _StepRefused(Exception):
    """Raised on every rank at once when a ring step's send and the receive it meets differ in size, or a rank
    sends a tensor that holds none of its chunks."""


def _chunk_of(tensor: Any, views: list[Any]) -> int | None:
    """Which chunk ``tensor`` is (one of the buffer's views), None for any other tensor (a clone, a new one)."""
    for i, view in enumerate(views):
        if tensor.data_ptr() == view.data_ptr() and tensor.numel() == view.numel():
            return i
    return None


def _checked_shift(views: list[Any], chunks: list[Any], extra: dict[str, int]) -> Callable[..., None]:
    """``ring_shift``, after every rank has told every other the sizes it sends and receives at this step.

    A send and the receive it meets must match in size; NCCL would not say so (it hangs or reads past the
    end) and gloo aborts the process. So every rank learns of a mismatch at once and raises
    :class:`_StepRefused` with the same words. The exchange's own collectives go into ``extra``, which the
    caller takes off the learner's count.
    """
    import torch
    import torch.distributed as dist

    real, step = collectives.ring_shift, [0]

    def shift(send: Any, receive_into: Any, rank: int, world_size: int) -> None:
        sent = _chunk_of(send, views)
        holds = any(send.numel() == chunk.numel() and torch.equal(send.reshape(-1).to(chunk.dtype), chunk.reshape(-1))
                    for chunk in [*views, *chunks])  # a chunk's numbers, itself or a copy, in the buffer or the list
        mine = torch.tensor([send.numel(), receive_into.numel(), -1 if sent is None else sent, int(holds)],
                            dtype=torch.int64, device=send.device)
        every = torch.empty(4 * world_size, dtype=torch.int64, device=send.device)
        _, calls = count_collectives(dist.all_gather_into_tensor, every, mine)
        for call, times in calls.items():
            extra[call] = extra.get(call, 0) + times
        table, step[0] = every.view(world_size, 4).tolist(), step[0] + 1
        for left, (n_sent, _, _, holds_a_chunk) in enumerate(table):
            if not holds_a_chunk:
                raise _StepRefused(
                    f"In ring step {step[0]} of {world_size - 1}, rank {left} sent a tensor of {n_sent} elements that "
                    "holds none of its chunks: the ring's data must travel in its chunks, one per step (the buffer's "
                    "right numbers must come from what arrived, not from a formula that knows the inputs).")
        for right in range(world_size):
            left = (right - 1) % world_size
            (n_sent, _, chunk, _), (_, n_expected, _, _) = table[left], table[right]
            if n_sent != n_expected:
                what = f"chunk {chunk}" if chunk >= 0 else "a tensor"
                raise _StepRefused(
                    f"In ring step {step[0]} of {world_size - 1}, rank {left} sent {what} ({n_sent} elements) to "
                    f"rank {right}, which received into a buffer of {n_expected}: with uneven chunks, the chunk a "
                    "rank sends at a step must be the very chunk its right-hand neighbour receives at that step "
                    "(rank r receives what rank r - 1 sends). On GPUs NCCL would not say so: it would hang or "
                    "read the wrong bytes.")
        real(send, receive_into, rank, world_size)

    return shift


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
        extra: dict[str, int] = {}
        real, collectives.ring_shift = collectives.ring_shift, _checked_shift(views, chunks, extra)
        try:
            _, calls = count_collectives(phase, chunks, rank, world_size)
        except _StepRefused as err:
            seen["sizes_differ"], calls = str(err), {}
        finally:
            collectives.ring_shift = real
        seen["calls"] = {call: times - extra.get(call, 0) for call, times in calls.items()
                         if times - extra.get(call, 0)}
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
        return f"Your phase raised on a rank:\n{headlines[0]}"

    differ = [report["sizes_differ"] for report in reports if "sizes_differ" in report]
    if differ:
        return differ[0]
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
