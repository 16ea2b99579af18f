"""Checkers that train: the learner's gradient hook (notebook 04) and FSDP wrap (notebook 05).

Each runs the learner's code on every rank beside torch's ``DistributedDataParallel`` on the same
samples, and refuses what differs from it: gradients not averaged, averaged by a constant, or
overflowing in fp16; a wrap whose units do not save memory, or whose losses drift from DDP's.

Example: ``dtlib.checks.gradient_hook(lambda grad: grad)`` says the gradients were never all-reduced.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import random
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from dtlib.arguments import count
from dtlib.checks._numbers import constant_divisor
from dtlib.checks.feedback import Feedback
from dtlib.checks.skeleton import ON_GLOO, Answer, RankExercise, judge
from dtlib.errors import WorkerError, WorkerTimeout
from dtlib.launch import host_tensors, nccl_order
from dtlib.launch.device import device_ids, rank_device
from dtlib.launch.spawn import spawn
from dtlib.measure import memory
from dtlib.measure.counting import CALL_NAMES, count_collectives, rank_without_communication, watching
from dtlib.train import data, models

SAMPLES_PER_RANK = 8  # gradient_hook: each rank's share of the regression data
LOW_PRECISION = {"torch.float16": "float16", "torch.bfloat16": "bfloat16"}  # dtype -> its name in a message


def _watched(hook: Callable[[Any], Any], report: dict[str, Any]) -> Callable[[Any], Any]:
    """``hook``, noting in ``report`` whether it changed the gradient it was given (torch's contract for
    ``Tensor.register_hook``: "The hook should not modify its argument"), what wrote into it, and the dtypes
    of the tensors its collectives moved."""
    @functools.wraps(hook)  # torch names a hook in its errors: the learner's name, not this wrapper's
    def watched(grad: Any) -> Any:
        before = grad.detach().clone()
        storage = grad.untyped_storage().data_ptr()

        def shares(value: Any) -> bool:
            return isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() == storage

        def see(namespace: str, name: str, args: tuple) -> None:
            if namespace == "c10d" and name in CALL_NAMES and args:
                first = args[0] if isinstance(args[0], list | tuple) else [args[0]]
                tensors = [t for item in first for t in (item if isinstance(item, list | tuple) else [item])
                           if isinstance(t, torch.Tensor)]
                report["dtypes"].update(str(t.dtype) for t in tensors)
                for tensor in tensors:  # float32 numbers that all fit a half precision were rounded to it first
                    low = next((low for low in (torch.bfloat16, torch.float16) if tensor.dtype == torch.float32
                                and tensor.numel() > 8 and torch.equal(tensor.to(low).float(), tensor)), None)
                    if low is not None:
                        report["dtypes"].add(f"rounded to {low}")
                if any(shares(t) for t in tensors):
                    report["writers"].add(f"dist.{CALL_NAMES[name]}")
            elif namespace == "aten" and name.endswith("_") and args and shares(args[0]):
                report["writers"].add(name)  # div_, mul_, add_, ... (fill_ and copy_: strict mode's async)

        with watching(see), host_tensors.resumed():  # autograd calls a hook without the answer's modes
            returned = hook(grad)
        if not torch.equal(before, grad.detach()):
            report["in_place"] = True
        return returned

    return watched


def _own_samples(world_size: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's own samples, (x, y), drawn in the checker's process from ``seed``: each rank is sent its own
    alone, so no frame a hook can reach in a rank holds another rank's samples or the seed that draws them."""
    x, y = data.regression(SAMPLES_PER_RANK * world_size, seed=seed).tensors
    return [(x[start:start + SAMPLES_PER_RANK].clone(), y[start:start + SAMPLES_PER_RANK].clone())
            for start in range(0, SAMPLES_PER_RANK * world_size, SAMPLES_PER_RANK)]


def _your_hook_against_ddp(hook: Callable[[Any], Any], rank: int, world_size: int,
                           given: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    device = rank_device()  # cuda:LOCAL_RANK under NCCL, else the CPU: every tensor and model goes there
    x, y = (t.to(device) for t in given)  # this rank's own samples (_own_samples)
    del given
    yours = models.build("mlp", seed=0).to(device)
    report: dict[str, Any] = {"in_place": False, "writers": set(), "dtypes": set()}
    for param in yours.parameters():
        param.register_hook(_watched(hook, report))
    _, calls = count_collectives(lambda: models.loss_fn("mlp", yours(x), y).backward())
    reference = DistributedDataParallel(models.build("mlp", seed=0).to(device),
                                        device_ids=device_ids(device))
    models.loss_fn("mlp", reference(x), y).backward()
    local = models.build("mlp", seed=0).to(device)
    models.loss_fn("mlp", local(x), y).backward()
    flat = [torch.cat([p.grad.reshape(-1) for p in m.parameters()]).cpu() for m in (yours, reference.module, local)]
    return {"yours": flat[0], "ddp": flat[1], "local": flat[2], "calls": calls, **report}


def _one_process_gradient(world_size: int, seed: int = 1) -> Any:
    """The oracle: one model in this process, the loss over every rank's samples at once (a mean, so the
    gradient is the mean of the ranks' gradients: what averaging them must give). ``seed`` draws the samples."""
    x, y = data.regression(SAMPLES_PER_RANK * world_size, seed=seed).tensors
    model = models.build("mlp", seed=0)
    models.loss_fn("mlp", model(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _called(calls: dict[str, int]) -> str:
    return ", ".join(sorted(calls)) or "no collective"


def _one_ranks_gradient(a: Answer) -> tuple[int, int] | None:
    """(k, c) where every rank holds rank k's own gradient divided by c: one rank's gradient handed to all."""
    for source in range(a.size):
        divisor = constant_divisor(a.values[0]["yours"], a.values[source]["local"])
        if divisor is not None and all(constant_divisor(r["yours"], a.values[source]["local"]) == divisor
                                       for r in a.values):
            return source, divisor
    return None


def _rounded(yours: Any, exact: Any, dtypes: set[str], scale: float = 0.0) -> str | None:
    """How a gradient that is the mean to a few digits, not to fp32's, was rounded; None if it is not so.
    ``scale`` is the largest number a rank summed: a sum of rounded numbers that cancel is off by a share of
    them, not of the sum."""
    if not torch.allclose(yours, exact, rtol=1e-2, atol=max(1e-4, 1e-2 * scale)):
        return None
    off = f"up to {(yours - exact).abs().max().item():.2g} off the exact mean"
    for dtype, name in LOW_PRECISION.items():
        digits = 3 if name == "float16" else 2
        if dtype in dtypes:
            return (f"your hook all-reduced the gradient as {name}, so your average went through {name} and was "
                    f"rounded ({off}; {name} keeps about {digits} significant digits)")
        if f"rounded to {dtype}" in dtypes:
            return (f"your hook rounded the gradient to {name} before all-reducing it, so your average went through "
                    f"{name} and was rounded ({off}; {name} keeps about {digits} significant digits)")
    for low in (torch.bfloat16, torch.float16):  # the narrower first: a bfloat16 number fits float16 too
        if torch.equal(yours.to(low).float(), yours):
            name = str(low).removeprefix("torch.")
            return f"your average went through {name} and was rounded ({off}: every number is a {name} one)"
    return f"your average was rounded on the way ({off}): part of it went through a lower precision than float32"


def _one_ranks_said(a: Answer) -> str:
    source, divisor = _one_ranks_gradient(a) or (0, 1)
    divided = f", divided by {divisor}" if divisor != 1 else ""
    calls = a.calls[a.rank]
    did = (f"your hook broadcast rank {source}'s gradient to every rank{divided}" if calls.get("broadcast")
           else f"every rank holds rank {source}'s gradient{divided} (your hook called {_called(calls)})")
    return (f"With {a.size} ranks, {did}: that is one rank's gradient, not the mean of all ranks'. dist.all_reduce "
            "(SUM) adds every rank's gradient into each rank's tensor; divide by dist.get_world_size().")


def _largest(a: Answer) -> bool:
    return torch.allclose(a.value["yours"], torch.stack([r["local"] for r in a.values]).max(0).values, atol=1e-6)


def _kept_own_said(a: Answer) -> str:
    own, calls = constant_divisor(a.value["yours"], a.value["local"]), a.calls[a.rank]
    divided = f", divided by {own}," if own != 1 else ""
    if rank_without_communication([calls]) is not None:
        moved = f"your hook's {_called(calls)} moves no data" if calls else "your hook called no collective"
        return (f"Rank {a.rank} kept its own gradients{divided.rstrip(',')}: {moved}. Call dist.all_reduce(grad) in "
                "the hook.")
    return (f"Rank {a.rank} kept its own gradients{divided} although your hook called {_called(calls)}: the sum went "
            "into another tensor than the one your hook returned. dist.all_reduce writes the sum in place, into the "
            "tensor you pass it: return that tensor (divided by the world size).")


def _sum_divisor(a: Answer) -> int | None:
    return constant_divisor(a.value["yours"], a.expected * a.size)  # the sum over ranks divided by what?


def _summed_scale(a: Answer) -> float:
    """The largest magnitude among the ranks' own gradients, divided by the ranks: what the sum adds up."""
    return max(float(r["local"].abs().max()) for r in a.values) / a.size


def _rounded_said(a: Answer) -> str:
    return (f"With {a.size} ranks, {_rounded(a.value['yours'], a.expected, a.value['dtypes'], _summed_scale(a))}. "
            "DDP's average is exact in the gradient's dtype: all-reduce the float32 gradient itself (casting to half "
            "precision is gradient compression, like torch's fp16_compress_hook, not DDP's average).")


#: What each kind of wrong average did, in the learner's terms: the first that holds explains.
HOOK_HINTS: list[tuple[Callable[[Answer], bool], Callable[[Answer], str]]] = [
    (lambda a: a.called("reduce") and not a.called("all_reduce"), lambda a: (
        f"Rank {a.rank}'s gradients were not averaged: dist.reduce leaves the sum on one rank only (dst), and the "
        "others' tensors are undefined (NCCL promises them nothing; the checker fills them with NaN). Use "
        "dist.all_reduce.")),
    (lambda a: bool(a.value["yours"].isnan().any()) and bool(a.calls[a.rank]), lambda a: (
        f"Rank {a.rank}'s gradients hold NaN: your hook used a tensor that its {_called(a.calls[a.rank])} had not "
        "finished writing. With async_op=True, call .wait() on the work it returns before dividing or returning "
        "the tensor: NCCL writes it later, on its own stream (the checker marks such numbers NaN until wait()).")),
    (lambda a: bool(a.value["yours"].isnan().any()), lambda a: (
        f"Rank {a.rank}'s gradients hold NaN: return the gradient averaged over the ranks.")),
    (lambda a: _one_ranks_gradient(a) is not None, _one_ranks_said),
    (_largest, lambda a: (f"Rank {a.rank} holds the largest gradient of the ranks, not their mean: ReduceOp.MAX "
                          "keeps the largest; sum with ReduceOp.SUM and divide.")),
    (lambda a: constant_divisor(a.value["yours"], a.value["local"]) is not None, _kept_own_said),
    (lambda a: _sum_divisor(a) == 1, lambda a: f"Rank {a.rank} holds the sum over ranks: divide by "
                                                "dist.get_world_size()."),
    (lambda a: _sum_divisor(a) == a.size * a.size,
     lambda a: f"Rank {a.rank}'s gradients are world_size times too small: divide once."),
    (lambda a: _sum_divisor(a) is not None, lambda a: (
        f"With {a.size} ranks, rank {a.rank}'s gradients are the sum over ranks divided by {_sum_divisor(a)}: divide "
        "by dist.get_world_size(), not a constant.")),
    (lambda a: _rounded(a.value["yours"], a.expected, a.value["dtypes"], _summed_scale(a)) is not None,
     _rounded_said),
]


def _in_place(values: Sequence[dict[str, Any]], size: int) -> str | None:
    """What to say to a hook that wrote into its argument (None: no rank's did)."""
    result = next((result for result in values if result["in_place"]), None)
    if result is None:
        return None
    writers = set(result["writers"])
    if writers & {"fill_", "copy_"} and result["calls"]:  # strict mode's async collective writes on wait()
        writers -= {"fill_", "copy_"}
        writers |= {f"an async dist.{name}" for name in result["calls"]}
    by = (f" ({' and '.join(sorted(w if w.startswith(('dist.', 'an ')) else f'grad.{w}()' for w in writers))} "
          "wrote into it)" if writers else "")
    return ("Right values, but your hook changed the gradient it was given in place" + by + ". torch's "
            "Tensor.register_hook says: \"The hook should not modify its argument, but it can optionally return "
            "a new gradient\": autograd may share that tensor with other parts of the backward pass (an addition "
            "hands one gradient to both its inputs), and they would see your average. Work on a new tensor: "
            "grad = grad / dist.get_world_size(), then dist.all_reduce(grad), and return it.")


#: torch's legacy tensor type names, as its hook errors print them, and the dtypes they are.
_TENSOR_TYPES = {"FloatTensor": "float32", "HalfTensor": "float16", "BFloat16Tensor": "bfloat16",
                 "DoubleTensor": "float64"}


def _hook_failed(err: WorkerError) -> str:
    cause = err.cause()
    if cause.exc_type is None:  # it exited or was killed, without raising: the others only lost it
        return (f"A rank stopped inside your hook without raising ({cause.headline()}): every rank must run the "
                "whole backward pass, all-reducing every gradient, and return a gradient from the hook.")
    changed = re.search(r"has changed the type of value \(was torch\.(\w+) got torch\.(\w+)\)", cause.message)
    if changed:
        was, got = (_TENSOR_TYPES.get(name, name) for name in changed.groups())
        return (f"Your hook returned a {got} gradient for a {was} parameter, and torch refuses a hook that changes "
                f"the gradient's dtype. Communicate in {got} if you like, but return the gradient in {was}: "
                f"grad.copy_(...) or .to(grad.dtype) before returning.")
    if "gloo" not in cause.message:
        return f"Your hook raised on a rank:\n{cause.headline()}"
    return ("A rank died waiting for an all-reduce that another rank never made: every rank must all-reduce every "
            f"gradient, in the same order.\n{cause.headline()}")


def _close_to_ddp(result: dict[str, Any], single: Any) -> bool:
    yours = result["yours"]
    return torch.allclose(yours, result["ddp"], atol=1e-6) and torch.allclose(yours, single, atol=1e-6)


GRADIENT_HOOK = RankExercise(
    expected=_one_process_gradient,
    read=lambda result: result,
    same=_close_to_ddp,
    hints=HOOK_HINTS,
    otherwise=lambda a: (
        f"With {a.size} ranks, rank {a.rank}'s gradients differ from DDP's by up to "
        f"{(a.value['yours'] - a.value['ddp']).abs().max().item():.3g}: return the gradient divided by the world "
        "size and all-reduced with SUM."),
    no_collective=lambda rank, expected, calls: (
        f"Right gradients, but rank {rank}'s hook "
        f"{f'called {_called(calls)}, which moves no data' if calls else 'called no collective'}: the mean came "
        "from somewhere other than the other ranks (the samples or the model rebuilt inside the hook?). A "
        "communication hook averages what the ranks computed: dist.all_reduce the gradient across them."),
    right=lambda first, second, values: (
        f"With {first} ranks and with {second}, your gradients equal DistributedDataParallel's and those of one "
        "process training on every rank's samples"),
    hang=lambda err, name: "Your hook hung: every rank must all-reduce every gradient, in the same order.",
    failure=_hook_failed,
    calls_in=lambda result: result["calls"],  # the hook's own: DDP's reference all-reduces are not the answer's
    also=_in_place,
)


def gradient_hook(hook: Callable[[Any], Any], world_size: int = 2, timeout: float = 60.0) -> Feedback:
    """Notebook 04: ``hook(grad)`` is registered on every parameter (``param.register_hook``) and must
    return the gradient averaged over the ranks, as DDP makes it, without changing its argument (torch's
    contract for tensor hooks). It runs with ``world_size`` ranks and with one more; the gradients must equal
    torch's ``DistributedDataParallel``'s and those of one process training on all ranks' samples at once.
    Then it runs on an fp16 gradient whose sum over ranks overflows.

    Example: ``gradient_hook(lambda grad: grad)`` says the gradients were never all-reduced.
    """
    if not callable(hook):
        return Feedback(False, f"Pass your hook function itself, not {type(hook).__name__}.")
    seed = random.randrange(2**31)  # new samples on each call: a hook cannot know the gradient it will get
    exercise = dataclasses.replace(GRADIENT_HOOK, expected=lambda inputs: _one_process_gradient(len(inputs), seed),
                                   inputs=lambda size, generator: _own_samples(size, seed))
    verdict = judge(functools.partial(_your_hook_against_ddp, hook), exercise, world_size, timeout)
    if not verdict.ok:
        return verdict
    equal = verdict.message
    try:
        halves = spawn(_your_hook_in_fp16, 2, args=(hook,), timeout=timeout, output="none", **ON_GLOO)
    except (WorkerError, WorkerTimeout) as err:
        return Feedback(False, f"Your hook works in fp32 but fails on an fp16 gradient:\n{err.cause().headline()}")
    if not all(torch.isfinite(half["grad"]).all() for half in halves):
        # GPU run must confirm: NCCL runs a floating-point AVG as a pre-multiplied sum (each input times 1/N)
        if all(half["avg"] for half in halves):  # gloo sums, then divides; NCCL's AVG never holds the sum
            return Feedback(True, f"{equal}. ReduceOp.AVG averages as NCCL runs it, dividing as it sums, so fp16 does "
                                  "not overflow there; gloo sums first (80000 is past fp16's 65504), which is why DDP "
                                  "divides each gradient by the world size before a SUM: that works on every backend.")
        return Feedback(False, "Right in fp32, but in fp16 two gradients of 40000 summed make 80000, past fp16's "
                               "largest number (65504), so your average is inf. DDP divides each gradient by the "
                               "world size first, then sums: do the same.")
    summed = all(half["summed"] for half in halves)
    return Feedback(True, f"{equal}, and fp16 does not overflow" + (
        ": divide by world_size, then all-reduce (SUM), is what DDP does, bucket by bucket." if summed else
        f". Your hook called {', '.join(halves[0]['calls']) or 'no collective'}; DDP itself divides by world_size, "
        "then all-reduces (SUM), bucket by bucket: one collective, which on NCCL sends the least."))


def _your_hook_in_fp16(rank: int, world_size: int, hook: Callable[[Any], Any]) -> Any:
    """The learner's hook on an fp16 gradient of 40000 on each rank: the average is 40000, the sum overflows."""
    grad = torch.full((4,), 40000.0, dtype=torch.float16, device=rank_device())
    functional_avg = []  # a functional collective's op is a string argument ("avg"), seen as dispatched

    def see(namespace: str, name: str, args: tuple) -> None:
        if namespace == "_c10d_functional" and name.startswith("all_reduce") and len(args) > 1:
            functional_avg.append(str(args[1]).lower() == "avg")

    with nccl_order.recording() as posted, watching(see):  # which op the hook asks for: NCCL's AVG divides as it sums
        returned = hook(grad)
    if returned is None:
        returned = grad  # as autograd does: None means the hook changed the gradient in place, or not at all
    if not isinstance(returned, torch.Tensor):
        raise TypeError(f"your hook returned a {type(returned).__name__}: return the gradient tensor (or None "
                        "after changing it in place)")
    ops = [op for launch in posted for op in launch]
    return {"grad": returned.float().cpu(),
            "avg": any(op.reduce_op == "AVG" for op in ops) or any(functional_avg),
            "summed": any(op.reduce_op == "SUM" for op in ops) or bool(functional_avg),
            "calls": sorted({op.call for op in ops})}


WRAP_MESH_DIMS = ("shard",)  # fsdp_wrap's mesh is named, so that a default mesh is never taken for it
WRAP_BATCH = 4  # fsdp_wrap: sequences per rank per step


def _own_batches(steps: int, world_size: int, generator: torch.Generator) -> list[list[tuple[torch.Tensor, ...]]]:
    """Every rank's own batches for ``steps`` steps, as ``DistributedSampler`` deals them, from token sequences
    drawn anew on each call in the checker's process: each rank is sent its own alone, so nothing a wrap, a hook
    or a module's forward can reach in a rank holds another rank's samples."""
    seed = int(torch.randint(2**31, (1,), generator=generator))
    dataset = data.tokens(WRAP_BATCH * steps * world_size, seed=seed)
    return [[(x.clone(), y.clone()) for x, y in itertools.islice(data.batches(dataset, world_size, rank,
                                                                                batch_size=WRAP_BATCH), steps)]
            for rank in range(world_size)]


def _your_wrap_against_ddp(wrap: Callable[[Any, Any], Any], rank: int, world_size: int,
                           given: list[tuple[torch.Tensor, ...]]) -> dict[str, Any]:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    device = rank_device()
    batches = [tuple(t.to(device) for t in batch) for batch in given]  # this rank's own (_own_batches)
    del given
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=WRAP_MESH_DIMS)
    model = models.build("transformer", seed=0).to(device)
    calls: dict[str, int] = {}  # the collectives of your wrap and your model's steps (DDP's are not counted)

    def counted(fn: Callable[..., Any], *args: Any) -> Any:
        value, made = count_collectives(fn, *args)
        for call, times in made.items():
            calls[call] = calls.get(call, 0) + times
        return value

    try:
        returned = counted(wrap, model, mesh)
        error = None
    except Exception as exc:  # noqa: BLE001 - reported to the learner, with what was sharded before it
        returned, error = None, f"{type(exc).__name__}: {exc}"

    def unit(module: Any) -> int | None:  # which FSDP unit a module is (modules sharded together share one)
        return id(module._get_fsdp_state()) if isinstance(module, FSDPModule) else None

    report: dict[str, Any] = {"root": isinstance(model, FSDPModule), "error": error, "calls": calls,
                              "blocks": [isinstance(block, FSDPModule) for block in model.blocks],
                              "block_units": len({unit(block) for block in model.blocks} - {None}),
                              "finer": any(isinstance(inner, FSDPModule) for block in model.blocks
                                           for inner in block.modules() if inner is not block),
                              "returned_other": returned is not None and returned is not model,
                              "other_mesh": sorted({str(p.device_mesh) for p in model.parameters()
                                                    if isinstance(p, DTensor) and p.device_mesh != mesh}),
                              "mesh": str(mesh), "full_bytes": 4 * sum(p.numel() for p in model.parameters())}
    if error or report["returned_other"] or report["other_mesh"]:
        return report
    peak = [0]  # parameter bytes this rank holds while a layer runs its forward
    computed_in: set[str] = set()  # the dtypes the layers computed in (a MixedPrecisionPolicy casts them)

    def record(module: Any, inputs: Any, output: Any) -> None:
        peak[0] = max(peak[0], memory.measured(model)["parameters"])
        computed_in.update(str(p.dtype).removeprefix("torch.") for p in module.parameters(recurse=False))

    for module in model.modules():
        if next(module.parameters(recurse=False), None) is not None:
            module.register_forward_hook(record)
    reference = DistributedDataParallel(models.build("transformer", seed=0).to(device),
                                        device_ids=device_ids(device))
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, reference)]
    losses: dict[str, list[float]] = {"yours": [], "ddp": []}

    def step(net: Any, optimizer: Any, x: Any, y: Any) -> float:
        loss = F.cross_entropy(net(x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        return loss.item()

    for x, y in batches:  # (B, T) each
        losses["yours"].append(counted(step, model, optimizers[0], x, y))
        report["at_rest"] = sum(memory.measured(model, optimizers[0]).values())
        losses["ddp"].append(step(reference, optimizers[1], x, y))
        for optimizer in optimizers:
            optimizer.zero_grad()
    return {**report, "peak_parameters": peak[0], "computed_in": sorted(computed_in), **losses}


def _gap(report: dict[str, Any]) -> float:
    """How far the learner's losses drifted from DDP's, at most."""
    return max(abs(a - b) for a, b in zip(report["yours"], report["ddp"], strict=True))


def _units(report: dict[str, Any]) -> int:
    return sum(report["blocks"])


def _wrapped_right(report: dict[str, Any], expected: Any) -> bool:
    """Every block a unit of its own and nothing inside it, the root sharded last, over the mesh given, computing
    in float32 and training as DDP does."""
    return (not report["error"] and not report["returned_other"] and not report["other_mesh"] and report["root"]
            and _units(report) == len(report["blocks"]) == report["block_units"] and not report["finer"]
            and set(report["computed_in"]) <= {"float32"} and _gap(report) <= 1e-5)


def _gathered(report: dict[str, Any]) -> str:
    return (f"forward holds {report['peak_parameters']:,} bytes of parameters at once (the whole model is "
            f"{report['full_bytes']:,})")


_INSIDE = ", inside blocks that are units too"
#: What each kind of wrong wrap did, read from how it left the model: the first that holds explains.
WRAP_HINTS: list[tuple[Callable[[Answer], bool], Callable[[Answer], str]]] = [
    (lambda a: bool(a.value["error"]) and a.value["root"] and _units(a.value) < len(a.value["blocks"]), lambda a: (
        "fully_shard(model) came before the blocks: the root's call already took every parameter, blocks included, "
        f"so a block cannot become a unit afterwards ({a.value['error'][:120]}). Shard each block first, the root "
        "last.")),
    (lambda a: bool(a.value["error"]), lambda a: f"Your wrap raised on rank {a.rank}: {a.value['error'][:300]}"),
    (lambda a: a.value["returned_other"],
     lambda a: "Return the model you were given: fully_shard changes it in place (and returns it)."),
    (lambda a: bool(a.value["other_mesh"]), lambda a: (
        f"Some parameters are sharded over {a.value['other_mesh'][0]}, not over the mesh you were given "
        f"({a.value['mesh']}): pass mesh=mesh to every fully_shard. Without it, fully_shard builds a mesh on the "
        "machine's accelerator, whatever device the ranks compute on (cuda:0 for every rank of a one-GPU machine "
        "running gloo).")),
    (lambda a: not a.value["root"] and not _units(a.value), lambda a: (
        "Nothing was sharded: every rank still holds the whole model. Call fully_shard on each block, then on the "
        "model.")),
    (lambda a: not a.value["root"], lambda a: (
        "The blocks are units but the root is not: the embedding, positions, final norm and head stay whole on "
        "every rank, and their gradients are never averaged over ranks (your losses drift from DDP's by up to "
        f"{_gap(a.value):.2g}). Call fully_shard(model) last.")),
    (lambda a: a.value["finer"], lambda a: (
        f"Your units are smaller than a block (a unit per layer, say{_INSIDE if _units(a.value) else ''}): "
        f"{_gathered(a.value)}, less than a unit per block would, for more and smaller all-gathers, each paying its "
        "own latency. That works; the exercise asks for the usual balance: fully_shard(block) for every block and "
        "nothing inside it, then the root.")),
    (lambda a: _units(a.value) == len(a.value["blocks"]) and a.value["block_units"] < _units(a.value), lambda a: (
        f"Your {_units(a.value)} blocks are {a.value['block_units']} unit{'s' if a.value['block_units'] > 1 else ''}: "
        f"fully_shard given a list groups its modules into one unit, gathered and freed together, so "
        f"{_gathered(a.value)}. Call fully_shard(block) once per block, then on the root.")),
    (lambda a: _units(a.value) < len(a.value["blocks"]), lambda a: (
        f"Only {'the root is a unit' if not _units(a.value) else 'some blocks are units'}: forward gathers "
        f"{a.value['peak_parameters']:,} bytes of parameters at once on each rank (the whole model is "
        f"{a.value['full_bytes']:,}), so sharding saves nothing at the peak. Call fully_shard(block) for every "
        "block before the root.")),
    (lambda a: bool(set(a.value["computed_in"]) - {"float32"}), lambda a: (
        f"Every unit is in place, but your layers computed in {', '.join(a.value['computed_in'])}: a "
        "MixedPrecisionPolicy casts the gathered parameters, so your losses drift from DDP's float32 ones by up to "
        f"{_gap(a.value):.2g}. Mixed precision is a choice of its own (section 6); the exercise asks for "
        "fully_shard's defaults.")),
]


def _wrap_right(first: int, second: int, values: Sequence[dict[str, Any]]) -> str:
    report = values[0]
    at_rest_formula = memory.estimate(report["full_bytes"] // 4, first, "zero3", **memory.FP32_ADAM)  # 16P/N
    kept = (" Forward kept every unit gathered (reshard_after_forward=False): ZeRO-2's peak, for one all-gather "
            "less per block." if report["peak_parameters"] >= report["full_bytes"] else "")
    return (f"Each block is a unit and the root comes last, with {first} ranks and with {second}. With {first}, a "
            f"rank holds {report['at_rest']:,} bytes of model state after a step (16P/N = {at_rest_formula:,.0f}) "
            f"and at most {report['peak_parameters']:,} bytes of parameters during forward (the whole model: "
            f"{report['full_bytes']:,}); the losses equal DDP's.{kept}")


FSDP_WRAP = RankExercise(
    expected=lambda size: None,  # no value: the report says how the model was sharded, and DDP's losses are beside
    read=lambda report: report,
    same=_wrapped_right,
    hints=WRAP_HINTS,
    otherwise=lambda a: (f"Every unit is in place, but your losses differ from DDP's by up to {_gap(a.value):.2g}: "
                         "shard the model as it is, with fully_shard's defaults."),
    no_collective=lambda rank, expected, calls: (
        f"Rank {rank}'s sharded model trained without communicating: FSDP all-gathers each unit's parameters and "
        "reduce-scatters its gradients. Shard with fully_shard over the mesh given."),
    right=_wrap_right,
    hang=lambda err, name: "Your wrap hung: every rank must shard the same modules in the same order.",
    failure=lambda err: f"Training your sharded model failed on a rank:\n{err.cause().headline()}",
    calls_in=lambda report: report["calls"],
)


def fsdp_wrap(wrap: Callable[[Any, Any], Any], world_size: int = 2, steps: int = 3, timeout: float = 60.0) -> Feedback:
    """Notebook 05: ``wrap(model, mesh)`` shards ``dtlib.train.models.build("transformer")`` with ``fully_shard``
    over ``mesh`` (the ranks, on the device they compute on); every block must be a unit of its own and the
    root sharded last. It runs with ``world_size`` ranks and with one more.

    Each rank measures the parameter bytes it holds while forward runs and its model state after a
    step, and trains ``steps`` steps beside ``DistributedDataParallel`` on the same samples: its own batches,
    drawn anew on each call in the checker's process and sent to it alone.
    Example: ``fsdp_wrap(lambda model, mesh: fully_shard(model, mesh=mesh))`` says the whole model is gathered
    at once.
    """
    if not callable(wrap):
        return Feedback(False, f"Pass your function itself, not {type(wrap).__name__}.")
    try:
        inspect.signature(wrap).bind(None, None)
    except TypeError:
        return Feedback(False, "Write your function as my_wrap(model, mesh): the check passes each rank's mesh, and "
                               "every fully_shard takes it as mesh=mesh.")
    except ValueError:  # no signature to read (a builtin): let the call say
        pass
    steps = count("steps", steps, minimum=1)
    exercise = dataclasses.replace(FSDP_WRAP, expected=lambda inputs: None,
                                   inputs=functools.partial(_own_batches, steps))
    return judge(functools.partial(_your_wrap_against_ddp, wrap), exercise, world_size, timeout)
