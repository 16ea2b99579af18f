"""Checkers that train: the learner's gradient hook (notebook 04) and FSDP wrap (notebook 05).

Each runs the learner's code on every rank beside torch's ``DistributedDataParallel`` on the same
samples, and refuses what differs from it: gradients not averaged, averaged by a constant, or
overflowing in fp16; a wrap whose units do not save memory, or whose losses drift from DDP's.

Example: ``dtlib.checks.gradient_hook(lambda grad: grad)`` says the gradients were never all-reduced.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from dtlib.checks._numbers import constant_divisor
from dtlib.checks.skeleton import ON_GLOO
from dtlib.errors import WorkerError, WorkerTimeout
from dtlib.feedback import Feedback
from dtlib.launch.entry import rank_device
from dtlib.launch.spawn import spawn
from dtlib.measure import memory
from dtlib.measure.counting import count_collectives, rank_without_communication
from dtlib.train import data, models

SAMPLES_PER_RANK = 8  # gradient_hook: each rank's share of the regression data


def _your_hook_against_ddp(rank: int, world_size: int, hook: Callable[[Any], Any]) -> dict[str, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    device = rank_device()  # cuda:LOCAL_RANK under NCCL, else the CPU: every tensor and model goes there
    x, y = (t.to(device) for t in data.regression(SAMPLES_PER_RANK * world_size, seed=1).tensors)
    mine = slice(rank * SAMPLES_PER_RANK, (rank + 1) * SAMPLES_PER_RANK)  # each rank its own samples
    yours = models.build("mlp", seed=0).to(device)
    for param in yours.parameters():
        param.register_hook(hook)
    _, calls = count_collectives(lambda: models.loss_fn("mlp", yours(x[mine]), y[mine]).backward())
    reference = DistributedDataParallel(models.build("mlp", seed=0).to(device),
                                        device_ids=[device.index] if device.type == "cuda" else None)
    models.loss_fn("mlp", reference(x[mine]), y[mine]).backward()
    local = models.build("mlp", seed=0).to(device)
    models.loss_fn("mlp", local(x[mine]), y[mine]).backward()
    flat = [torch.cat([p.grad.reshape(-1) for p in m.parameters()]).cpu() for m in (yours, reference.module, local)]
    return {"yours": flat[0], "ddp": flat[1], "local": flat[2], "calls": calls}


def _one_process_gradient(world_size: int) -> Any:
    """The oracle: one model in this process, the loss over every rank's samples at once (a mean, so the
    gradient is the mean of the ranks' gradients: what averaging them must give)."""
    import torch

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
            results = spawn(_your_hook_against_ddp, size, args=(hook,), timeout=timeout, output="none",
                            **ON_GLOO)
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
            calls = result["calls"]
            if calls.get("reduce") and not calls.get("all_reduce"):
                return Feedback(False, f"Rank {rank}'s gradients were not averaged: dist.reduce leaves the sum on "
                                       "one rank only (dst), and the others keep their own. Use dist.all_reduce.")
            if torch.allclose(yours, torch.stack([r["local"] for r in results]).max(0).values, atol=1e-6):
                return Feedback(False, f"Rank {rank} holds the largest gradient of the ranks, not their mean: "
                                       "ReduceOp.MAX keeps the largest; sum with ReduceOp.SUM and divide.")
            if calls.get("all_reduce") and torch.allclose(yours, local / size, atol=1e-6):
                return Feedback(False, f"Rank {rank} holds its own gradients divided by world_size: the all-reduce "
                                       "had not finished when you divided. With async_op=True, call .wait() on the "
                                       "work it returns before using the tensor.")
            if torch.allclose(yours, local, atol=1e-6):
                if rank_without_communication([result["calls"]]) is not None:
                    return Feedback(False, f"Rank {rank} kept its own gradients: your hook called no collective. "
                                           "Call dist.all_reduce(grad) in the hook.")
                return Feedback(False, f"Rank {rank} kept its own gradients although your hook called "
                                       f"{', '.join(sorted(result['calls']))}: dist.all_reduce sums in place, into "
                                       "the tensor you pass it, so return that tensor (divided by the world size).")
            divisor = constant_divisor(yours, single * size)  # the sum over ranks divided by what?
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
        halves = spawn(_your_hook_in_fp16, 2, args=(hook,), timeout=timeout, output="none", **ON_GLOO)
    except (WorkerError, WorkerTimeout) as err:
        return Feedback(False, f"Your hook works in fp32 but fails on an fp16 gradient:\n{err.failures[0].headline()}")
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

    grad = torch.full((4,), 40000.0, dtype=torch.float16, device=rank_device())
    returned = hook(grad)
    if returned is None:
        returned = grad  # as autograd does: None means the hook changed the gradient in place, or not at all
    if not isinstance(returned, torch.Tensor):
        raise TypeError(f"your hook returned a {type(returned).__name__}: return the gradient tensor (or None "
                        "after changing it in place)")
    return returned.float().cpu()


WRAP_MESH_DIMS = ("shard",)  # fsdp_wrap's mesh is named, so that a default mesh is never taken for it


def _your_wrap_against_ddp(rank: int, world_size: int, wrap: Callable[[Any, Any], Any], steps: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    device = rank_device()
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=WRAP_MESH_DIMS)
    model = models.build("transformer", seed=0).to(device)
    try:
        returned = wrap(model, mesh)
        error = None
    except Exception as exc:  # noqa: BLE001 - reported to the learner, with what was sharded before it
        returned, error = None, f"{type(exc).__name__}: {exc}"
    def unit(module: Any) -> int | None:  # which FSDP unit a module is (modules sharded together share one)
        return id(module._get_fsdp_state()) if isinstance(module, FSDPModule) else None

    report: dict[str, Any] = {"root": isinstance(model, FSDPModule), "error": error,
                              "blocks": [isinstance(block, FSDPModule) for block in model.blocks],
                              "block_units": len({unit(block) for block in model.blocks} - {None}),
                              "finer": any(isinstance(inner, FSDPModule) for block in model.blocks
                                           for inner in block.modules() if inner is not block),
                              "returned_other": returned is not None and returned is not model,
                              "other_mesh": sorted({str(p.device_mesh) for p in model.parameters()
                                                    if isinstance(p, DTensor) and p.device_mesh != mesh}),
                              "mesh": str(mesh)}
    if error or report["returned_other"] or report["other_mesh"]:
        return report
    peak = [0]  # parameter bytes this rank holds while a layer runs its forward

    def record(module: Any, inputs: Any, output: Any) -> None:
        peak[0] = max(peak[0], memory.measured(model)["parameters"])

    for module in model.modules():
        if next(module.parameters(recurse=False), None) is not None:
            module.register_forward_hook(record)
    reference = DistributedDataParallel(models.build("transformer", seed=0).to(device),
                                        device_ids=[device.index] if device.type == "cuda" else None)
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, reference)]
    batches = data.batches(data.tokens(64), world_size, rank, batch_size=4)
    losses: dict[str, list[float]] = {"yours": [], "ddp": []}
    for _ in range(steps):
        x, y = (t.to(device) for t in next(batches))  # (B, T)
        for name, net, optimizer in zip(("yours", "ddp"), (model, reference), optimizers, strict=True):
            loss = F.cross_entropy(net(x).flatten(0, 1), y.flatten())
            loss.backward()
            optimizer.step()
            if name == "yours":
                report["at_rest"] = sum(memory.measured(model, optimizer).values())
            optimizer.zero_grad()
            losses[name].append(loss.item())
    return {**report, "peak_parameters": peak[0], **losses}


def fsdp_wrap(wrap: Callable[[Any, Any], Any], world_size: int = 2, steps: int = 3, timeout: float = 60.0) -> Feedback:
    """Notebook 05: ``wrap(model, mesh)`` shards ``dtlib.train.models.build("transformer")`` with ``fully_shard``
    over ``mesh`` (the ranks, on the device they compute on); every block must be a unit of its own and the
    root sharded last.

    Each rank measures the parameter bytes it holds while forward runs and its model state after a
    step, and trains ``steps`` steps beside ``DistributedDataParallel`` on the same samples.
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
    num_params = sum(p.numel() for p in models.build("transformer").parameters())
    full_bytes, at_rest_formula = 4 * num_params, 16 * num_params / world_size  # fp32 weights; fp32 Adam
    try:
        reports = spawn(_your_wrap_against_ddp, world_size, args=(wrap, steps), timeout=timeout, output="none",
                        **ON_GLOO)
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
    if report["other_mesh"]:
        return Feedback(False, f"Some parameters are sharded over {report['other_mesh'][0]}, not over the mesh you "
                               f"were given ({report['mesh']}): pass mesh=mesh to every fully_shard. Without it, "
                               "fully_shard builds a mesh on the machine's accelerator, whatever device the ranks "
                               "compute on (cuda:0 for every rank of a one-GPU machine running gloo).")
    if not report["root"] and not blocks:
        return Feedback(False, "Nothing was sharded: every rank still holds the whole model. Call fully_shard on "
                               "each block, then on the model.")
    if not report["root"]:
        gap = max(abs(a - b) for a, b in zip(report["yours"], report["ddp"], strict=True))
        return Feedback(False, "The blocks are units but the root is not: the embedding, positions, final norm and "
                               "head stay whole on every rank, and their gradients are never averaged over ranks "
                               f"(your losses drift from DDP's by up to {gap:.2g}). Call fully_shard(model) last.")
    if report["finer"] and not blocks:
        return Feedback(False, f"Your units are smaller than a block (a unit per layer, say): forward holds at most "
                               f"{report['peak_parameters']:,} bytes of parameters at once (the whole model is "
                               f"{full_bytes:,}), less than a unit per block would, for more and smaller "
                               "all-gathers, each paying its own latency. That works; the exercise asks for the usual "
                               "balance: fully_shard(block) for every block, then the root.")
    if blocks == len(report["blocks"]) and report["block_units"] < blocks:
        return Feedback(False, f"Your {blocks} blocks are {report['block_units']} unit"
                               f"{'s' if report['block_units'] > 1 else ''}: fully_shard given a list groups its "
                               "modules into one unit, gathered and freed together, so forward holds "
                               f"{report['peak_parameters']:,} bytes of parameters at once (the whole model is "
                               f"{full_bytes:,}). Call fully_shard(block) once per block, then on the root.")
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
