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

Every answer is also held to what any job needs of it, whatever the exercise. Each rank is sent its own input
alone (``dtlib.spawn(rank_args=...)``), so only a collective can bring it another's. Its transfers must finish
in the order NCCL runs them (:mod:`dtlib.launch.nccl_order`: a ring of unbatched ``isend``/``irecv`` runs on
gloo and hangs on NCCL). And it must leave the job as it found it: the default group alive, no group added, no
work unwaited, no data left in the store and no file one rank wrote and another read (neither is a channel),
and the ranks' collectives paired, which one all-reduce of the checker's own, run once every rank has returned,
shows. Two slips any answer can make show in its calls, and are said before the exercise's own hints: a
reduction that neither adds nor averages (``ReduceOp.MIN``, ``PRODUCT``), and the right result computed into a
tensor the rank then dropped (``dist.all_reduce(x / n); return x / n``).
Where the exercise gives inputs, its collectives may send at most :data:`SENT_LIMIT` times the bytes of
the rank's own input. And NCCL's device rule holds on any machine (:mod:`dtlib.launch.host_tensors`): a tensor
the answer made without ``device=``, or copied with ``.cpu()``, is refused when it is sent, as NCCL refuses a
tensor in host memory on a GPU machine.

Example: ``judge(fn, SUM_OF_RANKS, world_size=3, timeout=30)`` is a :class:`dtlib.checks.feedback.Feedback`.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import random
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from dtlib.arguments import seconds, whole
from dtlib.checks._numbers import constant_factor
from dtlib.checks.feedback import Feedback
from dtlib.errors import WorkerError, WorkerTimeout, torch_call_in
from dtlib.launch import host_tensors, nccl_order, strict
from dtlib.launch.device import rank_device
from dtlib.launch.pickling import CannotSend
from dtlib.launch.spawn import spawn
from dtlib.measure.counting import (
    CALL_NAMES,
    FUNCTIONAL_CALLS,
    count_collectives,
    rank_without_communication,
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
    dtype: str = ""  # the dtype it carried, as torch names it ("float16"), where it sent a tensor
    root: int | None = None  # the src or dst of a rooted collective (reduce, broadcast, gather, scatter), in its group


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
    # every rank's reductions as it posted them: (the call, its ReduceOp's name), ("all_reduce", "MIN")
    reductions: Sequence[Sequence[tuple[str, str]]] = ()

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
    # a rank function that records more beside the answer (what it moved, say) returns both: what a rank returned
    # -> the answer's own return, as ``read`` and the hints see it. None: the rank function returns the answer's.
    returned_in: Callable[[Any], Any] | None = None
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


def _stuck_in(stack: str, function_name: str) -> str:
    """From a faulthandler stack (most recent call first), where a rank was when the checker gave up: "waited in
    all_reduce (line 4, in fn)", or, for a rank in no collective (sleeping, computing), "was still running line 4
    of fn, in no collective"."""
    inside = torch_call_in(stack)  # the collective is torch's frame
    line = next((n for n, name in re.findall(r"line (\d+) in (\w+)", stack) if name == function_name), "")
    if inside is None:
        return (f"was still running line {line} of {function_name}, in no collective" if line
                else "was still running, in no collective")
    return f"waited in {inside}" + (f" (line {line}, in {function_name})" if line else "")


def _ranks(ranks: list[int]) -> str:
    """"rank 1", "ranks 1 and 2", "ranks 1, 2 and 3"."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def same_collectives_hang(err: WorkerTimeout, function_name: str) -> str:
    """What to say when ranks hung in collectives: where each one waited (the call, and the line of the
    learner's function it was on), and which ranks had returned without making it."""
    if all(torch_call_in(stack) is None and f"in {function_name}" not in stack for stack in err.stacks.values()):
        return (f"It did not finish within the checker's {err.timeout:g} s, but no rank was waiting: "
                f"{_ranks(sorted(err.stacks))} {'was' if len(err.stacks) == 1 else 'were'} outside your function, in "
                "the checker's own work (recording what the collectives carried). A busy machine is slow there: "
                "pass a longer timeout=.")
    stuck = "; ".join(f"rank {rank} {_stuck_in(stack, function_name)}" for rank, stack in err.stacks.items())
    if not err.finished_ranks:
        return (f"It hung: {stuck}, and no rank returned: each waited for a call that no other rank made. Every "
                "rank must call the same collectives in the same order.")
    return (f"It hung: {stuck}, while {_ranks(err.finished_ranks)} returned without calling it. Every rank must call "
            "the same collectives in the same order: move the collective out of the `if rank == ...` branch.")


def reduce_hint(answer: Answer) -> str:
    """What to say when ``dist.reduce`` stood where ``dist.all_reduce`` belongs: about a rank that was not its dst
    (the dst, named, holds the result), where the call was recorded."""
    roots = [entry.root for entry in (answer.carried[answer.rank] if answer.carried else ())
             if entry.call == "reduce" and entry.root is not None]
    if not roots:
        return (f"Rank {answer.rank} does not hold the result: dist.reduce leaves it on one rank only (dst), and the "
                "others' tensors are undefined afterwards (NCCL promises them nothing; the checker fills them with "
                "NaN). Use dist.all_reduce, which leaves it on every rank.")
    other = next(rank for rank in range(answer.size) if rank != roots[0])
    return (f"Rank {other} does not hold the result: dist.reduce leaves it on its dst alone, here rank {roots[0]}, "
            "and the other ranks' tensors are undefined afterwards (NCCL promises them nothing; the checker fills "
            "them with NaN). Use dist.all_reduce, which leaves it on every rank.")


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


#: What a reduction other than a sum leaves in each slot (MAX: each exercise names it with its numbers).
_KEEPS = {"MIN": "the smallest of the ranks' values", "PRODUCT": "the ranks' values multiplied together",
          "BAND": "their bitwise and", "BOR": "their bitwise or", "BXOR": "their bitwise xor"}


def _other_reduction(answer: Answer) -> tuple[str, str] | None:
    """The first reduction the rank posted with an op that neither adds nor averages (nor MAX, which each
    exercise explains with its own numbers), or None."""
    posted = answer.reductions[answer.rank] if answer.reductions else ()
    return next(((call, op) for call, op in posted if op in _KEEPS), None)


def other_reduction_hint(answer: Answer) -> str:
    """What to say when the rank reduced with MIN, PRODUCT or a bitwise op where the exercise adds."""
    call, op = _other_reduction(answer) or ("", "")
    return (f"Rank {answer.rank} called dist.{call} with ReduceOp.{op}, which leaves {_KEEPS[op]} in each slot, "
            f"not their sum. Reduce with ReduceOp.SUM ({call}'s default; AVG for a mean where the backend has it).")


def _kept_elsewhere(answer: Answer) -> Carried | None:
    """An in-place collective of the rank that computed the right value into a tensor the rank did not return:
    it returned numbers made from its own input alone (``dist.all_reduce(x / n); return x / n``)."""
    if not answer.carried or not answer.inputs or answer.value is UNREADABLE:
        return None
    try:
        want = torch.as_tensor(answer.expected, dtype=torch.float64).flatten()
        got = torch.as_tensor(answer.value, dtype=torch.float64).flatten()
    except (TypeError, ValueError, RuntimeError):
        return None
    own = torch.as_tensor(answer.inputs[answer.rank], dtype=torch.float64).flatten()
    factor = constant_factor(got, own, rtol=1e-5) if got.shape == own.shape else None
    if factor is None or (own.numel() == 1 and not any(  # one number is a multiple of any: itself, or scaled by n
            abs(factor - c) <= 1e-5 * c for c in (1.0, 1.0 / answer.size, float(answer.size)))):
        return None
    return next((entry for entry in answer.carried[answer.rank] if not entry.functional
                 and entry.received.shape == want.shape and torch.allclose(entry.received, want, rtol=1e-5)), None)


def kept_elsewhere_hint(answer: Answer) -> str:
    """What to say when the right result went into a tensor the rank then dropped (:func:`_kept_elsewhere`)."""
    entry = _kept_elsewhere(answer)
    assert entry is not None
    shown = ", ".join(f"{v:.4g}" for v in entry.received[:4].tolist()) + (", ..." if entry.received.numel() > 4 else "")
    return (f"Rank {answer.rank}'s dist.{entry.call} computed the right numbers ([{shown}]), but into a tensor your "
            "function did not return: it returned numbers made from its own input alone. A collective writes the "
            "tensor it is given; given an expression (x / world_size, x.clone()), it writes a new tensor that is "
            "then thrown away. Name it, pass it, return it: y = x / world_size; dist.all_reduce(y); return y.")


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


#: A rank's collectives may send at most this many times the bytes of its own input, and 64 bytes whatever the
#: input: a ring's reduce-scatter and all-gather send under twice it, a count packed beside a loss a few bytes
#: more. Sending far more (a 16 MB buffer to carry one number) is a cost every step repeats on the network.
SENT_LIMIT = 8
_SENT_FLOOR = 64


def _sent_bytes(entry: Carried) -> int:
    """The bytes one collective sent, in the dtype it sent them (float64 where none is known)."""
    dtype = getattr(torch, entry.dtype, None) if entry.dtype else None
    return entry.sent.numel() * (dtype.itemsize if isinstance(dtype, torch.dtype) else 8)


def oversent(inputs: Sequence[Any], carried: Sequence[Sequence[Carried]]) -> str | None:
    """Once every value is right: the first rank whose collectives sent more than :data:`SENT_LIMIT` times its own
    input's bytes, said with the numbers, or None."""
    for rank, entries in enumerate(carried):
        if not isinstance(inputs[rank], torch.Tensor):
            continue  # an exercise whose input is more than a tensor bounds its traffic itself (13's experts)
        own = inputs[rank]
        need, sent = own.numel() * own.element_size(), sum(map(_sent_bytes, entries))
        if sent > max(SENT_LIMIT * need, _SENT_FLOOR):
            return (f"Every rank returned the right numbers, but rank {rank}'s collectives sent {sent:,} bytes to "
                    f"carry its input of {need:,} bytes, {sent / max(need, 1):,.0f} times as much. A collective "
                    "sends every byte of its tensor, at every step, over the network on a cluster: pass the input "
                    "itself (or a few numbers beside it), not a larger buffer that holds it.")
    return None


def _flat(value: Any) -> torch.Tensor:
    """Every tensor in a (nested) list, flattened and joined, in float64 on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", torch.float64).flatten()
    parts = [_flat(item) for item in value] if isinstance(value, (list, tuple)) else []
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def _dtype(value: Any) -> str:
    """The dtype of the first tensor in a (nested) list, as torch names it ("float32"), or ""."""
    if isinstance(value, torch.Tensor):
        return str(value.dtype).removeprefix("torch.")
    return next((found for found in map(_dtype, value) if found), "") if isinstance(value, (list, tuple)) else ""


def _unpickled(value: Any) -> torch.Tensor | None:
    """What an object collective (``all_gather_object``, ``broadcast_object_list``) sent, where its tensor of
    pickled bytes holds numbers: those numbers, flattened to float64, or None. Read in the rank that pickled them."""
    tensor = value if isinstance(value, torch.Tensor) else next(iter(_tensors_in(value)), None)
    if tensor is None or tensor.dtype != torch.uint8 or tensor.dim() != 1:
        return None
    try:
        found = pickle.loads(tensor.detach().cpu().numpy().tobytes())  # noqa: S301 - this rank's own bytes
        return torch.as_tensor(found, dtype=torch.float64).flatten()
    except Exception:  # noqa: BLE001 - not a pickle, or not numbers: carried as bytes
        return None


def _tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for item in value for t in _tensors_in(item)] if isinstance(value, (list, tuple)) else []


def _argument(name: str, args: tuple, argument: str) -> Any:
    """The value of the c10d op ``name``'s argument called ``argument`` in ``args`` as dispatched, or None."""
    schema = getattr(torch.ops.c10d, name).default._schema
    where = next((i for i, known in enumerate(schema.arguments) if known.name == argument), None)
    return args[where] if where is not None and where < len(args) else None


def _async(name: str, args: tuple) -> bool:
    return bool(_argument(name, args, "async_op"))


def _recorded(rank: int, world_size: int, fn: Callable[..., Any], given: Any
              ) -> tuple[Any, dict[str, int], list[Carried]]:
    """In a rank: call ``fn(rank, world_size, given on the rank's device)``, ``given`` being this rank's own input
    (the only one it was sent), counting its collectives and recording what each sent and received. A blocking
    call's result is read when the next op runs (before the caller can change it); an async one's (which strict
    mode runs on copies) when ``fn`` returns, and may then be unfinished: read it as a hint, not a proof."""
    device = rank_device()
    given = given.to(device) if isinstance(given, torch.Tensor) else given
    # (call, sent, the tensors it writes, async, dtype, root)
    going: list[tuple[str, torch.Tensor, Any, bool, str, int | None]] = []
    carried: list[Carried] = []  # in the order the calls were made, each once its result is read

    def settle(finished: bool) -> None:
        for entry in [entry for entry in going if finished or not entry[3]]:
            going.remove(entry)
            carried.append(Carried(entry[0], entry[1], _flat(entry[2]), dtype=entry[4], root=entry[5]))

    def see(namespace: str, name: str, args: tuple) -> None:
        settle(False)
        if namespace == "_c10d_functional" and name in FUNCTIONAL_CALLS:  # what it receives is its return value
            carried.append(Carried(name, _flat(args[0]), torch.zeros(0, dtype=torch.float64), functional=True,
                                   dtype=_dtype(args[0])))
            return
        if namespace != "c10d" or name not in CALL_NAMES or name == "barrier":
            return
        sends, writes = _SENDS.get(name, 1), _WRITES.get(name, 0)
        sent = _flat(args[sends]) if sends is not None else torch.zeros(0, dtype=torch.float64)
        dtype = _dtype(args[sends]) if sends is not None else ""
        numbers = _unpickled(args[sends]) if dtype == "uint8" else None  # an object collective's pickle
        if numbers is not None:
            sent, dtype = numbers, "float64"
        going.append((CALL_NAMES[name], sent, args[writes] if writes is not None else [], _async(name, args),
                      dtype, _argument(name, args, "root_rank")))

    with watching(see):
        value, calls = count_collectives(fn, rank, world_size, given)
    settle(True)
    return value, calls, carried


def transfers_hang(err: WorkerTimeout) -> str | None:
    """What to say when every rank waits in a blocking ``send`` or ``recv``, some in a send, and none returned: each
    waits for a peer that waits in a transfer of its own (a ring where every rank sends first), or None."""
    calls = {rank: torch_call_in(stack) for rank, stack in err.stacks.items()}
    if err.finished_ranks or "send" not in calls.values() or not set(calls.values()) <= {"send", "recv"}:
        return None  # every rank in recv: each waits for a send nobody made, as the exercise's own message says
    where = ", ".join(f"rank {rank} in dist.{call}" for rank, call in calls.items())
    return (f"It hung: {where}. A blocking transfer waits until its peer reaches the matching one (a send its "
            "receive, a receive its send), and every peer was itself waiting in a transfer. Post each rank's send "
            "and receive together, in one dist.batch_isend_irecv, then wait() on each; or order them so that each "
            "pair meets: even ranks send first, odd ranks receive first.")


def _returned(err: WorkerTimeout) -> WorkerTimeout:
    """``err`` with the ranks that had returned from the answer (and waited for the others in the checker's own
    barrier, :func:`_left_behind`) counted as finished: the exercise's hang message is about the answer."""
    late = [rank for rank, stack in err.stacks.items() if f"in {_left_behind.__name__}" in stack]
    if not late:
        return err
    stacks = {rank: stack for rank, stack in err.stacks.items() if rank not in late}
    return WorkerTimeout(err.timeout, stacks, [*err.finished_ranks, *late], outcome=err.outcome)


class _Files:
    """The paths a rank opened while the answer ran, to write and to read, seen by Python's audit hook (every
    ``open``, ``io.open`` and ``os.open``: pickle's, numpy's and torch.load's files) and by ``torch.save``, which
    writes from C++ and is watched by name. A hook cannot be removed, so it is added once per rank process and
    records only inside :meth:`recording`."""

    def __init__(self) -> None:
        self.on, self.hooked = False, False
        self.written: set[str] = set()
        self.read: set[str] = set()

    def _hook(self, event: str, args: tuple) -> None:
        if not self.on or event != "open" or len(args) < 3 or args[0] is None or isinstance(args[0], int):
            return
        try:
            path = os.path.abspath(os.fsdecode(os.fspath(args[0])))
        except (TypeError, ValueError):
            return
        mode, flags = args[1], args[2]
        writes = (any(c in mode for c in "wax+") if isinstance(mode, str)
                  else bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)))
        (self.written if writes else self.read).add(path)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        if not self.hooked:
            sys.addaudithook(self._hook)
            self.hooked = True
        self.written.clear()
        self.read.clear()
        save = torch.save

        def noted_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(f, (str, bytes, os.PathLike)):
                self.written.add(os.path.abspath(os.fsdecode(os.fspath(f))))
            return save(obj, f, *args, **kwargs)

        torch.save, self.on = noted_save, True
        try:
            yield
        finally:
            torch.save, self.on = save, False


_FILES = _Files()


class _StoreWrites:
    """The keys a rank's answer wrote to any store while it ran (``set``, ``add``, ``compare_set``, ``multi_set``,
    ``append``, called from outside torch: a group torch creates writes its own), whatever it deleted afterwards.
    The methods are the base class's, which every store inherits, replaced only inside :meth:`recording`."""

    METHODS = ("set", "add", "compare_set", "multi_set", "append")

    def __init__(self) -> None:
        self.keys: list[str] = []

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        self.keys.clear()
        originals = {name: getattr(dist.Store, name) for name in self.METHODS}

        def noted(original: Callable[..., Any]) -> Callable[..., Any]:
            def method(store: Any, *args: Any, **kwargs: Any) -> Any:
                if args and not sys._getframe(1).f_code.co_filename.startswith(strict.TORCH_DIR):
                    key = args[0][0] if isinstance(args[0], (list, tuple)) and args[0] else args[0]
                    self.keys.append(key.decode(errors="replace") if isinstance(key, bytes) else str(key))
                return original(store, *args, **kwargs)
            return method

        for name, original in originals.items():
            setattr(dist.Store, name, noted(original))
        try:
            yield
        finally:
            for name, original in originals.items():
                setattr(dist.Store, name, original)


_STORE = _StoreWrites()


def file_channel(files: Sequence[tuple[set[str], set[str]]]) -> str | None:
    """From every rank's (paths written, paths read) while the answer ran: a file one rank wrote and another read,
    said, or None. Writing a log is no channel; reading what another rank wrote is."""
    for reader, (_, read) in enumerate(files):
        for writer, (written, _) in enumerate(files):
            shared = sorted(read & written) if writer != reader else []
            if shared:
                return (f"Rank {reader} read {shared[0]}, a file that rank {writer} wrote while your function ran. A "
                        "file is not a channel between ranks: on a cluster they rarely share a disk, and nothing "
                        "orders one rank's write before another's read. Only a collective may bring a rank another's "
                        "data.")
    return None


_REACHED = "dtlib-check/reached"  # the one key of the checker's barriers: a counter, so they add no keys after it


def _all_reach(store: Any, stage: int, world_size: int) -> None:
    """The ``stage``-th barrier (1, 2, ...) through the job's store, not a collective: it cannot pair with one of
    the answer's, and it still works after an answer destroyed the process group. Every stage counts on the one
    key, so that only the first creates it: the store's number of keys then changes only by what others write."""
    store.add(_REACHED, 1)
    while store.add(_REACHED, 0) < stage * world_size:
        time.sleep(0.005)


def destroyed_while_needed(err: WorkerError) -> str | None:
    """What to say when a rank raised because the default process group was gone: dtlib created it before the
    answer ran, so the answer (or a hook or module of its) destroyed it, and the checker's next use of it failed."""
    cause = next((failure for failure in err.failures if failure.exc_type is not None
                  and any(words in failure.message for words in _GROUP_GONE)), None)
    if cause is None:
        return None
    said = cause.message.splitlines()[0][:120].rstrip(".")
    return (f"Your code destroyed the process group (dist.destroy_process_group) while the job still needed it: "
            f"what ran next on it (DDP's next all-reduce, a layer's collective, the check's own) raised on rank "
            f"{cause.rank}: \"{said}\". Whoever started the group ends it, once, at the very end (here dtlib does): "
            f"remove the call.")


#: gloo's words as it aborts a rank whose buffer is smaller than the message that arrived for it: bytes that
#: arrived, bytes the buffer holds ("op.preamble.length <= op.nbytes. 20 vs 4. Received data size doesn't match").
_TOO_LARGE = re.compile(r"(\d+) vs (\d+)\. Received data size doesn't match expected size")


def sizes_differ(err: WorkerError) -> str | None:
    """What to say when gloo aborted a rank because a message was larger than the buffer it arrived for: a send
    and the receive strict mode paired it with (NCCL's pairing: by order, tags ignored) differ in size, or the
    ranks' tensors in one collective do. gloo's own words blame a collective and hide which."""
    for failure in err.failures:
        found = _TOO_LARGE.search(failure.message)
        if found is not None:
            arrived, room = found.groups()
            return (f"Rank {failure.rank} was stopped by gloo: {arrived} bytes arrived for a buffer of {room}. The "
                    "ranks' transfers did not pair up in size: a send met a receive of another size (strict mode "
                    "pairs them as NCCL does, the k-th send between two ranks with the k-th receive, whatever their "
                    "tags), or the ranks gave one collective tensors of different sizes. NCCL compares no sizes, so "
                    "on GPUs the ranks would read wrong numbers or hang. Give every send a "
                    "receive of its size and dtype, posted in the same order on both ranks, and every rank "
                    "tensors of one size in each collective.")
    return None


#: Python's words for a list of one item unpacked into several names, or indexed past its first.
_ONE_ITEM = {"ValueError": re.compile(r"not enough values to unpack \(expected \d+, got 1\)"),
             "IndexError": re.compile(r"list index out of range")}


def one_work_per_batch(err: WorkerError) -> str | None:
    """A note for a rank that unpacked a list of one into several names, or indexed it past its first: perhaps
    ``batch_isend_irecv``'s works, which strict mode returns as NCCL does, one for the whole batch (gloo returns
    one per transfer)."""
    if not any(failure.exc_type in _ONE_ITEM and _ONE_ITEM[failure.exc_type].search(failure.message)
               for failure in err.failures):
        return None
    return ("If that line reads what dist.batch_isend_irecv returned: NCCL returns one work for the whole batch "
            "(gloo one per transfer), and strict mode does as NCCL does. Wait for every work it returns: "
            "for work in dist.batch_isend_irecv(ops): work.wait().")


#: torch's words for a process group that no longer exists: the default one (c10d) and one looked up by name
#: (the functional collectives under DTensor).
_GROUP_GONE = ("Default process group has not been initialized", "Could not resolve the process group registered")


def _left_behind(rank: int, world_size: int, groups: int, keys: int, store: Any, wrote: Sequence[str] = ()
                 ) -> list[str]:
    """In a rank, once the answer returned and every rank has (a barrier through ``store``): what the answer left
    the job (a destroyed or an added process group, work never waited for, keys written to the store, a channel
    beside the collectives), then whether one all-reduce of the checker's own still pairs up on the default group.
    ``groups`` and ``keys`` are the counts before the answer ran; ``wrote`` the keys the answer wrote itself."""
    _all_reach(store, 3, world_size)  # every rank returned: the all-reduce below cannot meet a slower one's answer
    if not dist.is_initialized():
        return [f"Rank {rank}'s function destroyed the process group (dist.destroy_process_group). The job goes on "
                "after an exercise's function returns (the next step, the next call): whoever started the group "
                "ends it, once, at the very end. Remove the call."]
    said = []
    made = len(distributed_c10d._world.pg_map) - groups
    if made > 0:
        said.append(f"Rank {rank}'s function created {made} process group{'s' * (made > 1)} and left "
                    f"{'them' if made > 1 else 'it'} (dist.new_group, a DeviceMesh): each call adds another, with its "
                    "own connections, and NCCL gives each its own communicator and GPU memory. Create groups once, "
                    "outside the function that runs every step, or use the default group.")
    written = store.num_keys() - keys  # the barriers add no keys after the first
    if wrote or (written > 0 and made <= 0):  # a new group writes keys of its own: said above
        which = f" (rank {rank} wrote '{wrote[0]}')" if wrote else ""
        said.append(f"The ranks' functions wrote to the process group's store{which}, even if they deleted it "
                    "after. The store is how ranks find each other, not a way to hand each other data: on a cluster "
                    "it is one TCP server that every rank waits on. Only a collective may bring a rank another's "
                    "data.")
    said += [f"Rank {rank} never waited for its {what}: gloo finishes it anyway, NCCL promises nothing before "
             "wait(), and the tensor it writes or sends may still change. Call .wait() on the work it returned "
             "before returning." for what in strict.unwaited()]
    check = torch.ones(1, device=rank_device())
    dist.all_reduce(check)  # the checker's own collective, as the job's next step would run one
    if check.item() != world_size:
        said.append(f"After your function returned on rank {rank}, the checker's own all-reduce of ones gave "
                    f"{check.item():g}, not {world_size}: the ranks had not called the same collectives in the same "
                    "order, so the next collective paired with one left over. Every rank must call the same ones.")
    return said


def _rank(rank: int, world_size: int, fn: Callable[..., Any], *given: Any
          ) -> tuple[Any, dict[str, int], list[Carried], list[nccl_order.Launch], list[str], tuple[set[str], set[str]]]:
    """What every checker's rank runs: the answer, its collectives counted (and, given this rank's own input,
    recorded), what strict mode saw it post (for :func:`nccl_order.deadlock`), what it left the job
    (:func:`_left_behind`), and the files it wrote and read meanwhile (:func:`file_channel`)."""
    store = distributed_c10d._get_default_store()
    _all_reach(store, 1, world_size)  # every rank's joining keys are written, and the barrier's own
    groups, keys = len(distributed_c10d._world.pg_map), store.num_keys()
    _all_reach(store, 2, world_size)  # every rank has counted before any answer writes
    with nccl_order.recording() as posted, _FILES.recording(), _STORE.recording(), host_tensors.watching():
        if not given:
            value, calls = count_collectives(fn, rank, world_size)
            carried: list[Carried] = []
        else:
            value, calls, carried = _recorded(rank, world_size, fn, *given)
    files, wrote = (set(_FILES.written), set(_FILES.read)), list(_STORE.keys)
    return value, calls, carried, posted, _left_behind(rank, world_size, groups, keys, store, wrote), files


def judge(fn: Any, exercise: RankExercise, world_size: int, timeout: float | None, seed: int | None = None,
          runs: list[list[Any]] | None = None) -> Feedback:
    """Run ``fn`` on ``world_size`` ranks and on one more, and judge it by ``exercise`` (with ``inputs``, on a
    new draw of them for each call unless ``seed`` is given). A ``world_size`` under 2, or one that is not a
    whole number, and a ``timeout`` that is not a positive number of seconds raise ValueError. ``runs``, where
    given, gets what every rank returned in each run that finished, in order, for a checker that judges more of
    the same runs once the verdict is right (09's: what the ranks moved), instead of running the answer again."""
    try:  # the check's own arguments, not the answer: a clear error, as for any call
        world_size, timeout = whole("world_size", world_size, minimum=2), seconds("timeout", timeout)
    except ValueError as err:
        raise ValueError(f"{err}: the check runs world_size ranks and one more, and a collective needs two ranks "
                         "to show anything") from None
    if not callable(fn):
        return Feedback(False, f"Pass your function itself, not {type(fn).__name__}.")
    sizes = (world_size, world_size + 1)  # a second size refuses answers written for one world size; one is odd
    generator = torch.Generator().manual_seed(random.randrange(2**31) if seed is None else seed)
    first: list[Any] = []  # every rank's value in the first run, for the message of a right answer
    for size in sizes:
        inputs: list[Any] = []
        try:
            if exercise.inputs is None:
                expected = exercise.expected(size)
            else:
                inputs = exercise.inputs(size, generator)
                expected = exercise.expected(inputs)
            reports = spawn(_rank, size, args=(fn,), rank_args=inputs if exercise.inputs is not None else None,
                            timeout=timeout, output="none", **ON_GLOO)
            results, calls, carried, posted, left, files = (list(column) for column in zip(*reports, strict=True))
        except WorkerTimeout as err:
            err = _returned(err)
            return Feedback(False, transfers_hang(err) or exercise.hang(err, getattr(fn, "__name__", "")))
        except WorkerError as err:
            said = destroyed_while_needed(err) or sizes_differ(err) or exercise.failure(err)
            return Feedback(False, "\n".join(filter(None, (said, one_work_per_batch(err)))))
        except CannotSend as err:  # dtlib.spawn's refusal to send the answer, before any rank started
            return Feedback(False, f"Your function cannot be sent to the ranks: {err.reason}")
        if runs is not None:
            runs.append(results)
        if exercise.calls_in is not None:
            calls = [exercise.calls_in(result) for result in results]
        if exercise.returned_in is not None:
            results = [exercise.returned_in(result) for result in results]
        values = [exercise.read(value) for value in results]
        reductions = [[(op.kind, op.reduce_op) for launch in launches for op in launch if op.reduce_op]
                      for launches in posted]
        unequal = nccl_order.sizes_disagree(posted)  # what NCCL refuses, whatever the values
        wrong = _wrong(exercise, size, world_size, results, values, expected, calls, inputs, carried,
                       nccl_order.deadlock(posted) or unequal or next((said for rank in left for said in rank), None),
                       file_channel(files), reductions, unequal or nccl_order.tags_disagree(posted))
        if wrong is not None:
            return Feedback(False, wrong if size == sizes[0] else exercise.only_first(*sizes, wrong))
        first = first or values
    return Feedback(True, exercise.right(*sizes, first))


def _wrong(exercise: RankExercise, size: int, world_size: int, results: list[Any], values: list[Any], expected: Any,
           calls: list[dict[str, int]], inputs: list[Any], carried: list[list[Carried]], job: str | None = None,
           channel: str | None = None, reductions: Sequence[Sequence[tuple[str, str]]] = (),
           pairing: str | None = None) -> str | None:
    """What is wrong with one run's answers, in the learner's terms, or None: the first wrong rank's value
    explained by a send and a receive that NCCL pairs but that differ in size or tag (``pairing``, from
    :mod:`nccl_order`: strict mode paired them as NCCL does) or by the first hint that holds, or, every value
    right, what no collective, a stand-in, the state the job was left in (``job``: transfers that hang on NCCL or
    differ in size, a group destroyed or added, work never waited for), more collectives than needed or the
    exercise's own last checks (``also``) say. A file one rank wrote and another read (``channel``) is said first
    once the values are right: it is how they got there."""
    for rank, value in enumerate(values):
        if value is not UNREADABLE and exercise.same(value, expected):
            continue
        if pairing is not None:
            return pairing
        answer = Answer(rank, size, world_size, results[rank], value, expected, values, calls, inputs, carried,
                        reductions)
        # what any answer can do wrong in a way its calls show, first; then the exercise's own
        hints = [(lambda a: _other_reduction(a) is not None, other_reduction_hint),
                 (lambda a: _kept_elsewhere(a) is not None, kept_elsewhere_hint),
                 *exercise.hints, (_holds_undefined, undefined_hint)]
        say = next((say for holds, say in hints if holds(answer)), exercise.otherwise)
        return say(answer)
    if channel is not None:
        return channel
    silent = rank_without_communication(calls)  # right values, but did they travel?
    if silent is not None:
        return exercise.no_collective(silent, expected, calls[silent])
    if exercise.inputs is not None:
        stand_in = exercise.moved(inputs, carried) or oversent(inputs, carried)
        if stand_in:
            return stand_in
    return job or exercise.excess(calls) or exercise.also(values, size)
