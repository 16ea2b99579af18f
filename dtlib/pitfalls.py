"""Classic pitfalls of distributed training, each reproduced safely and then fixed: notebook 08.

Every function starts ranks through :func:`dtlib.spawn` with a short timeout and
``output="none"``, so a hang or a crash comes back as data; nothing here draws.
Example::

    from dtlib import pitfalls
    pitfalls.sampler_epochs(12, world_size=2)["identical_without_set_epoch"]   # True
    pitfalls.check_fixed_barrier(my_function)         # the exercise's checker
"""

from __future__ import annotations

import contextlib
import io
import logging
import multiprocessing
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from dtlib import data
from dtlib.counting import rank_without_communication, spawn_counting
from dtlib.entry import rank_device
from dtlib.errors import WorkerError, WorkerTimeout
from dtlib.feedback import Feedback
from dtlib.launch import spawn

QUIET: dict[str, Any] = {"output": "none"}
FORK_EXPLANATION = ("fork copies this process, CUDA's driver state included, but a child cannot use a CUDA "
                    "context its parent created: its first CUDA call fails. forkserver and spawn start clean "
                    "processes; dtlib.spawn uses forkserver by default and refuses fork once CUDA is initialised.")


def sampler_epochs(dataset_len: int = 12, world_size: int = 2, epochs: int = 3) -> dict[str, Any]:
    """Pitfall 1: ``DistributedSampler`` orders without and with ``sampler.set_epoch(epoch)``.

    Example: ``sampler_epochs()["identical_without_set_epoch"]`` is True: every epoch repeats epoch 0.
    """
    forgotten = data.sampler_indices(dataset_len, world_size, epochs, set_epoch=False)
    fixed = data.sampler_indices(dataset_len, world_size, epochs, set_epoch=True)
    return {"forgotten": forgotten, "fixed": fixed,
            "identical_without_set_epoch": all(order == forgotten[0] for order in forgotten),
            "identical_with_set_epoch": all(order == fixed[0] for order in fixed)}


def _save_and_load(rank: int, world_size: int, folder: str, numel: int, rank0_only: bool) -> dict[str, Any]:
    state = {"weight": torch.arange(numel, dtype=torch.float32), "step": torch.tensor(7)}  # same on every rank
    path = os.path.join(folder, "checkpoint.pt")
    began = time.perf_counter()
    if rank == 0 or not rank0_only:
        torch.save(state, path)
        with open(os.path.join(folder, "writes.log"), "a") as log:  # one line per write: the evidence
            log.write(f"{rank}\n")
    save_s = time.perf_counter() - began
    if rank0_only:
        dist.barrier()  # nobody reads before rank 0 has finished writing
    try:
        loaded = torch.load(path, map_location=rank_device(), weights_only=True)
        return {"loaded_equal": torch.equal(loaded["weight"].cpu(), state["weight"]), "error": "", "save_s": save_s}
    except Exception as exc:  # noqa: BLE001 - a torn read is the evidence, not a bug here
        return {"loaded_equal": False, "error": f"{type(exc).__name__}: {str(exc)[:100]}", "save_s": save_s}


def checkpoint_writes(world_size: int = 2, numel: int = 1_000_000, timeout: float = 30.0) -> dict[str, Any]:
    """Pitfall 2: every rank saving to one path (N writes, readers may catch a half-written file) against
    rank 0 saving, ``dist.barrier()``, then every rank loading (one write, complete file everywhere).

    Example: ``checkpoint_writes()["rank0_then_barrier"]["writes"] == 1``.
    """
    out = {}
    for name, rank0_only in (("every_rank", False), ("rank0_then_barrier", True)):
        with tempfile.TemporaryDirectory() as folder:
            ranks = spawn(_save_and_load, world_size, args=(folder, numel, rank0_only), timeout=timeout, **QUIET)
            with open(os.path.join(folder, "writes.log")) as log:
                writers = sorted(int(line) for line in log)
            size = os.path.getsize(os.path.join(folder, "checkpoint.pt"))
        out[name] = {"writers": writers, "writes": len(writers), "bytes_written": len(writers) * size,
                     "loaded_equal": [r["loaded_equal"] for r in ranks], "errors": [r["error"] for r in ranks],
                     "save_s": max(r["save_s"] for r in ranks)}  # the slowest rank's torch.save, seconds
    return out


def _barrier_everywhere(rank: int, world_size: int) -> int:
    dist.barrier()
    return rank


def _parameter_bytes_around_sharding(rank: int, world_size: int, meta: bool) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from dtlib import memory, models

    device, source_bytes = rank_device(), 0
    with torch.device("meta" if meta else device):  # meta: shapes only, no storage
        model = models.build("transformer", seed=0)
    before = memory.measured(model)["parameters"]
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    if meta:
        model.to_empty(device=device)  # allocates this rank's shards only
        full = models.build("transformer", seed=0).state_dict() if rank == 0 else {}  # "the checkpoint"
        source_bytes = sum(t.numel() * t.element_size() for t in full.values())
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    reference = models.build("transformer", seed=0).state_dict()
    same = all(torch.equal(p.full_tensor().cpu(), reference[name]) for name, p in model.named_parameters())
    return {"before_sharding": before, "after_sharding": memory.measured(model)["parameters"],
            "source_bytes": source_bytes, "weights_equal_reference": same}


def meta_init_bytes(world_size: int = 2, timeout: float = 60.0) -> dict[str, list[dict[str, Any]]]:
    """Pitfall 4: parameter bytes per rank before and after ``fully_shard``: a normal build (the full model on
    every rank, 4 bytes x parameters) against the meta device (0 bytes), then ``to_empty`` and
    ``set_model_state_dict(broadcast_from_rank0=True)`` (rank 0 alone holds full weights: "the checkpoint").
    On GPUs the order decides GPU memory: ``model.to("cuda")`` before ``fully_shard`` puts all of it on each GPU.

    Example: ``meta_init_bytes()["meta"][1]["before_sharding"] == 0``.
    """
    return {name: spawn(_parameter_bytes_around_sharding, world_size, args=(meta,), timeout=timeout, **QUIET)
            for name, meta in (("normal", False), ("meta", True))}


def unused_parameters(world_size: int = 2, steps: int = 3) -> dict[str, Any]:
    """Pitfall 5: DDP on a model with an unused branch, without ``find_unused_parameters`` (the error)
    and with it (trains, to the parameters of one process with the whole batch).

    Example: ``"find_unused_parameters" in unused_parameters()["error"]``.
    """
    from dtlib.ddp import TrainConfig, run, train_single
    from dtlib.ddp_options import unused_branch_error

    config = TrainConfig(model="branchy", steps=steps)
    error = unused_branch_error(world_size, steps)
    fixed = run(replace(config, find_unused_parameters=True), world_size, **QUIET)
    single = train_single(config)
    return {"error": error, "losses_with_flag": fixed[0].losses,
            "max_difference_from_single": max((r.params - single.params).abs().max().item() for r in fixed)}


@contextlib.contextmanager
def _stderr_into(sink: Any) -> Iterator[None]:
    """Point fd 2 (which processes started meanwhile inherit) and sys.stderr at ``sink``; quiet torch's spawn log."""
    saved, spawn_log = os.dup(2), logging.getLogger("torch.multiprocessing.spawn")
    level = spawn_log.level
    sys.stderr.flush()
    os.dup2(sink.fileno(), 2)
    spawn_log.setLevel(logging.ERROR)  # its "Terminating process ..." warning would land in the notebook
    try:
        with contextlib.redirect_stderr(sink):
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        spawn_log.setLevel(level)


def plain_spawn(fn: Callable[..., Any], nprocs: int = 2, timeout: float = 30.0) -> dict[str, Any]:
    """Pitfall 6: ``torch.multiprocessing.start_processes(fn, args=(nprocs,), start_method="spawn")``.

    Under ``spawn`` the function travels by reference (module and name): a lambda or a nested function
    fails to pickle in this process ("parent"); a function defined in a notebook cell pickles, but the
    new process cannot find it in its own ``__main__`` and dies ("child"; ``child_says`` is its error).
    Every process this call started is stopped before it returns. The fix, ``dtlib.spawn(fn, 2)``, ships
    ``fn`` by value (cloudpickle). Example: ``plain_spawn(lambda rank, n: rank)["where"] == "parent"``.
    """
    import torch.multiprocessing as torch_mp

    before = set(multiprocessing.active_children())
    started, error = False, None
    with tempfile.TemporaryFile("w+") as sink, _stderr_into(sink):
        try:
            context = torch_mp.start_processes(fn, args=(nprocs,), nprocs=nprocs, join=False, start_method="spawn")
            started, deadline = True, time.monotonic() + timeout
            while not context.join(timeout=0.2):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the processes were still running after {timeout:g} s")
        except Exception as exc:  # noqa: BLE001 - the error is the result
            error = exc
        finally:
            for process in set(multiprocessing.active_children()) - before:  # only the ones started here
                process.terminate()
                process.join(5)
        sink.seek(0)
        child_says = re.findall(r"^(\w+(?:Error|Exception): .*)$", sink.read(), flags=re.M)
    return {"started": started, "where": "" if error is None else ("child" if started else "parent"),
            "error_type": type(error).__name__ if error else "", "message": str(error).strip() if error else "",
            "child_says": child_says[0] if child_says else ""}


def fork_after_cuda(demonstrate: bool = True) -> dict[str, Any]:
    """Pitfall 7: a process forked after CUDA is initialised inherits a CUDA state it cannot use, so
    ``dtlib.spawn(start_method="fork")`` refuses then. Where a GPU exists and ``demonstrate`` is True, this
    initialises CUDA here (``torch.cuda.init()``: from then on only forkserver and spawn work in this
    process) and returns the refusal; without one, it forks while CUDA is untouched, which works.

    Example: ``fork_after_cuda()["refused"]``: the message, or "" where CUDA was not initialised.
    """
    out: dict[str, Any] = {"cuda_available": torch.cuda.is_available(), "refused": "", "fork_results": None,
                           "explanation": FORK_EXPLANATION}
    if out["cuda_available"] and demonstrate:
        torch.cuda.init()
    try:
        out["fork_results"] = spawn(_barrier_everywhere, 2, start_method="fork", timeout=30, **QUIET)
    except RuntimeError as err:
        if "unsafe" not in str(err):
            raise
        out["refused"] = str(err)
    out["cuda_initialized"] = torch.cuda.is_initialized()
    return out


def _rank_values(rank: int) -> torch.Tensor:
    return torch.arange(4 * (rank + 1), dtype=torch.float32) + 100 * rank  # rank r: 4 (r + 1) numbers


def _all_reduce(rank: int, world_size: int, pad: bool) -> list[float]:
    values = _rank_values(rank)  # rank 0: 4 numbers, rank 1: 8
    if pad:
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
        dist.all_gather(sizes, torch.tensor([values.numel()]))  # first agree on the size
        values = torch.nn.functional.pad(values, (0, int(max(sizes).item()) - values.numel()))
    dist.all_reduce(values)
    return values.tolist()


def shape_mismatch(world_size: int = 2, timeout: float = 8.0) -> dict[str, Any]:
    """Pitfall 8: ``all_reduce`` of 4 numbers on rank 0 and 8 on rank 1. gloo aborts a rank ("Received data
    size doesn't match expected size") and its peer sees the connection reset (or, elsewhere, the ranks
    hang). The fix all-gathers the sizes and pads to the largest; checked against a direct sum.

    Example: ``shape_mismatch()["fixed_correct"]`` is True.
    """
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            spawn(_all_reduce, world_size, args=(False,), timeout=timeout, output="all")  # captured, not shown
        raise AssertionError("mismatched all_reduce returned: expected a failure")
    except WorkerError as err:
        headlines = [failure.headline()[:160] for failure in err.failures]
        kind = type(err).__name__
    gloo = [line.split("] ")[-1] for line in captured.getvalue().splitlines() if "Received data size" in line]
    fixed = spawn(_all_reduce, world_size, args=(True,), timeout=timeout, **QUIET)
    longest = max(len(_rank_values(r)) for r in range(world_size))
    expected = sum(torch.nn.functional.pad(_rank_values(r), (0, longest - len(_rank_values(r))))
                   for r in range(world_size))
    return {"error_kind": kind, "headlines": headlines, "gloo_says": gloo[0][:200] if gloo else "",
            "fixed": fixed, "expected": expected.tolist(), "fixed_correct": all(f == expected.tolist() for f in fixed)}


def fingerprint_summary(message: str) -> str:
    """``TORCH_DISTRIBUTED_DEBUG=DETAIL``'s "Detected mismatch between collectives" error, one clause a line
    and without each tensor's ``TensorOptions(...)`` repeated. Example::

        fingerprint_summary(str(err)).splitlines()[0]   # "Detected mismatch between collectives on ranks."
    """
    short = re.sub(r", TensorDeviceTypes=TensorOptions\(.*?memory_format=\(\w+\)\)", "", message)
    short = re.sub(r"\s+", " ", short).replace("on ranks. Rank", "on ranks.\nRank")
    short = short.replace("), but Rank", "),\nbut Rank").replace(").Collectives differ", ").\nCollectives differ")
    return short.strip()


def _load_with_and_without_map_location(rank: int, world_size: int, path: str) -> dict[str, str]:
    gpus = torch.cuda.device_count()
    mine = torch.device("cuda", rank % gpus) if torch.cuda.is_available() else torch.device("cpu")
    if rank == 0:  # saved from rank 0's device: cuda:0 on a GPU machine
        torch.save({"weight": torch.ones(3, device=mine)}, path)
    dist.barrier()
    recorded: list[str] = []
    torch.load(path, map_location=lambda storage, location: recorded.append(location) or storage, weights_only=True)
    plain = torch.load(path, weights_only=True)["weight"].device
    mapped = torch.load(path, map_location=mine, weights_only=True)["weight"].device
    return {"location_in_file": recorded[0], "without_map_location": str(plain),
            "with_map_location": str(mapped), "this_rank_device": str(mine)}


def map_location(world_size: int = 2, timeout: float = 30.0) -> list[dict[str, str]]:
    """Pitfall 9: a checkpoint records each tensor's device ("cuda:0" when rank 0 saved from its GPU);
    ``torch.load`` without ``map_location`` puts it back there, so every rank loads onto cuda:0. With
    ``map_location=device`` each rank gets its own. On a CPU-only machine every device is "cpu".

    Example: ``map_location()[1]["with_map_location"]``.
    """
    with tempfile.TemporaryDirectory() as folder:
        return spawn(_load_with_and_without_map_location, world_size, args=(os.path.join(folder, "w.pt"),),
                     timeout=timeout, **QUIET)


def _stuck_in(stack: str, function_name: str) -> str:
    """From a faulthandler stack (most recent call first): "all_reduce (line 4, in fn)"."""
    inside = re.findall(r'distributed_c10d\.py", line \d+ in (\w+)', stack)  # the collective is torch's frame
    line = next((n for n, name in re.findall(r"line (\d+) in (\w+)", stack) if name == function_name), "")
    return (inside[0] if inside else "a collective") + (f" (line {line}, in {function_name})" if line else "")


def _ranks(ranks: list[int]) -> str:
    """"rank 1", "ranks 1 and 2", "ranks 1, 2 and 3"."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def _hang_message(err: WorkerTimeout, function_name: str) -> str:
    stuck = "; ".join(f"rank {rank} waited in {_stuck_in(stack, function_name)}" for rank, stack in err.stacks.items())
    if not err.finished_ranks:
        return (f"It hung: {stuck}, and no rank returned: each waited for a call that no other rank made. Every "
                "rank must call the same collectives in the same order.")
    return (f"It hung: {stuck}, while {_ranks(err.finished_ranks)} returned without calling it. Every rank must call "
            "the same collectives in the same order: move the collective out of the `if rank == ...` branch.")


def check_fixed_barrier(fn: Callable[[int, int], Any], world_size: int = 2, timeout: float = 5.0) -> Feedback:
    """Notebook 08's exercise: ``fn(rank, world_size)`` must return, on every rank, the mean over ranks of
    each rank's loss ``rank + 1``, every rank calling the same collectives in the same order. It runs with
    ``world_size`` ranks and with one more, and the mean must come through a collective.

    Example: ``check_fixed_barrier(lambda rank, world_size: rank + 1)`` says rank 0 kept its own loss.
    """
    if not callable(fn):
        return Feedback(False, f"Pass your function itself, not {type(fn).__name__}.")
    sizes = (world_size, world_size + 1)  # a second size refuses a hard-coded world size
    for size in sizes:
        expected = (size + 1) / 2
        try:
            results, calls = spawn_counting(fn, size, timeout=timeout)
        except WorkerTimeout as err:
            return Feedback(False, _hang_message(err, getattr(fn, "__name__", "")))
        except WorkerError as err:
            raised = [failure for failure in err.failures if failure.exc_type is not None]
            hint = "" if raised else " (a rank dying inside a collective: the ranks called different ones or shapes)"
            return Feedback(False, f"A rank failed{hint}:\n{(raised or err.failures)[0].headline()[:300]}")
        for rank, value in enumerate(results):
            number = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
            if not isinstance(number, (int, float)) or isinstance(number, bool):
                return Feedback(False, f"Rank {rank} returned {value!r}: return the mean loss as a number on every "
                                       "rank (loss.item()), not only on rank 0.")
            if abs(number - expected) < 1e-6:
                continue
            if abs(number - (rank + 1)) < 1e-6:
                return Feedback(False, f"Rank {rank} returned its own loss {number:g}: it never took part in the "
                                       "all_reduce. Call dist.all_reduce on every rank.")
            if abs(number - expected * size) < 1e-6:
                return Feedback(False, f"Rank {rank} returned the sum {number:g}: divide by world_size for the mean.")
            divisor = expected * size / number if number else 0.0
            if divisor > 1.5 and abs(divisor - round(divisor)) < 1e-6:
                return Feedback(False, f"With {size} ranks, rank {rank} returned {number:g}, the sum divided by "
                                       f"{round(divisor)}: divide by world_size (dist.get_world_size()), not a "
                                       "constant.")
            return Feedback(False, f"Rank {rank} returned {number:g}, expected the mean {expected:g}: all_reduce "
                                   "(SUM) once on every rank, then divide by world_size once.")
        silent = rank_without_communication(calls)
        if silent is not None:
            return Feedback(False, f"Rank {silent} returned the mean {expected:g}, but no collective was called: it "
                                   "worked the mean out from a formula, while a real rank knows only its own loss. "
                                   "Call dist.all_reduce on the loss on every rank, then divide by world_size.")
    return Feedback(True, f"Every rank returned the mean loss, with {sizes[0]} ranks ({(sizes[0] + 1) / 2:g}) and "
                          f"with {sizes[1]} ({(sizes[1] + 1) / 2:g}): every rank called the same collective, so none "
                          "waited for ever.")
