"""The checker of notebook 03's exercise: one phase of the ring all-reduce, written with ``ring_shift``.

The learner's phase runs inside ``dtlib.ring.send_recv.ring_all_reduce`` on live gloo ranks (in strict
mode), beside dtlib's own other phase; the buffer must come out equal to ``dist.all_reduce``'s, and how the
phase changed the chunks says what went wrong. Before each ring step the ranks tell each other the sizes
they send and receive, so a send that meets a receive of another size is named by step, rank and chunk,
the same on gloo and NCCL, instead of by gloo's abort.

Example: ``dtlib.checks.ring_phase(dtlib.ring.send_recv.ring_all_gather_phase)`` is ✓.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dtlib.checks.feedback import Feedback
from dtlib.checks.skeleton import Answer, RankExercise, judge
from dtlib.measure.counting import count_collectives
from dtlib.ring import chunk_bounds, send_recv


class _StepRefused(Exception):
    """Raised on every rank at once when a ring step's send and the receive it meets differ in size, or a rank
    sends a tensor that holds none of its chunks."""


def _chunk_of(tensor: Any, views: list[Any]) -> int | None:
    """Which chunk ``tensor`` is (one of the buffer's views), None for any other tensor (a clone, a new one)."""
    for i, view in enumerate(views):
        if tensor.data_ptr() == view.data_ptr() and tensor.numel() == view.numel():
            return i
    return None


_FIELDS = 6  # what each rank tells the others before a ring step: sizes, chunk, holds a chunk, dtypes
#: The dtypes a ring step may name, by code (-1: any other).
_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16)
_DTYPES_SAID = {**{code: str(dtype).removeprefix("torch.") for code, dtype in enumerate(_DTYPES)},
                -1: "another dtype"}


def _dtype_code(tensor: Any) -> int:
    return _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else -1


def _holds_a_chunk(send: Any, views: list[Any], chunks: list[Any], received: list[Any]) -> bool:
    """Whether what a rank sends is ring data: a chunk of the buffer or of the list, something it received, or a
    chunk plus something it received (a partial sum kept aside, to be written to the buffer at the end)."""
    flat = send.reshape(-1)
    same_size = [t.reshape(-1) for t in [*views, *chunks, *received] if t.numel() == send.numel()]
    if any(torch.equal(flat.to(t.dtype), t) for t in same_size):
        return True
    arrived = [t.reshape(-1) for t in received if t.numel() == send.numel()]
    return any(torch.allclose(flat.to(view.dtype), view.reshape(-1) + got, rtol=0, atol=0)
               for view in views if view.numel() == send.numel() for got in arrived)


def _checked_step(views: list[Any], chunks: list[Any], extra: dict[str, int],
                  shifts: list[int]) -> Callable[..., None]:
    """A look at each ``ring_shift`` of the phase (``send_recv.step_observer``), before the step runs: every rank
    tells every other the sizes it sends and receives at this step.

    A send and the receive it meets must match in size; NCCL would not say so (it hangs or reads past the
    end) and gloo aborts the process. So every rank learns of a mismatch at once and raises
    :class:`_StepRefused` with the same words; so does a step that sends or receives in another dtype than
    the buffer's. The exchange's own collectives go into ``extra``, which the caller takes off the learner's
    count; ``shifts[0]`` counts the calls of ring_shift.
    """
    step, received = shifts, []  # received: every tensor this rank received into, as it is now

    def shift(send: Any, receive_into: Any, rank: int, world_size: int) -> None:
        sent = _chunk_of(send, views)
        holds = _holds_a_chunk(send, views, chunks, received)
        received.append(receive_into)
        mine = torch.tensor([send.numel(), receive_into.numel(), -1 if sent is None else sent, int(holds),
                             _dtype_code(send), _dtype_code(receive_into)], dtype=torch.int64, device=send.device)
        every = torch.empty(_FIELDS * world_size, dtype=torch.int64, device=send.device)
        _, calls = count_collectives(dist.all_gather_into_tensor, every, mine)
        for call, times in calls.items():
            extra[call] = extra.get(call, 0) + times
        table, step[0] = every.view(world_size, _FIELDS).tolist(), step[0] + 1
        wanted = _dtype_code(views[0])
        for left, (*_, sends, receives) in enumerate(table):
            if not sends == receives == wanted:
                raise _StepRefused(
                    f"In ring step {step[0]} of {world_size - 1}, rank {left} sent {_DTYPES_SAID[sends]} and received "
                    f"into {_DTYPES_SAID[receives]}, while the buffer holds {_DTYPES_SAID[wanted]}: a copy in another "
                    "dtype rounds every partial sum it carries (float16 keeps 3 digits, an integer none after the "
                    "point), and the buffers' numbers have more. Send and receive in the buffer's own dtype.")
        for left, (n_sent, _, _, holds_a_chunk, *_) in enumerate(table):
            if not holds_a_chunk:
                raise _StepRefused(
                    f"In ring step {step[0]} of {world_size - 1}, rank {left} sent a tensor of {n_sent} elements that "
                    "holds none of its chunks: the ring's data must travel in its chunks, one per step (the buffer's "
                    "right numbers must come from what arrived, not from a formula that knows the inputs).")
        for right in range(world_size):
            left = (right - 1) % world_size
            (n_sent, _, chunk, *_), (_, n_expected, *_) = table[left], table[right]
            if n_sent != n_expected:
                what = f"chunk {chunk}" if chunk >= 0 else "a tensor"
                raise _StepRefused(
                    f"In ring step {step[0]} of {world_size - 1}, rank {left} sent {what} ({n_sent} elements) to "
                    f"rank {right}, which received into a buffer of {n_expected}: with uneven chunks, the chunk a "
                    "rank sends at a step must be the very chunk its right-hand neighbour receives at that step "
                    "(rank r receives what rank r - 1 sends). On GPUs NCCL would not say so: it would hang or "
                    "read the wrong bytes.")

    return shift


def _ring_with_your_phase(phase: Callable[..., None], which: str, rank: int, world_size: int,
                          data: Any) -> dict[str, Any]:
    """In a rank: ``ring_all_reduce`` of this rank's ``data`` (the checker's), with the learner's phase for
    ``which`` and dtlib's for the other; what the phase did to the chunks, and its own collectives."""
    ours = data.clone()
    seen: dict[str, Any] = {}

    def watched(chunks: list[Any], rank: int, world_size: int) -> None:
        given = list(chunks)  # the views handed over: the list may hold other tensors afterwards
        views = [view.view(view.shape) for view in given]  # the buffer's own, whatever `.data =` does to those
        seen["before"] = [view.tolist() for view in views]
        extra: dict[str, int] = {}
        shifts = [0]
        send_recv.step_observer = _checked_step(views, chunks, extra, shifts)  # however ring_shift is reached
        try:
            _, calls = count_collectives(phase, chunks, rank, world_size)
        except _StepRefused as err:
            seen["sizes_differ"], calls = str(err), {}
        finally:
            send_recv.step_observer = None
        seen["calls"] = {call: times - extra.get(call, 0) for call, times in calls.items()
                         if times - extra.get(call, 0)}
        seen["shifts"] = shifts[0]  # ring_shift's own calls, not the sends the phase made
        seen["after"] = [view.tolist() for view in views]
        seen["replaced"] = [i for i, (view, handed, now) in enumerate(zip(views, given, chunks, strict=False))
                            if handed is not now or handed.data_ptr() != view.data_ptr()]  # `chunks[i] = `, `.data =`

    send_recv.ring_all_reduce(ours, **{which: watched})
    return {"ours": ours.tolist(), "calls": {}, **seen}


def _inputs(length: int) -> Callable[[int, Any], list[Any]]:
    """Every rank's buffer of ``length`` numbers, new on each call so that a phase cannot know them: positive
    float64 numbers with fractions, of magnitudes from 0.01 to 10,000, so that a lower-precision copy of a chunk
    (float16, an integer) changes the sum."""
    def draw(world_size: int, generator: Any) -> list[Any]:
        def one() -> torch.Tensor:
            scale = 10.0 ** torch.randint(-2, 4, (length,), generator=generator).double()
            return (1 + 9 * torch.rand(length, generator=generator, dtype=torch.float64)) * scale
        return [one() for _ in range(world_size)]

    return draw


def _close(got: Sequence[float], want: Sequence[float]) -> bool:
    """Equal to float64's precision: the ring adds in another order than the oracle."""
    return len(got) == len(want) and torch.allclose(torch.tensor(got, dtype=torch.float64),
                                                    torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=0.0)


def _first_wrong_chunk(a: Answer) -> tuple[str, list[float], list[float]]:
    """(where, what it holds, what it should) for the first chunk of this rank's buffer that is wrong."""
    expected = a.expected.tolist()
    for chunk, (start, stop) in enumerate(chunk_bounds(len(expected), a.size)):
        got, want = a.value["ours"][start:stop], expected[start:stop]
        if not _close(got, want):
            return f"On rank {a.rank}, chunk {chunk} holds {got} but should hold {want}", got, want
    return f"On rank {a.rank}, the buffer holds {a.value['ours']} but should hold {expected}", [], []


def _ring_diagnosis(a: Answer, which: str) -> str | None:
    """What the learner's phase did wrong, read from how it changed the chunks (None: no telling)."""
    where = _first_wrong_chunk(a)[0]
    name, write = which.replace("_", "-"), ("chunks[receive].copy_(incoming)" if which == "all_gather"
                                            else "chunks[receive] += incoming")
    for rank, report in enumerate(a.values):
        shifts, sends = report.get("shifts", 0), report["calls"].get("send", 0)
        if not shifts and not sends and not report["calls"].get("recv", 0):
            return (f"{where}: some ranks' contributions never reached it, because your {name} phase never "
                    f"called ring_shift on rank {rank}. Each of the {a.size - 1} steps sends one chunk to the right "
                    "and receives one from the left.")
        if report["replaced"] and report["before"] == report["after"]:
            return (f"{where}: on rank {rank} your {name} phase put new tensors into the list (chunks[i] = ..., or "
                    "chunks[i].data = ...), so what arrived never landed in the buffer: the chunks are views of it, "
                    f"and assignment replaces the view. Write in place: {write}.")
        if report["before"] == report["after"]:
            did = ("never landed in chunks: copy it in with copy_" if which == "all_gather"
                   else "was never added to chunks: add it in place")
            moved = (f"called ring_shift {shifts} times" if shifts else
                     f"sent {sends} times with dist.send and never called ring_shift")
            return (f"{where}: on rank {rank} your {name} phase {moved} but left every "
                    f"chunk as it was, so what arrived {did} after each step ({write}).")
    return None


def _sizes_differ(a: Answer) -> str | None:
    return next((report["sizes_differ"] for report in a.values if "sizes_differ" in report), None)


def _not_a_ring(values: Sequence[dict[str, Any]], size: int, which: str) -> str | None:
    """A right buffer reached some other way than N-1 ring_shift calls on every rank (None: it was the ring)."""
    name = which.replace("_", "-")
    for rank, report in enumerate(values):
        calls = report["calls"]
        others = sorted(call for call in calls if call not in ("send", "recv", "barrier"))  # a barrier moves no data
        if others:
            return (f"The buffer is right, but on rank {rank} your {name} phase called {', '.join(others)}: the "
                    f"exercise is the ring itself, in which each rank passes one chunk per step with ring_shift, "
                    f"{size - 1} steps for {size} ranks.")
        if calls.get("send", 0) != size - 1 or calls.get("recv", 0) != size - 1:
            return (f"The buffer is right, but rank {rank} sent {calls.get('send', 0)} chunks and received "
                    f"{calls.get('recv', 0)}: the ring takes {size - 1} steps for {size} ranks, one ring_shift each; "
                    "every extra one moves bytes that no rank needs.")
    return None


def _steps_said(values: Sequence[dict[str, Any]]) -> str:
    """How the right phase passed its chunks, as the answer wrote it: with ring_shift, or with sends and receives
    of its own (``batch_isend_irecv``, say), one each per step either way."""
    if all(report.get("shifts", 0) for report in values):
        return "one ring_shift per step"
    return "one chunk sent and one received per step, with sends and receives of your own instead of ring_shift"


def _exercise(which: str, length: int) -> RankExercise:
    """The ring exercise for one phase, ``which``, on buffers of ``length`` numbers."""
    name = which.replace("_", "-")

    def more(a: Answer) -> bool:  # every input is positive, so too much or too little is telling
        _, got, want = _first_wrong_chunk(a)
        return bool(got) and all(g >= w for g, w in zip(got, want, strict=True))

    def less(a: Answer) -> bool:
        _, got, want = _first_wrong_chunk(a)
        return bool(got) and all(g <= w for g, w in zip(got, want, strict=True))

    return RankExercise(
        expected=_summed,
        read=lambda report: report,
        same=lambda report, expected: "sizes_differ" not in report and _close(report["ours"], expected.tolist()),
        inputs=_inputs(length),
        hints=[
            (lambda a: _sizes_differ(a) is not None, lambda a: _sizes_differ(a) or ""),
            (lambda a: _ring_diagnosis(a, which) is not None, lambda a: _ring_diagnosis(a, which) or ""),
            (more, lambda a: (f"{_first_wrong_chunk(a)[0]}: more than the sum, so some contribution was added twice. "
                              "Reduce-scatter adds the incoming chunk; all-gather copies it (copy_).")),
            (less, lambda a: (f"{_first_wrong_chunk(a)[0]}: less than the sum, so some ranks' contributions never "
                              "reached it. Check which chunk you send and which you receive at each step "
                              "(dtlib.ring.simulate_all_reduce shows them).")),
        ],
        otherwise=lambda a: (f"{_first_wrong_chunk(a)[0]}. Step through dtlib.ring.simulate_all_reduce on a small "
                             "input to see which chunk should move at each step."),
        no_collective=lambda rank, expected, calls: (
            f"The buffer is right, but rank {rank}'s {name} phase moved nothing: the ring passes one chunk per step "
            "with ring_shift."),
        right=lambda first, second, values: (
            f"Equal to the sum of every rank's buffer, with {first} ranks (uneven chunks) and with {second}, on new "
            f"numbers each time, {_steps_said(values)}: your {name} phase works."),
        hang=lambda err, fn_name: (
            "The ring hung: on every step each rank must call ring_shift exactly once, sending one chunk and "
            "receiving one, and all ranks must take the same number of steps (world_size - 1)."),
        failure=lambda err: f"Your phase raised on a rank:\n{err.cause().headline()}",
        calls_in=lambda report: report["calls"],  # the phase's own: the size exchange's are taken off
        also=lambda values, size: _not_a_ring(values, size, which),
        only_first=lambda first, second, wrong: (
            f"Your phase works with {first} ranks but not with {second}: use world_size everywhere, never the number "
            f"{first}. With {second} ranks: {wrong}"),
    )


def _summed(inputs: Sequence[Any]) -> Any:
    """The oracle: every rank's buffer added in one process."""
    return torch.stack(list(inputs)).sum(0)


def ring_phase(phase: Callable[..., None], which: str = "all_gather", world_size: int = 4,
               length: int = 10, timeout: float = 30.0) -> Feedback:
    """Notebook 03: your ``phase(chunks, rank, world_size)`` inside ``ring_all_reduce``.

    ``which`` is "all_gather" or "reduce_scatter": the phase you wrote; dtlib's own
    implementation does the other one. Each rank's buffer (``length`` new numbers per call, fractional and of
    several magnitudes, uneven chunks on 4 ranks) must come out equal to the sum of every rank's, computed in
    one process, with ``world_size`` ranks and with one more (which refuses a phase written for one world size),
    and each rank must pass its chunks with ``ring_shift``, N-1 times, in the buffer's dtype.

    Example: ``ring_phase(dtlib.ring.send_recv.ring_all_gather_phase)`` is ✓.
    """
    if which not in ("all_gather", "reduce_scatter"):
        return Feedback(False, f"which must be 'all_gather' or 'reduce_scatter', not {which!r}.")
    if not callable(phase):
        return Feedback(False, f"Pass your function itself, not {type(phase).__name__}.")
    return judge(functools.partial(_ring_with_your_phase, phase, which), _exercise(which, length), world_size,
                 timeout)
