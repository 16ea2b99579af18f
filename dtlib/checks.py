"""Exercise checkers: each says what is right or, precisely, what is wrong.

A checker returns :class:`Feedback`; the notebook shows it as the cell's value.
Checkers never raise on a wrong answer: a wrong answer is the normal case.

Example::

    dtlib.checks.backend_choice("gloo", world_size=2)   # ✓ or ✗ with a hint
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dtlib.errors import WorkerError, WorkerTimeout
from dtlib.launch import resolve_backend, spawn


@dataclass(frozen=True)
class Feedback:
    """The verdict of a checker: ``ok`` and a message that says what to do next."""

    ok: bool
    message: str

    def __repr__(self) -> str:
        return ("✓ " if self.ok else "✗ ") + self.message

    def __bool__(self) -> bool:
        return self.ok


def backend_choice(answer: Any, world_size: int = 2) -> Feedback:
    """Notebook 00: which backend does ``dtlib.spawn(backend="auto")`` pick for ``world_size`` ranks here?"""
    if answer is None:
        return Feedback(False, "No answer yet: set `answer` to 'gloo' or 'nccl'.")
    if not isinstance(answer, str) or answer.lower() not in ("gloo", "nccl", "mpi"):
        return Feedback(False, f"{answer!r} is not a backend name; the choices are 'gloo', 'nccl' and 'mpi'.")
    expected = resolve_backend("auto", world_size)
    if answer.lower() == expected:
        why = "one GPU per rank is available" if expected == "nccl" else "there are not enough GPUs for NCCL"
        return Feedback(True, f"Right: {expected}, because {why} for {world_size} ranks.")
    if answer.lower() == "nccl":
        return Feedback(False, f"NCCL needs one CUDA GPU per rank; this machine cannot give {world_size} ranks "
                               "a GPU each (look at the GPU count above).")
    if answer.lower() == "mpi":
        return Feedback(False, "dtlib never picks MPI by itself; 'auto' chooses between NCCL and gloo.")
    return Feedback(False, f"This machine has enough GPUs for {world_size} ranks, so 'auto' picks NCCL.")


def sum_of_ranks(fn: Callable[[int, int], Any], world_size: int = 3, timeout: float = 30.0) -> Feedback:
    """Notebook 01: ``fn(rank, world_size)`` must return, on every rank, 0 + 1 + ... + (world_size - 1).

    Example: ``sum_of_ranks(lambda rank, world_size: rank)`` says the all-reduce is missing.
    """
    if not callable(fn):
        return Feedback(False, f"Pass your function itself, not {type(fn).__name__}.")
    expected = world_size * (world_size - 1) // 2
    try:
        results = spawn(fn, world_size, timeout=timeout, output="none")
    except WorkerError as err:
        if any("still running" in failure.message for failure in err.failures):
            return Feedback(False, "Your function hung: does every rank call the same collective? "
                                   f"Details:\n{err}")
        return Feedback(False, f"Your function raised on a rank:\n{err.failures[0].headline()}")
    wrong = {}
    for rank, value in enumerate(results):
        if _as_number(value) != expected:
            wrong[rank] = value
    if not wrong:
        return Feedback(True, f"Every rank returned {expected}: the all-reduce summed all {world_size} ranks.")
    rank, value = next(iter(wrong.items()))
    if value is None:
        hint = "it returned None: return the tensor (or its .item()) after the all-reduce."
    elif all(_as_number(v) == r for r, v in enumerate(results)):
        hint = "each rank returned its own rank: was dist.all_reduce called before returning?"
    elif _as_number(value) == expected * world_size:
        hint = "the sum came out world_size times too big: add each rank's number once, not the total."
    else:
        hint = f"it returned {value!r}."
    return Feedback(False, f"Rank {rank} should return {expected}, but {hint}")


def average_of_ranks(fn: Callable[[int, int], Any], world_size: int = 4, timeout: float = 30.0) -> Feedback:
    """Notebook 02: ``fn(rank, world_size)`` must return, on every rank, the mean over ranks of
    ``dtlib.collectives.starting_values(rank, world_size)`` (older torch's gloo has no ``ReduceOp.AVG``).

    Example: ``average_of_ranks(lambda rank, world_size: None)`` says nothing came back.
    """
    import torch

    from dtlib.collectives import starting_values

    if not callable(fn):
        return Feedback(False, f"Pass your function itself, not {type(fn).__name__}.")
    start = torch.stack([starting_values(r, world_size) for r in range(world_size)])  # (ranks, slots)
    expected, total = start.mean(0), start.sum(0)
    try:
        results = spawn(fn, world_size, timeout=timeout, output="none")
    except WorkerTimeout:
        return Feedback(False, "Your function hung: every rank must call the same collectives in the same order.")
    except WorkerError as err:
        headline = err.failures[0].headline()
        if "AVG" in headline:
            return Feedback(False, "This torch's gloo has no ReduceOp.AVG: sum with ReduceOp.SUM, then divide.")
        return Feedback(False, f"Your function raised on a rank:\n{headline}")
    for rank, value in enumerate(results):
        if not isinstance(value, torch.Tensor) or value.shape != expected.shape:
            return Feedback(False, f"Rank {rank} returned {value!r}; return the averaged tensor of "
                                   f"{world_size} values.")
        if torch.allclose(value, expected):
            continue
        if torch.allclose(value, total):
            return Feedback(False, f"Rank {rank} holds the sum {value.tolist()}: divide by world_size.")
        if torch.allclose(value, start[rank]):
            return Feedback(False, f"Rank {rank} still holds its own values: call dist.all_reduce on them.")
        return Feedback(False, f"Rank {rank} returned {value.tolist()}, expected {expected.tolist()}.")
    return Feedback(True, f"Every rank holds the mean {expected.tolist()}. all_reduce(SUM) / world_size "
                          "works on every backend and torch version; DDP averages gradients that way.")


def _ring_with_your_phase(rank: int, world_size: int, phase: Callable[..., None], which: str,
                          length: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from dtlib import collectives

    data = torch.arange(length, dtype=torch.float64) * 10.0**rank  # rank r: 10^r x [0, 1, 2, ...]
    expected = data.clone()
    dist.all_reduce(expected)
    ours = data.clone()
    collectives.ring_all_reduce(ours, **{which: phase})
    return {"ours": ours.tolist(), "expected": expected.tolist(), "input": data.tolist()}


def ring_phase(phase: Callable[..., None], which: str = "all_gather", world_size: int = 4,
               length: int = 10, timeout: float = 30.0) -> Feedback:
    """Notebook 03: your ``phase(chunks, rank, world_size)`` inside ``ring_all_reduce``.

    ``which`` is "all_gather" or "reduce_scatter": the phase you wrote; dtlib's own
    implementation does the other one. The buffer (``length`` elements, uneven chunks
    on 4 ranks) must come out equal to ``dist.all_reduce``'s.

    Example: ``ring_phase(dtlib.collectives.ring_all_gather_phase)`` is ✓.
    """
    if which not in ("all_gather", "reduce_scatter"):
        return Feedback(False, f"which must be 'all_gather' or 'reduce_scatter', not {which!r}.")
    if not callable(phase):
        return Feedback(False, f"Pass your function itself, not {type(phase).__name__}.")
    try:
        reports = spawn(_ring_with_your_phase, world_size, args=(phase, which, length), timeout=timeout,
                        output="none")
    except WorkerTimeout:
        return Feedback(False, "The ring hung: on every step each rank must call ring_shift exactly once, "
                               "sending one chunk and receiving one, and all ranks must take the same "
                               f"number of steps ({world_size - 1}).")
    except WorkerError as err:
        headlines = [failure.headline() for failure in err.failures]
        aborted = [h for h in headlines if "SIGABRT" in h]
        cut_off = [f"rank {f.rank} lost its connection to a peer" for f in err.failures
                   if "Connection reset" in f.message or "Connection closed" in f.message]
        if aborted or cut_off:
            return Feedback(False, f"{(aborted + cut_off)[0]}. gloo aborts a rank when a send and the receive "
                                   "it meets differ in size, and its peers then lose the connection: with "
                                   "uneven chunks, the chunk you send must be the one your right-hand "
                                   "neighbour expects to receive.")
        return Feedback(False, f"Your phase raised on a rank:\n{headlines[0]}")
    from dtlib.ring import chunk_bounds

    for rank, report in enumerate(reports):
        for chunk, (start, stop) in enumerate(chunk_bounds(length, world_size)):
            got, want = report["ours"][start:stop], report["expected"][start:stop]
            if got == want:
                continue
            where = f"On rank {rank}, chunk {chunk} holds {got} but should hold {want}"
            # Every input is >= 0 (rank r holds 10^r x [0, 1, ...]), so too much or too little is telling.
            if all(g >= w for g, w in zip(got, want, strict=True)):
                return Feedback(False, f"{where}: more than the sum, so some contribution was added twice. "
                                       "Reduce-scatter adds the incoming chunk; all-gather copies it (copy_).")
            if all(g <= w for g, w in zip(got, want, strict=True)):
                return Feedback(False, f"{where}: less than the sum, so some ranks' contributions never "
                                       "reached it. Check which chunk you send and which you receive at each "
                                       "step (dtlib.ring.simulate_all_reduce shows them).")
            return Feedback(False, f"{where}. Step through dtlib.ring.simulate_all_reduce on a small input to "
                                   "see which chunk should move at each step.")
    return Feedback(True, f"Equal to dist.all_reduce on all {world_size} ranks, uneven chunks included: "
                          f"your {which.replace('_', '-')} phase works.")


def _as_number(value: Any) -> Any:
    try:
        return value.item()
    except (AttributeError, RuntimeError, ValueError):
        return value


def _your_hook_against_ddp(rank: int, world_size: int, hook: Callable[[Any], Any]) -> dict[str, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from dtlib import data, models

    x, y = data.regression(8 * world_size, seed=1).tensors
    mine = x[rank * 8:(rank + 1) * 8], y[rank * 8:(rank + 1) * 8]  # each rank its own 8 samples
    yours, reference = models.build("mlp", seed=0), DistributedDataParallel(models.build("mlp", seed=0))
    for param in yours.parameters():
        param.register_hook(hook)
    models.loss_fn("mlp", yours(mine[0]), mine[1]).backward()
    models.loss_fn("mlp", reference(mine[0]), mine[1]).backward()
    local = models.build("mlp", seed=0)
    models.loss_fn("mlp", local(mine[0]), mine[1]).backward()
    flat = [torch.cat([p.grad.reshape(-1) for p in m.parameters()]) for m in (yours, reference.module, local)]
    return {"yours": flat[0], "ddp": flat[1], "local": flat[2]}


def gradient_hook(hook: Callable[[Any], Any], world_size: int = 2, timeout: float = 60.0) -> Feedback:
    """Notebook 04: ``hook(grad)`` is registered on every parameter (``param.register_hook``) and must
    return the gradient averaged over the ranks, as DDP makes it.

    Example: ``gradient_hook(lambda grad: grad)`` says the gradients were never all-reduced.
    """
    import torch

    if not callable(hook):
        return Feedback(False, f"Pass your hook function itself, not {type(hook).__name__}.")
    try:
        results = spawn(_your_hook_against_ddp, world_size, args=(hook,), timeout=timeout, output="none")
    except WorkerTimeout:
        return Feedback(False, "Your hook hung: every rank must all-reduce every gradient, in the same order.")
    except WorkerError as err:
        raised = [failure for failure in err.failures if failure.exc_type is not None]
        if raised and "gloo" not in raised[0].message:
            return Feedback(False, f"Your hook raised on a rank:\n{raised[0].headline()}")
        return Feedback(False, "A rank died waiting for an all-reduce that another rank never made: every rank "
                               f"must all-reduce every gradient, in the same order.\n{err.failures[0].headline()}")
    for rank, result in enumerate(results):
        yours, ddp, local = result["yours"], result["ddp"], result["local"]
        if torch.allclose(yours, ddp, atol=1e-6):
            continue
        if torch.allclose(yours, local, atol=1e-6):
            return Feedback(False, f"Rank {rank} kept its own gradients: call dist.all_reduce(grad) in the hook.")
        if torch.allclose(yours, ddp * world_size, atol=1e-5):
            return Feedback(False, f"Rank {rank} holds the sum over ranks: divide by dist.get_world_size().")
        if torch.allclose(yours, ddp / world_size, atol=1e-6):
            return Feedback(False, f"Rank {rank}'s gradients are world_size times too small: divide once.")
        return Feedback(False, f"Rank {rank}'s gradients differ from DDP's by up to "
                               f"{(yours - ddp).abs().max().item():.3g}; return the averaged gradient.")
    return Feedback(True, f"On all {world_size} ranks your gradients equal DistributedDataParallel's: "
                          "all-reduce (SUM) and divide by world_size is what DDP does, bucket by bucket.")


def fsdp_memory(answer: Any, num_params: int = 28_064, world_size: int = 4, strategy: str = "full_shard") -> Feedback:
    """Notebook 05: bytes of model state per rank for ``num_params`` fp32 parameters trained with Adam
    (4 bytes of weights, 4 of gradients, 8 of Adam's two moments per parameter) under ``strategy``.

    Example: ``fsdp_memory(16 * 28_064)`` says that is DDP's figure, not FULL_SHARD's.
    """
    from dtlib import memory

    fp32_adam = {"param_bytes": 4, "grad_bytes": 4, "optim_bytes_per_param": 8}
    expected = memory.estimate(num_params, world_size, strategy, **fp32_adam)
    if answer is None:
        return Feedback(False, "No answer yet: set `answer` to a number of bytes.")
    if not isinstance(answer, (int, float)) or isinstance(answer, bool):
        return Feedback(False, f"Answer with a number of bytes, not {type(answer).__name__}.")
    if abs(answer - expected) <= 0.01 * expected:
        return Feedback(True, f"Right: {expected:,.0f} bytes per rank; the measured figure above is within 0.1% "
                              "(Adam's step counters are the difference).")
    p, n = num_params, world_size
    known = {
        16 * p: "that is every rank holding everything, as DDP does: FULL_SHARD divides all three by world_size.",
        4 * p / n: "that counts the parameters only: each rank also holds its shard of the gradients and of "
                   "Adam's two moments.",
        8 * p / n: "that misses Adam's state: exp_avg and exp_avg_sq, 8 bytes per parameter in fp32.",
        12 * p / n: "that misses the gradients: 4 bytes per parameter, sharded like the rest.",
        memory.estimate(p, n, "zero2", **fp32_adam): "that is ZeRO-2 (shard_grad_op): parameters whole, the rest "
                                                     "sharded. FULL_SHARD shards the parameters too.",
    }
    for value, hint in known.items():
        if hint and abs(answer - value) <= 0.01 * max(value, 1):
            return Feedback(False, f"{answer:,.0f} bytes: {hint}")
    if abs(answer * 1e9 - expected) <= 0.01 * expected or abs(answer * 2**20 - expected) <= 0.01 * expected:
        return Feedback(False, "Give the answer in bytes, not GB or MiB.")
    return Feedback(False, f"{answer:,.0f} bytes is off by a factor of {answer / expected:.2f}: count 16 bytes "
                           f"per parameter (4 weights + 4 gradients + 8 Adam), then apply {strategy}'s sharding "
                           f"over {world_size} ranks.")


# The checkers below live beside the code they check; these names gather every exercise under dtlib.checks.

def strategy_choice(answer: Any, num_params: float, gpu_memory_gb: float, num_gpus: int, nodes: int = 1) -> Feedback:
    """Notebook 06: the strategy :func:`dtlib.guide.recommend` picks (see :func:`dtlib.guide.check_choice`)."""
    from dtlib.guide import check_choice

    return check_choice(answer, num_params, gpu_memory_gb, num_gpus, nodes)


def torchrun_command(command: Any, **job: Any) -> Feedback:
    """Notebook 07: a node's torchrun line (see :func:`dtlib.torchrun.check_command`)."""
    from dtlib.torchrun import check_command

    return check_command(command, **job)


def fixed_barrier(fn: Callable[[int, int], Any], world_size: int = 2, timeout: float = 5.0) -> Feedback:
    """Notebook 08: every rank must reach the same collectives (see :func:`dtlib.pitfalls.check_fixed_barrier`)."""
    from dtlib.pitfalls import check_fixed_barrier

    return check_fixed_barrier(fn, world_size, timeout)
