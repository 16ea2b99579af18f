"""The one checker loop for exercises whose answer is a function every rank runs, ``fn(rank, world_size)``,
or, where the checker owns the data, ``fn(rank, world_size, given)``. Every rank-function checker uses it
(01, 02, 03, 04, 05, 08, 09, 13): where the answer is a part (a ring phase, a gradient hook, an FSDP wrap),
the checker binds it into such a function, which also runs the reference beside it (torch's DDP) and reports
the answer's own collectives (``calls_in``).

An exercise is data: the right value, how to read a rank's answer, and a table of hints, each a test of a
wrong answer and what to say about it. :func:`judge` does the rest, the same way for every exercise: refuse
what is not a function; run it with ``dtlib.spawn`` on ``world_size`` ranks and on one more (an answer
written for one size fails the other, and one of the two sizes is odd); name a hang or a failure; compare
every rank's answer, the first matching hint explaining a wrong one; and refuse a right answer that no
collective produced (:mod:`dtlib.measure.counting`).

An exercise with ``inputs`` owns its data: each call draws a new seed, makes every rank's input in this
process (random, rank-dependent), hands rank ``r`` its own on ``dtlib.rank_device()``, and computes the
right value from all of them in one process (``expected``, the oracle). Each collective a rank calls is
recorded (:class:`Carried`: what it sent, what it received), so hints and ``moved`` can say what it carried.

Example: ``judge(fn, SUM_OF_RANKS, world_size=3, timeout=30)`` is a :class:`dtlib.checks.feedback.Feedback`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dtlib.checks.feedback import Feedback
from dtlib.errors import WorkerError, WorkerTimeout
from dtlib.launch.entry import rank_device
from dtlib.launch.pickling import CannotSend
from dtlib.launch.spawn import spawn
from dtlib.measure.counting import (
    CALL_NAMES,
    FUNCTIONAL_CALLS,
    count_collectives,
    rank_without_communication,
    spawn_counting,
    watching,
)

UNREADABLE = object()  # what ``read`` returns for an answer it cannot compare (a string, a wrong shape)


@dataclass(frozen=True)
class Carried:
    """One collective a rank called, as it went: what the rank sent and what it received, flattened to
    float64 on the CPU (empty where the call sends or receives nothing, as ``recv`` sends nothing)."""

    call: str  # the torch.distributed name: "all_reduce", "reduce", "all_gather", ...
    sent: torch.Tensor
    received: torch.Tensor
    functional: bool = False  # a functional collective (funcol.all_reduce, ...): it returns its result, x stays


@dataclass(frozen=True)
class Answer:
    """One rank's wrong answer, as a hint sees it."""

    rank: int
    size: int  # the world size of this run
    world_size: int  # the one asked for: the first run's
    returned: Any  # what fn returned
    value: Any  # as ``read`` made it, or UNREADABLE
    expected: Any
    values: Sequence[Any]  # every rank's, as read
    calls: Sequence[dict[str, int]]  # every rank's collectives, {name: times} (dtlib.measure.counting)
    inputs: Sequence[Any] = ()  # every rank's input, where the exercise gives them (on the CPU)
    carried: Sequence[Sequence[Carried]] = ()  # every rank's collectives in order, where inputs are given

    def called(self, name: str) -> bool:
        """Whether this rank's function called the collective ``name`` ("reduce", "all_reduce", ...)."""
        return bool(self.calls[self.rank].get(name))

    @property
    def own(self) -> Any:
        """This rank's own input (float64), where the exercise gives inputs."""
        return torch.as_tensor(self.inputs[self.rank], dtype=torch.float64)

    @property
    def stacked(self) -> torch.Tensor:
        """Every rank's input, (ranks, ...) in float64."""
        return torch.stack([torch.as_tensor(given, dtype=torch.float64) for given in self.inputs])


@dataclass(frozen=True)
class RankExercise:
    """What one exercise asks, and what it says about each kind of wrong answer."""

    # the world size -> the right value, the same on every rank; with ``inputs``: every rank's input -> it (the oracle)
    expected: Callable[..., Any]
    read: Callable[[Any], Any]  # what a rank returned -> a value to compare, or UNREADABLE
    same: Callable[[Any, Any], bool]  # (a rank's value, the expected one)
    hints: Sequence[tuple[Callable[[Answer], bool], Callable[[Answer], str]]]  # the first that holds explains
    otherwise: Callable[[Answer], str]  # when no hint holds (also for UNREADABLE, unless a hint takes it)
    # (the rank, the expected value, the rank's {collective: times}): right, but nothing communicated
    no_collective: Callable[[int, Any, dict[str, int]], str]
    # (the two world sizes, every rank's value in the first run, the one asked for): the message of a right answer
    right: Callable[[int, int, Sequence[Any]], str]
    hang: Callable[[WorkerTimeout, str], str]  # (the timeout, fn's name)
    failure: Callable[[WorkerError], str]  # a rank raised or died
    # every rank's collectives, {name: times}, once every value is right: what to say if they were more than
    # the exercise needs (an all-gather where one all-reduce does), or None
    excess: Callable[[Sequence[dict[str, int]]], str | None] = lambda calls: None
    # (the world size, a torch.Generator) -> every rank's input, made on the CPU; fn then gets its own as a third
    # argument, on the rank's device. None: fn(rank, world_size) makes its own data.
    inputs: Callable[[int, torch.Generator], list[Any]] | None = None
    # once every value is right: (every rank's input, every rank's Carried) -> what to say if the collectives did
    # not carry the ranks' own data (a stand-in went through them), or None
    moved: Callable[[Sequence[Any], Sequence[Sequence[Carried]]], str | None] = field(
        default=lambda inputs, carried: None)
    # a rank function that also runs a reference beside the answer (torch's DDP, which communicates too) counts
    # the answer's collectives itself: what a rank returned -> {name: times}. None: the whole function is counted.
    calls_in: Callable[[Any], dict[str, int]] | None = None
    # once every value is right: (every rank's value, the world size) -> what else is wrong (a hook that changed
    # its argument, a ring that took extra steps), or None
    also: Callable[[Sequence[Any], int], str | None] = lambda values, size: None
    # (the first world size, the second, what is wrong): the message of an answer right on the first size only
    only_first: Callable[[int, int, str], str] = lambda first, second, wrong: wrong


#: How every checker launches ranks: gloo, held to NCCL's contract (dtlib.launch.strict), on any machine. The
#: verdicts and their messages are then the same on a laptop and on a GPU box, and what NCCL leaves undefined
#: reads as NaN, so an answer that only gloo's leniency makes right is refused. The ranks see no GPU: torch's
#: defaults inside an answer (``fully_shard`` without a mesh, ``init_device_mesh("cuda", ...)``) then agree with
#: the CPU tensors the checker hands it, instead of building a CUDA mesh for 3 ranks on 2 GPUs.
ON_GLOO = {"backend": "gloo", "strict": True, "env": {"CUDA_VISIBLE_DEVICES": ""}}


def same_collectives_hang(err: WorkerTimeout, name: str) -> str:
    """What to say when a rank function hung and nothing more precise is known."""
    return "Your function hung: every rank must call the same collectives in the same order."


def reduce_hint(answer: Answer) -> str:
    """What to say when ``dist.reduce`` stood where ``dist.all_reduce`` belongs."""
    return (f"Rank {answer.rank} does not hold the result: dist.reduce leaves it on one rank only (dst), and the "
            "others' tensors are undefined afterwards (NCCL promises them nothing; the checker fills them with NaN). "
            "Use dist.all_reduce, which leaves it on every rank.")


def dropped_functional(answer: Answer, left: torch.Tensor) -> bool:
    """Whether the rank called a functional collective and returned ``left`` (what its input makes without
    one: itself, divided by world_size, ...): the collective's result, a new tensor, went unused."""
    try:
        value = torch.as_tensor(answer.value, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        return False
    functional = answer.carried and any(entry.functional for entry in answer.carried[answer.rank])
    return bool(functional) and value.shape == left.shape and torch.allclose(value, left, rtol=1e-5, atol=1e-5)


def dropped_functional_hint(answer: Answer) -> str:
    """What to say when a functional collective's result went unused (:func:`dropped_functional`)."""
    name = next(entry.call for entry in answer.carried[answer.rank] if entry.functional)
    return (f"Rank {answer.rank} called the functional {name}, but returned numbers made from its own input "
            f"alone: a functional collective leaves its input as it was and returns a new tensor with the result. "
            f"Use what it returns (y = funcol.{name}(x, ...)), or call dist.{name}(x), which works in place.")


def _holds_undefined(answer: Answer) -> bool:
    """Whether the rank's value holds NaN where the right one has none: what strict mode writes into a tensor
    that NCCL leaves undefined (dtlib.launch.strict)."""
    try:
        value, expected = torch.as_tensor(answer.value, dtype=torch.float64), torch.as_tensor(answer.expected,
                                                                                            dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        return False
    return bool(value.isnan().any()) and not bool(expected.isnan().any())


def undefined_hint(answer: Answer) -> str:
    """What to say when a rank returned numbers that NCCL leaves undefined (strict mode shows them as NaN)."""
    if answer.called("reduce"):
        return reduce_hint(answer)
    return (f"Rank {answer.rank}'s result holds NaN where numbers belong: it read a tensor before the collective "
            "writing it had finished. With async_op=True, call .wait() on the work it returns before reading or "
            "returning the tensor: NCCL writes it later, on its own stream, and the checker marks such numbers NaN.")


#: c10d op -> the index of the argument it sends from and of the one it writes (None: neither), as dispatched.
_SENDS = {"allreduce_": 0, "broadcast_": 0, "reduce_": 0, "send": 0, "recv_": None, "recv_any_source_": None}
_WRITES = {"send": None}


def _flat(value: Any) -> torch.Tensor:
    """Every tensor in a (nested) list, flattened and joined, in float64 on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", torch.float64).flatten()
    parts = [_flat(item) for item in value] if isinstance(value, (list, tuple)) else []
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def _async(name: str, args: tuple) -> bool:
    schema = getattr(torch.ops.c10d, name).default._schema
    where = next((i for i, argument in enumerate(schema.arguments) if argument.name == "async_op"), None)
    return where is not None and where < len(args) and bool(args[where])


def _recorded(rank: int, world_size: int, fn: Callable[..., Any], inputs: Sequence[Any]
              ) -> tuple[Any, dict[str, int], list[Carried]]:
    """In a rank: call ``fn(rank, world_size, its input on the rank's device)``, counting its collectives and
    recording what each sent and received. A blocking call's result is read when the next op runs (before the
    caller can change it); an async one's (which strict mode runs on copies) when ``fn`` returns, and may then
    be unfinished: read it as a hint, not a proof."""
    device = rank_device()
    given = inputs[rank].to(device) if isinstance(inputs[rank], torch.Tensor) else inputs[rank]
    if isinstance(inputs, list):  # the other ranks' inputs leave this process's reach (frames fn could walk to)
        inputs.clear()
    going: list[tuple[str, torch.Tensor, Any, bool]] = []  # (call, sent, the tensors it writes, async)
    carried: list[Carried] = []  # in the order the calls were made, each once its result is read

    def settle(finished: bool) -> None:
        for entry in [entry for entry in going if finished or not entry[3]]:
            going.remove(entry)
            carried.append(Carried(entry[0], entry[1], _flat(entry[2])))

    def see(namespace: str, name: str, args: tuple) -> None:
        settle(False)
        if namespace == "_c10d_functional" and name in FUNCTIONAL_CALLS:  # what it receives is its return value
            carried.append(Carried(name, _flat(args[0]), torch.zeros(0, dtype=torch.float64), functional=True))
            return
        if namespace != "c10d" or name not in CALL_NAMES or name == "barrier":
            return
        sends, writes = _SENDS.get(name, 1), _WRITES.get(name, 0)
        sent = _flat(args[sends]) if sends is not None else torch.zeros(0, dtype=torch.float64)
        going.append((CALL_NAMES[name], sent, args[writes] if writes is not None else [], _async(name, args)))

    with watching(see):
        value, calls = count_collectives(fn, rank, world_size, given)
    settle(True)
    return value, calls, carried


def judge(fn: Any, exercise: RankExercise, world_size: int, timeout: float, seed: int | None = None) -> Feedback:
    """Run ``fn`` on ``world_size`` ranks and on one more, and judge it by ``exercise`` (with ``inputs``, on a
    new draw of them for each call unless ``seed`` is given)."""
    if not callable(fn):
        return Feedback(False, f"Pass your function itself, not {type(fn).__name__}.")
    sizes = (world_size, world_size + 1)  # a second size refuses answers written for one world size; one is odd
    generator = torch.Generator().manual_seed(random.randrange(2**31) if seed is None else seed)
    first: list[Any] = []  # every rank's value in the first run, for the message of a right answer
    for size in sizes:
        inputs: list[Any] = []
        carried: list[list[Carried]] = []
        try:
            if exercise.inputs is None:
                expected = exercise.expected(size)
                results, calls = spawn_counting(fn, size, timeout=timeout, **ON_GLOO)
            else:
                inputs = exercise.inputs(size, generator)
                expected = exercise.expected(inputs)
                reports = spawn(_recorded, size, args=(fn, inputs), timeout=timeout, output="none", **ON_GLOO)
                results, calls, carried = (list(column) for column in zip(*reports, strict=True))
        except WorkerTimeout as err:
            return Feedback(False, exercise.hang(err, getattr(fn, "__name__", "")))
        except WorkerError as err:
            return Feedback(False, exercise.failure(err))
        except CannotSend as err:  # dtlib.spawn's refusal to send the answer, before any rank started
            return Feedback(False, f"Your function cannot be sent to the ranks: {err.reason}")
        if exercise.calls_in is not None:
            calls = [exercise.calls_in(result) for result in results]
        values = [exercise.read(value) for value in results]
        wrong = _wrong(exercise, size, world_size, results, values, expected, calls, inputs, carried)
        if wrong is not None:
            return Feedback(False, wrong if size == sizes[0] else exercise.only_first(*sizes, wrong))
        first = first or values
    return Feedback(True, exercise.right(*sizes, first))


def _wrong(exercise: RankExercise, size: int, world_size: int, results: list[Any], values: list[Any], expected: Any,
           calls: list[dict[str, int]], inputs: list[Any], carried: list[list[Carried]]) -> str | None:
    """What is wrong with one run's answers, in the learner's terms, or None: the first wrong rank's value
    explained by the first hint that holds, or, every value right, what no collective, a stand-in, more
    collectives than needed or the exercise's own last checks (``also``) say."""
    for rank, value in enumerate(values):
        if value is not UNREADABLE and exercise.same(value, expected):
            continue
        answer = Answer(rank, size, world_size, results[rank], value, expected, values, calls, inputs, carried)
        hints = [*exercise.hints, (_holds_undefined, undefined_hint)]  # the exercise's own come first
        say = next((say for holds, say in hints if holds(answer)), exercise.otherwise)
        return say(answer)
    silent = rank_without_communication(calls)  # right values, but did they travel?
    if silent is not None:
        return exercise.no_collective(silent, expected, calls[silent])
    stand_in = exercise.moved(inputs, carried) if exercise.inputs is not None else None
    return stand_in or exercise.excess(calls) or exercise.also(values, size)
