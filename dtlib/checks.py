"""Exercise checkers: each says what is right or, precisely, what is wrong.

A checker returns :class:`dtlib.feedback.Feedback`; the notebook shows it as the cell's value.
Checkers never raise on a wrong answer: a wrong answer is the normal case.

Example::

    dtlib.checks.backend_choice("gloo", world_size=2)   # ✓ or ✗ with a hint
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dtlib.counting import count_collectives, rank_without_communication, spawn_counting
from dtlib.errors import WorkerError, WorkerTimeout
from dtlib.feedback import Feedback
from dtlib.launch import resolve_backend, spawn


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


# -- counting the communication a learner's function makes -------------------------------------

def _divisor(got: Any, total: Any) -> int | None:
    """The whole number c with got == total / c, if there is one: the constant a learner divided by."""
    import torch

    got, total = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(total, dtype=torch.float64)
    overlap = float((got * total).sum())
    if not 0 < overlap < float("inf"):
        return None
    whole = round(float((total * total).sum()) / overlap)  # least squares fit of total = c * got
    if whole >= 1 and torch.allclose(got, total / whole, rtol=1e-4, atol=1e-6):
        return whole
    return None


# -- notebooks 01 and 02 ----------------------------------------------------------------------


def sum_of_ranks(fn: Callable[[int, int], Any], world_size: int = 3, timeout: float = 30.0) -> Feedback:
    """Notebook 01: ``fn(rank, world_size)`` must return, on every rank, 0 + 1 + ... + (world_size - 1),
    computed through a collective; it runs with ``world_size`` ranks and with one more.

    Example: ``sum_of_ranks(lambda rank, world_size: rank)`` says the all-reduce is missing.
    """
    if not callable(fn):
        return Feedback(False, f"Pass your function itself, not {type(fn).__name__}.")
    sizes = (world_size, world_size + 1)  # a second size refuses answers written for one world size
    for size in sizes:
        expected = size * (size - 1) // 2
        try:
            results, calls = spawn_counting(fn, size, timeout=timeout)
        except WorkerError as err:
            if any("still running" in failure.message for failure in err.failures):
                return Feedback(False, "Your function hung: does every rank call the same collective? "
                                       f"Details:\n{err}")
            return Feedback(False, f"Your function raised on a rank:\n{err.failures[0].headline()}")
        wrong = {rank: value for rank, value in enumerate(results) if _as_number(value) != expected}
        if wrong:
            rank, value = next(iter(wrong.items()))
            if value is None:
                hint = "it returned None: return the tensor (or its .item()) after the all-reduce."
            elif all(_as_number(v) == r for r, v in enumerate(results)):
                hint = "each rank returned its own rank: was dist.all_reduce called before returning?"
            elif _as_number(value) == expected * size:
                hint = "the sum came out world_size times too big: add each rank's number once, not the total."
            elif size != world_size and _as_number(value) == world_size * (world_size - 1) // 2:
                hint = (f"it returned {_as_number(value)!r}, the answer for {world_size} ranks: let the collective "
                        "add up the ranks that are there instead of writing the answer for one world size.")
            else:
                hint = f"it returned {value!r}."
            return Feedback(False, f"With {size} ranks, rank {rank} should return {expected}, but {hint}")
        silent = rank_without_communication(calls)
        if silent is not None:
            return Feedback(False, f"Rank {silent} returned {expected}, but no collective was called: each rank "
                                   "worked the sum out alone, which no rank can do with numbers only the others "
                                   "hold. Put the rank's own number in a tensor and use dist.all_reduce to add "
                                   "them up.")
    return Feedback(True, f"Every rank returned the sum, with {sizes[0]} ranks and with {sizes[1]}: the all-reduce "
                          "added every rank's number.")


def average_of_ranks(fn: Callable[[int, int], Any], world_size: int = 4, timeout: float = 30.0) -> Feedback:
    """Notebook 02: ``fn(rank, world_size)`` must return, on every rank, the mean over ranks of
    ``dtlib.collectives.starting_values(rank, world_size)`` (older torch's gloo has no ``ReduceOp.AVG``),
    computed through a collective; it runs with ``world_size`` ranks and with one more. A tensor, a
    list, a tuple or a numpy array of the right numbers is right.

    Example: ``average_of_ranks(lambda rank, world_size: None)`` says nothing came back.
    """
    import torch

    from dtlib.collectives import starting_values

    if not callable(fn):
        return Feedback(False, f"Pass your function itself, not {type(fn).__name__}.")
    sizes = (world_size, world_size + 1)  # a second size refuses a hard-coded world size
    for size in sizes:
        start = torch.stack([starting_values(r, size) for r in range(size)]).double()  # (ranks, slots)
        expected, total = start.mean(0), start.sum(0)
        try:
            results, calls = spawn_counting(fn, size, timeout=timeout)
        except WorkerTimeout:
            return Feedback(False, "Your function hung: every rank must call the same collectives in the same "
                                   "order.")
        except WorkerError as err:
            headline = err.failures[0].headline()
            if "AVG" in headline:
                return Feedback(False, "This torch's gloo has no ReduceOp.AVG: sum with ReduceOp.SUM, then divide.")
            return Feedback(False, f"Your function raised on a rank:\n{headline}")
        for rank, value in enumerate(results):
            try:
                got = torch.as_tensor(value, dtype=torch.float64)  # a list, tuple or numpy array is fine too
            except (TypeError, ValueError, RuntimeError):
                got = None
            if got is None or got.shape != expected.shape:
                return Feedback(False, f"Rank {rank} returned {value!r}; return the averaged tensor of "
                                       f"{size} values.")
            if torch.allclose(got, expected):
                continue
            if torch.allclose(got, total):
                return Feedback(False, f"Rank {rank} holds the sum {got.tolist()}: divide by world_size.")
            if torch.allclose(got, start[rank]):
                return Feedback(False, f"Rank {rank} still holds its own values: call dist.all_reduce on them.")
            divisor = _divisor(got, total)
            if divisor is not None:
                return Feedback(False, f"With {size} ranks, rank {rank} holds the sum divided by {divisor}: "
                                       "divide by world_size (dist.get_world_size()), not by a fixed number.")
            return Feedback(False, f"With {size} ranks, rank {rank} returned {got.tolist()}, expected "
                                   f"{expected.tolist()}.")
        silent = rank_without_communication(calls)
        if silent is not None:
            return Feedback(False, f"Rank {silent} holds the mean, but no collective was called: it computed "
                                   "every rank's values itself, which works only because starting_values is a "
                                   "formula; a real rank holds data no other rank has. Use dist.all_reduce on "
                                   "the rank's own values, then divide by world_size.")
    return Feedback(True, f"Every rank holds the mean, with {sizes[0]} ranks and with {sizes[1]}. "
                          "all_reduce(SUM) / world_size works on every backend and torch version; DDP averages "
                          "gradients with the same sum and division, dividing first so that fp16 sums cannot "
                          "overflow (notebook 04).")


def _ring_with_your_phase(rank: int, world_size: int, phase: Callable[..., None], which: str,
                          length: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from dtlib import collectives

    data = torch.arange(length, dtype=torch.float64) * 10.0**rank  # rank r: 10^r x [0, 1, 2, ...]
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
            diagnosis = _ring_diagnosis(reports, which, where)
            if diagnosis:
                return Feedback(False, diagnosis)
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


SAMPLES_PER_RANK = 8  # gradient_hook: each rank's share of the regression data


def _your_hook_against_ddp(rank: int, world_size: int, hook: Callable[[Any], Any]) -> dict[str, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from dtlib import data, models

    x, y = data.regression(SAMPLES_PER_RANK * world_size, seed=1).tensors
    mine = slice(rank * SAMPLES_PER_RANK, (rank + 1) * SAMPLES_PER_RANK)  # each rank its own samples
    yours = models.build("mlp", seed=0)
    for param in yours.parameters():
        param.register_hook(hook)
    _, calls = count_collectives(lambda: models.loss_fn("mlp", yours(x[mine]), y[mine]).backward())
    reference = DistributedDataParallel(models.build("mlp", seed=0))
    models.loss_fn("mlp", reference(x[mine]), y[mine]).backward()
    local = models.build("mlp", seed=0)
    models.loss_fn("mlp", local(x[mine]), y[mine]).backward()
    flat = [torch.cat([p.grad.reshape(-1) for p in m.parameters()]) for m in (yours, reference.module, local)]
    return {"yours": flat[0], "ddp": flat[1], "local": flat[2], "calls": calls}


def _one_process_gradient(world_size: int) -> Any:
    """The oracle: one model in this process, the loss over every rank's samples at once (a mean, so the
    gradient is the mean of the ranks' gradients: what averaging them must give)."""
    import torch

    from dtlib import data, models

    x, y = data.regression(SAMPLES_PER_RANK * world_size, seed=1).tensors
    model = models.build("mlp", seed=0)
    models.loss_fn("mlp", model(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def gradient_hook(hook: Callable[[Any], Any], world_size: int = 2, timeout: float = 60.0) -> Feedback:
    """Notebook 04: ``hook(grad)`` is registered on every parameter (``param.register_hook``) and must
    return the gradient averaged over the ranks, as DDP makes it. It runs with ``world_size`` ranks and
    with one more; the gradients must equal torch's ``DistributedDataParallel``'s and those of one
    process training on all ranks' samples at once.

    Example: ``gradient_hook(lambda grad: grad)`` says the gradients were never all-reduced.
    """
    import torch

    if not callable(hook):
        return Feedback(False, f"Pass your hook function itself, not {type(hook).__name__}.")
    sizes = (world_size, world_size + 1)  # a second size refuses a hard-coded world size
    for size in sizes:
        try:
            results = spawn(_your_hook_against_ddp, size, args=(hook,), timeout=timeout, output="none")
        except WorkerTimeout:
            return Feedback(False, "Your hook hung: every rank must all-reduce every gradient, in the same order.")
        except WorkerError as err:
            raised = [failure for failure in err.failures if failure.exc_type is not None]
            if raised and "gloo" not in raised[0].message:
                return Feedback(False, f"Your hook raised on a rank:\n{raised[0].headline()}")
            return Feedback(False, "A rank died waiting for an all-reduce that another rank never made: every "
                                   "rank must all-reduce every gradient, in the same order.\n"
                                   f"{err.failures[0].headline()}")
        single = _one_process_gradient(size)
        for rank, result in enumerate(results):
            yours, ddp, local = result["yours"], result["ddp"], result["local"]
            if torch.allclose(yours, ddp, atol=1e-6) and torch.allclose(yours, single, atol=1e-6):
                continue
            if torch.allclose(yours, local, atol=1e-6):
                if rank_without_communication([result["calls"]]) is not None:
                    return Feedback(False, f"Rank {rank} kept its own gradients: your hook called no collective. "
                                           "Call dist.all_reduce(grad) in the hook.")
                return Feedback(False, f"Rank {rank} kept its own gradients although your hook called "
                                       f"{', '.join(sorted(result['calls']))}: dist.all_reduce sums in place, into "
                                       "the tensor you pass it, so return that tensor (divided by the world size).")
            divisor = _divisor(yours, single * size)  # the sum over ranks divided by what?
            if divisor == 1:
                return Feedback(False, f"Rank {rank} holds the sum over ranks: divide by dist.get_world_size().")
            if divisor == size * size:
                return Feedback(False, f"Rank {rank}'s gradients are world_size times too small: divide once.")
            if divisor is not None:
                return Feedback(False, f"With {size} ranks, rank {rank}'s gradients are the sum over ranks divided "
                                       f"by {divisor}: divide by dist.get_world_size(), not a constant.")
            return Feedback(False, f"With {size} ranks, rank {rank}'s gradients differ from DDP's by up to "
                                   f"{(yours - ddp).abs().max().item():.3g}; return the averaged gradient.")
    try:
        halves = spawn(_your_hook_in_fp16, 2, args=(hook,), timeout=timeout, output="none")
    except (WorkerError, WorkerTimeout) as err:
        return Feedback(False, f"Your hook works in fp32 but fails on an fp16 gradient:\n{err}")
    if not all(torch.isfinite(half).all() for half in halves):
        return Feedback(False, "Right in fp32, but in fp16 two gradients of 40000 summed make 80000, past fp16's "
                               "largest number (65504), so your average is inf. DDP divides each gradient by the "
                               "world size first, then sums: do the same.")
    return Feedback(True, f"With {sizes[0]} ranks and with {sizes[1]}, your gradients equal DistributedDataParallel's "
                          "and those of one process training on every rank's samples, and fp16 does not overflow: "
                          "divide by world_size, then all-reduce (SUM), is what DDP does, bucket by bucket.")


def _your_hook_in_fp16(rank: int, world_size: int, hook: Callable[[Any], Any]) -> Any:
    """The learner's hook on an fp16 gradient of 40000 on each rank: the average is 40000, the sum overflows."""
    import torch

    return hook(torch.full((4,), 40000.0, dtype=torch.float16)).float()


#: Units an answer in bytes may have been given in by mistake: name, bytes per unit, and how to say it.
BYTE_UNITS = (("KB", 1e3, "10^3"), ("KiB", 2**10, "2^10"), ("MB", 1e6, "10^6"), ("MiB", 2**20, "2^20"),
              ("GB", 1e9, "10^9"), ("GiB", 2**30, "2^30"))


def _show(number: float) -> str:
    """A number as a learner reads it: 112,256 or 0.1123, never a small number rounded to 0."""
    return f"{number:,.0f}" if abs(number) >= 1000 else f"{number:.6g}"


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
        memory.estimate(p, n, "zero2", **fp32_adam): "that is ZeRO-2: parameters whole on every rank, gradients "
                                                     "and Adam's state sharded. FULL_SHARD shards the parameters "
                                                     "too.",
    }
    for value, hint in known.items():
        if abs(answer - value) <= 0.01 * value:
            return Feedback(False, f"{_show(answer)} bytes: {hint}")
    for unit, size, power in BYTE_UNITS:
        in_bytes = answer * size
        if abs(in_bytes - expected) <= 0.01 * expected:
            return Feedback(False, f"{_show(answer)} looks like the answer in {unit} ({power} bytes): that is "
                                   f"{_show(in_bytes)} bytes, the right amount. Give the answer in bytes.")
        for value, hint in known.items():
            if abs(in_bytes - value) <= 0.01 * value:
                return Feedback(False, f"{_show(answer)} looks like {unit} ({power} bytes), that is "
                                       f"{_show(in_bytes)} bytes; give the answer in bytes. And {hint}")
    return Feedback(False, f"{_show(answer)} bytes is off by a factor of {answer / expected:.3g}: count 16 bytes "
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


def _your_wrap_against_ddp(rank: int, world_size: int, wrap: Callable[[Any], Any], steps: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    from dtlib import data, memory, models

    model = models.build("transformer", seed=0)
    try:
        returned = wrap(model)
        error = None
    except Exception as exc:  # noqa: BLE001 - reported to the learner, with what was sharded before it
        returned, error = None, f"{type(exc).__name__}: {exc}"
    report: dict[str, Any] = {"root": isinstance(model, FSDPModule), "error": error,
                              "blocks": [isinstance(block, FSDPModule) for block in model.blocks],
                              "returned_other": returned is not None and returned is not model}
    if error or report["returned_other"]:
        return report
    peak = [0]  # parameter bytes this rank holds while a layer runs its forward

    def record(module: Any, inputs: Any, output: Any) -> None:
        peak[0] = max(peak[0], memory.measured(model)["parameters"])

    for module in model.modules():
        if next(module.parameters(recurse=False), None) is not None:
            module.register_forward_hook(record)
    reference = DistributedDataParallel(models.build("transformer", seed=0))
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, reference)]
    batches = data.batches(data.tokens(64), world_size, rank, batch_size=4)
    losses: dict[str, list[float]] = {"yours": [], "ddp": []}
    for _ in range(steps):
        x, y = next(batches)  # (B, T)
        for name, net, optimizer in zip(("yours", "ddp"), (model, reference), optimizers, strict=True):
            loss = F.cross_entropy(net(x).flatten(0, 1), y.flatten())
            loss.backward()
            optimizer.step()
            if name == "yours":
                report["at_rest"] = sum(memory.measured(model, optimizer).values())
            optimizer.zero_grad()
            losses[name].append(loss.item())
    return {**report, "peak_parameters": peak[0], **losses}


def fsdp_wrap(wrap: Callable[[Any], Any], world_size: int = 2, steps: int = 3, timeout: float = 60.0) -> Feedback:
    """Notebook 05: ``wrap(model)`` shards ``dtlib.models.build("transformer")`` with ``fully_shard``;
    every block must be a unit of its own and the root sharded last.

    Each rank measures the parameter bytes it holds while forward runs and its model state after a
    step, and trains ``steps`` steps beside ``DistributedDataParallel`` on the same samples.
    Example: ``fsdp_wrap(lambda model: fully_shard(model))`` says the whole model is gathered at once.
    """
    from dtlib import models

    if not callable(wrap):
        return Feedback(False, f"Pass your function itself, not {type(wrap).__name__}.")
    num_params = sum(p.numel() for p in models.build("transformer").parameters())
    full_bytes, at_rest_formula = 4 * num_params, 16 * num_params / world_size  # fp32 weights; fp32 Adam
    try:
        reports = spawn(_your_wrap_against_ddp, world_size, args=(wrap, steps), timeout=timeout, output="none")
    except WorkerTimeout:
        return Feedback(False, "Your wrap hung: every rank must shard the same modules in the same order.")
    except WorkerError as err:
        return Feedback(False, f"Training your sharded model failed on a rank:\n{err.failures[0].headline()}")
    report = reports[0]
    blocks = sum(report["blocks"])
    if report["error"]:
        if report["root"] and blocks < len(report["blocks"]):
            return Feedback(False, "fully_shard(model) came before the blocks: the root's call already took every "
                                   "parameter, blocks included, so a block cannot become a unit afterwards "
                                   f"({report['error'][:120]}). Shard each block first, the root last.")
        return Feedback(False, f"Your wrap raised on rank 0: {report['error'][:300]}")
    if report["returned_other"]:
        return Feedback(False, "Return the model you were given: fully_shard changes it in place (and returns it).")
    if not report["root"] and not blocks:
        return Feedback(False, "Nothing was sharded: every rank still holds the whole model. Call fully_shard on "
                               "each block, then on the model.")
    if not report["root"]:
        gap = max(abs(a - b) for a, b in zip(report["yours"], report["ddp"], strict=True))
        return Feedback(False, "The blocks are units but the root is not: the embedding, positions, final norm and "
                               "head stay whole on every rank, and their gradients are never averaged over ranks "
                               f"(your losses drift from DDP's by up to {gap:.2g}). Call fully_shard(model) last.")
    if blocks < len(report["blocks"]):
        return Feedback(False, f"Only {'the root is a unit' if not blocks else 'some blocks are units'}: forward "
                               f"gathers {report['peak_parameters']:,} bytes of parameters at once on each rank "
                               f"(the whole model is {full_bytes:,}), so sharding saves nothing at the peak. "
                               "Call fully_shard(block) for every block before the root.")
    gap = max(abs(a - b) for a, b in zip(report["yours"], report["ddp"], strict=True))
    if gap > 1e-5:
        return Feedback(False, f"Every unit is in place, but your losses differ from DDP's by up to {gap:.2g}: "
                               "shard the model as it is, with fully_shard's defaults.")
    kept = (" Forward kept every unit gathered (reshard_after_forward=False): ZeRO-2's peak, for one all-gather "
            "less per block." if report["peak_parameters"] >= full_bytes else "")
    return Feedback(True, f"Each block is a unit and the root comes last. A rank holds {report['at_rest']:,} bytes "
                          f"of model state after a step (16P/N = {at_rest_formula:,.0f}) and at most "
                          f"{report['peak_parameters']:,} bytes of parameters during forward (the whole model: "
                          f"{full_bytes:,}); the losses equal DDP's.{kept}")
