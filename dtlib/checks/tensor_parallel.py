"""The tensor-parallel exercise of notebook 09: an MLP split across ranks by hand.

The MLP is ``y = gelu(x @ up.T) @ down.T`` with ``nn.Linear``'s weight layout, ``(out_features,
in_features)``: :func:`mlp_inputs` gives every rank the same ``x``, ``up`` and ``down``. Megatron's split is
column parallel, then row parallel: each rank keeps whole hidden features (rows of ``up``, the columns of
A in Y = XA), applies gelu to them with no communication, multiplies by its columns of ``down`` and ends
with a partial sum of the output, which one all-reduce completes.

Example: ``tensor_parallel_mlp(fn)``, where ``fn(rank, world_size)`` returns the MLP's output.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from dtlib import calls
from dtlib.checks.feedback import Feedback
from dtlib.checks.skeleton import UNREADABLE, RankExercise, judge, same_collectives_hang
from dtlib.errors import WorkerError
from dtlib.launch.device import rank_device
from dtlib.measure.counting import watching

BATCH, FEATURES, HIDDEN = 4, 8, 12  # HIDDEN divides by 2 and by 3: the checker runs 2 ranks, then 3
_LESSON_SEED = 9  # mlp_inputs' numbers in the lesson's cells
#: The seed mlp_inputs draws from now: the lesson's, or, while a check runs (in its ranks and in this process),
#: the check's own, new on each call, so that no answer can return numbers worked out in advance.
_seed = [_LESSON_SEED]


def mlp_inputs(device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` (4, 8), ``up`` (12, 8) and ``down`` (8, 12), float32 on ``device`` (default: the rank's own,
    :func:`dtlib.rank_device`), the same on every rank; new numbers in each check of
    :func:`tensor_parallel_mlp`, the lesson's own (seed 9) otherwise.

    Example: ``x, up, down = mlp_inputs()``.
    """
    device = rank_device() if device is None else device
    x, up, down = _drawn(_seed[0])
    return x.to(device), up.to(device), down.to(device)


def _drawn(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x``, ``up`` and ``down`` from ``seed``, on the CPU."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, FEATURES, generator=generator)
    up = torch.randn(HIDDEN, FEATURES, generator=generator) / FEATURES ** 0.5
    down = torch.randn(FEATURES, HIDDEN, generator=generator) / HIDDEN ** 0.5
    return x, up, down


def _mlp(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return F.gelu(x @ up.T) @ down.T


def _expected(size: int) -> torch.Tensor:
    """The MLP's output for this check's inputs, computed in float64: the oracle a float32 answer is held to."""
    return _mlp(*(t.double() for t in mlp_inputs("cpu")))


def _split_the_wrong_way(size: int) -> torch.Tensor:
    """The sum over ranks of gelu(a partial sum): the first layer split by its input features (dim 1 of up)."""
    x, up, down = mlp_inputs("cpu")
    return sum(F.gelu(x_r @ up_r.T) @ down.T for x_r, up_r in zip(x.chunk(size, 1), up.chunk(size, 1),
                                                                  strict=True)).double()


def _tanh_gelu(size: int) -> torch.Tensor:
    """The output with gelu's tanh approximation: about 3 to 4 digits from the exact (erf) gelu."""
    x, up, down = (t.double() for t in mlp_inputs("cpu"))
    return F.gelu(x @ up.T, approximate="tanh") @ down.T


def _gelu_after_the_sum(size: int) -> torch.Tensor:
    x, up, down = mlp_inputs("cpu")
    return F.gelu(x @ up.T @ down.T).double()


def _largest_summand(size: int) -> torch.Tensor:
    return torch.stack([_partial(size, rank) for rank in range(size)]).max(0).values


def _partial(size: int, rank: int) -> torch.Tensor:
    x, up, down = mlp_inputs("cpu")
    return (F.gelu(x @ up.chunk(size, 0)[rank].T) @ down.chunk(size, 1)[rank].T).double()


def _summand_of(first: int, stop: int) -> torch.Tensor:
    """The output's summand from hidden features ``first`` to ``stop - 1`` (zeros where there are none)."""
    x, up, down = mlp_inputs("cpu")
    return (F.gelu(x @ up[first:stop].T) @ down[:, first:stop].T).double()


def _fixed_share(world: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s hidden features when its slice is written for ``world`` ranks (``HIDDEN // world`` each,
    ``up[6 * rank:6 * rank + 6]`` for 2), clipped to the features there are."""
    width = HIDDEN // world
    return min(HIDDEN, rank * width), min(HIDDEN, (rank + 1) * width)


def _features_of(summand: torch.Tensor) -> tuple[int, int] | None:
    """The run of hidden features whose summand this is, (first, stop), or None."""
    return next(((first, stop) for first in range(HIDDEN) for stop in range(first + 1, HIDDEN + 1)
                 if _close(summand, _summand_of(first, stop))), None)


def _features_in(summand: torch.Tensor) -> frozenset[int] | None:
    """The hidden features (any set, not only a run) whose summand this is, read as (BATCH, FEATURES), flattened
    or transposed; None if it is no such summand. Each feature j adds gelu(x @ up_j) down_j, so the set is the
    0/1 solution of a least-squares fit of those HIDDEN terms."""
    if summand.numel() != BATCH * FEATURES:
        return None
    x, up, down = mlp_inputs("cpu")
    hidden, out = F.gelu(x @ up.T).double(), down.T.double()  # (BATCH, HIDDEN), (HIDDEN, FEATURES)
    terms = torch.stack([torch.outer(hidden[:, j], out[j]).reshape(-1) for j in range(HIDDEN)], 1)
    for target in (summand.reshape(BATCH, FEATURES), summand.reshape(FEATURES, BATCH).T):
        target = target.reshape(-1).double()
        mask = torch.linalg.lstsq(terms, target.unsqueeze(1)).solution.squeeze(1).round()
        if bool(((mask == 0) | (mask == 1)).all()) and torch.allclose(terms @ mask, target, atol=1e-5, rtol=1e-5):
            return frozenset(int(j) for j in torch.nonzero(mask).flatten())
    return None


#: Multiply-add flops of the whole MLP: x @ up.T and then @ down.T, two flops per multiply-add.
MLP_FLOPS = 2 * 2 * BATCH * HIDDEN * FEATURES


def _written_for(value: torch.Tensor, size: int) -> int | None:
    """The world size (not ``size``) for which slices of HIDDEN // world features per rank give ``value``."""
    worlds = [world for world in range(2, HIDDEN + 1) if HIDDEN % world == 0 and world != size]
    return next((world for world in worlds
                 if _close(value, sum(_summand_of(*_fixed_share(world, rank)) for rank in range(size)))), None)


def _span(first: int, stop: int) -> str:
    return f"{first} to {stop - 1} ({stop - first} of {HIDDEN})" if stop > first else f"none (of {HIDDEN})"


def _share(size: int, rank: int) -> tuple[int, int]:
    width = -(-HIDDEN // size)  # up.chunk(size, 0)'s pieces
    return min(HIDDEN, rank * width), min(HIDDEN, (rank + 1) * width)


def _written_for_hint(a: Any) -> str:
    world = _written_for(a.value, a.size)
    return (f"With {a.size} ranks your slices cover the hidden features as if there were {world} ranks: rank "
            f"{a.rank} takes features {_span(*_fixed_share(world, a.rank))}, where its share with {a.size} ranks is "
            f"{_span(*_share(a.size, a.rank))}. Your slice is written for {world} ranks (the check runs two world "
            "sizes): compute it from world_size, e.g. up.chunk(world_size, 0)[rank] and down.chunk(world_size, 1)"
            "[rank].")


def _read(value: Any) -> Any:
    if hasattr(value, "placements") or not isinstance(value, torch.Tensor):  # a DTensor: not what to return
        return UNREADABLE
    if value.is_floating_point() and value.shape == (BATCH, FEATURES):
        return value.detach().double().cpu()
    return UNREADABLE


def _close(value: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether ``value`` is ``expected`` to about 5 digits: for hints, which recognise what a wrong answer computed,
    not for the verdict (:func:`_exact`)."""
    return value.shape == expected.shape and torch.allclose(value, expected, atol=1e-5, rtol=1e-5)


#: How far a right float32 output may be from the float64 one, in units of float32's epsilon times the slot's
#: magnitude (:func:`_magnitude`): one process and every split over 1 to 5 ranks, each summed in any order, stayed
#: under 0.7 in 300 draws; an output rounded to 5 decimals went over 4.9 in every one of them.
FLOAT32_UNITS = 2.5


def _magnitude(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Each output slot's scale for float32's rounding: the sum of the absolute values of the terms that make it,
    in the second layer (|gelu(x up^T)| |down^T|) and, carried through gelu, in the first."""
    x, up, down = x.double(), up.double(), down.double()
    return (F.gelu(x @ up.T).abs() + x.abs() @ up.abs().T) @ down.abs().T


def _bound() -> torch.Tensor:
    """How far each output slot of this check's inputs may be from the float64 output: float32's rounding."""
    return FLOAT32_UNITS * torch.finfo(torch.float32).eps * _magnitude(*mlp_inputs("cpu"))


def _exact(value: torch.Tensor, expected: torch.Tensor) -> bool:
    """The verdict: ``value`` is the MLP's output at float32's precision, slot by slot, against the float64
    output of this check's inputs; a shortcut that rounds, or a step in 16 bits, is refused."""
    return value.shape == expected.shape and bool(((value - expected).abs() <= _bound()).all())


def _first_off(value: torch.Tensor, expected: torch.Tensor) -> str:
    """The slot that is furthest off, beyond float32's rounding, with both numbers."""
    bound = _bound()
    over = (value - expected).abs() / bound
    row, column = divmod(int(over.argmax()), FEATURES)
    return (f"at [{row}, {column}] it is {value[row, column].item():.9g}, where the output is "
            f"{expected[row, column].item():.9g}, off by {abs(value[row, column] - expected[row, column]).item():.2g} "
            f"where float32's rounding allows {bound[row, column].item():.2g}")


def _to_a_few_digits(value: Any, expected: torch.Tensor) -> bool:
    """Whether ``value`` is the output to a 16-bit float's precision but not to 5 digits: the work was right and a
    step of it ran in float16 or bfloat16 (which keep 3 significant digits or fewer)."""
    if not isinstance(value, torch.Tensor) or value.shape != expected.shape or _close(value, expected):
        return False
    scale = expected.abs().max().item()
    return bool(torch.allclose(value, expected, atol=2e-2 * max(scale, 1e-3), rtol=0.0))


def _part_way(value: torch.Tensor, summand: torch.Tensor, total: torch.Tensor) -> bool:
    """Each number is this rank's summand or the finished sum, and not all are the sum: an all-reduce read
    before it finished (while gloo still writes into the tensor, some numbers may be done, some not)."""
    near = functools.partial(torch.isclose, atol=1e-5, rtol=1e-5)
    return bool((near(value, summand) | near(value, total)).all()) and not _close(value, total)


def _shape_of(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def _failure(err: WorkerError) -> str:
    said = err.cause().headline()
    if err.cause().exc_type == "IndexError":
        rank = err.cause().rank
        return (f"Rank {rank} took a piece that does not exist ({said}): your split has fewer pieces than there "
                f"are ranks, none for rank {rank}, as if written for a smaller world size. Split by world_size: "
                "up.chunk(world_size, 0)[rank] and down.chunk(world_size, 1)[rank].")
    if "not contiguous" in said:  # strict mode's own words: they name the tensor and the fix
        return f"Your function raised on a rank:\n{said}"
    if "cannot be multiplied" in said or "size of tensor" in said or "shape" in said:
        return (f"A matmul's shapes did not fit on a rank ({said.splitlines()[-1]}). nn.Linear keeps its weight as "
                "(out_features, in_features): the first layer's columns of A (Y = XA) are rows of up (dim 0), "
                "the second layer's rows of A are columns of down (dim 1).")
    return f"Your function raised on a rank:\n{said}"


def _all_reduce_in_two_steps(counted: dict[str, int]) -> bool:
    """One reduce-scatter, then one all-gather, and no all-reduce: an all-reduce in its two halves (notebook 09,
    section 5), judged further by :func:`tensor_parallel_mlp` (what was reduced)."""
    scatters = sum(times for name, times in counted.items() if "reduce_scatter" in name)
    gathers = sum(times for name, times in counted.items() if "gather" in name)
    return scatters == 1 and gathers == 1 and not counted.get("all_reduce")


def _excess(calls: Sequence[dict[str, int]]) -> str | None:
    gathered = [rank for rank, counted in enumerate(calls) if any("gather" in name for name in counted)
                and not _all_reduce_in_two_steps(counted)]
    if gathered:
        return (f"Right values, but rank {gathered[0]} gathered ({', '.join(sorted(calls[gathered[0]]))}): no rank "
                "needs another rank's activations here. Each rank's rows of up and columns of down give a summand "
                "of the whole output, and one all_reduce of the (4, 8) summands is all the MLP needs.")
    reduces = max(counted.get("all_reduce", 0) for counted in calls)
    if reduces > 1:
        return (f"Right values, but with {reduces} all-reduces per rank: the column-parallel layer needs none (gelu "
                "acts on whole hidden features), the row-parallel layer one, at the end.")
    return None


TENSOR_PARALLEL_MLP = RankExercise(
    expected=_expected,
    read=_read,
    same=_exact,
    hints=[
        (lambda a: hasattr(a.returned, "placements"),
         lambda a: f"Rank {a.rank} returned a DTensor ({a.returned.placements}): return a plain tensor, whole on every "
                   "rank, such as y.full_tensor()."),
        (lambda a: isinstance(a.returned, torch.Tensor) and a.returned.dtype in (torch.bfloat16, torch.float16),
         lambda a: f"Rank {a.rank} computed in {str(a.returned.dtype).removeprefix('torch.')}, which keeps about 3 "
                   "significant digits; the check compares at float32's precision: compute in float32."),
        (lambda a: a.value is UNREADABLE and isinstance(a.returned, torch.Tensor)
         and tuple(a.returned.shape) == (BATCH, HIDDEN // a.size),
         lambda a: f"Rank {a.rank} returned its hidden activations, {_shape_of(a.returned)}: go on through the "
                   "second layer, with this rank's columns of down, and all-reduce the output."),
        (lambda a: a.value is UNREADABLE,
         lambda a: f"Rank {a.rank} returned {_shape_of(a.returned)}: return the MLP's whole output, a float tensor of "
                   f"shape ({BATCH}, {FEATURES}), on every rank."),
        (lambda a: a.called("all_reduce") and _written_for(a.value, a.size) is not None, _written_for_hint),
        (lambda a: a.called("all_reduce") and _part_way(a.value, _partial(a.size, a.rank), a.expected),
         lambda a: f"Rank {a.rank} holds its own summand, in part or whole, although it called all_reduce: the "
                   "all-reduce had not finished when it returned. With async_op=True, call .wait() on the work it "
                   "returns before returning y."),
        (lambda a: _close(a.value, _mlp(*_drawn(_LESSON_SEED)).double()),
         lambda a: f"Rank {a.rank} returned the MLP's output for the lesson's inputs, not for this check's: each check "
                   "draws new numbers, which mlp_inputs() returns in its ranks. Compute the output from them."),
        (lambda a: _close(a.value, _partial(a.size, a.rank)),
         lambda a: f"Rank {a.rank} holds only its share of the output: after the row-parallel layer each rank has a "
                   "partial sum over its hidden features. dist.all_reduce(y) (SUM) adds the shares."),
        (lambda a: _close(a.value, _largest_summand(a.size)),
         lambda a: f"Rank {a.rank} holds the largest of the ranks' summands, slot by slot: ReduceOp.MAX keeps the "
                   "largest, and the summands must be added, with SUM."),
        (lambda a: _close(a.value, _gelu_after_the_sum(a.size)),
         lambda a: f"Rank {a.rank} applied gelu after the second layer: gelu acts on the hidden features, between "
                   "the two layers, where each rank holds whole features of its own."),
        (lambda a: _close(a.value, _expected(a.size) / a.size),
         lambda a: f"Rank {a.rank} holds the output divided by {a.size}: the ranks' partial sums add up to the output; "
                   "all-reduce with SUM and do not divide (nothing here is an average)."),
        (lambda a: _close(a.value, _split_the_wrong_way(a.size)),
         lambda a: f"Rank {a.rank} split the first layer by its input features (dim 1 of up), so each rank's hidden "
                   "values were partial sums, and gelu of a partial sum is not part of gelu of the sum. Split up by "
                   "its output features (dim 0): each rank then holds whole hidden features, and gelu needs no "
                   "communication."),
        (lambda a: _close(a.value, _tanh_gelu(a.size)),
         lambda a: f"Rank {a.rank} used gelu's tanh approximation (approximate='tanh'): off by up to "
                   f"{(a.value - a.expected).abs().max().item():.2g}. F.gelu and nn.GELU() compute the exact gelu "
                   "by default, and the split must give what one process computes: keep the default."),
        (lambda a: _to_a_few_digits(a.value, a.expected),
         lambda a: f"With {a.size} ranks, rank {a.rank}'s output is one process's to about 3 digits only (off by up to "
                   f"{(a.value - a.expected).abs().max().item():.2g}): the split is right, but something ran in 16 "
                   "bits, a float16 or bfloat16 copy all-reduced or multiplied, say. Keep every step in float32."),
        (lambda a: _close(a.value, a.expected),
         lambda a: f"With {a.size} ranks, rank {a.rank}'s output is right to about 5 digits, not to float32's "
                   f"precision: {_first_off(a.value, a.expected)}. The split is right; something rounded, or ran "
                   "in lower precision: keep every step in float32, and return the all-reduced tensor as it is."),
    ],
    otherwise=lambda a: (f"With {a.size} ranks, rank {a.rank}'s output differs from one process's by up to "
                         f"{(a.value - a.expected).abs().max().item():.3g}: each rank pairs its rows of up (dim 0) "
                         "with the columns of down (dim 1) of the same hidden features, applies gelu between the "
                         "two layers, and all-reduces the product with SUM."),
    no_collective=lambda rank, expected, calls: (
        f"Rank {rank} has the right output but communicated nothing: it computed the whole MLP with every weight. "
        "Each rank must use only its slice of up and of down; an all-reduce then adds the partial outputs."),
    right=lambda first, second, values: (
        f"Every rank holds the MLP's output, with {first} ranks and with {second}, after one all-reduce: column "
        "parallel (rows of up) then row parallel (columns of down), the split Megatron-LM uses for every MLP and "
        "attention block, and what ColwiseParallel and RowwiseParallel do."),
    hang=same_collectives_hang,
    failure=_failure,
    excess=_excess,
    returned_in=lambda report: report["value"],  # each rank runs the answer under _what_moved
)


# Communication ops that move data, as torch dispatches them: c10d's (dist.*) and the functional ones (DTensor).
_ALL_REDUCE = {"allreduce_", "all_reduce", "allreduce_coalesced_", "all_reduce_coalesced"}
_REDUCE_SCATTER = {"reduce_scatter_": 1, "_reduce_scatter_base_": 1, "reduce_scatter_tensor": 0}  # -> input arg
_MOVERS = {name for table in (calls.C10D, calls.FUNCTIONAL) for name, op in table.items()
           if op.kind != "barrier"} | {"all_gather"}  # receives too; c10d_functional's legacy all_gather


def _flat(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for item in value for t in _flat(item)] if isinstance(value, list | tuple) else []


def _what_moved(rank: int, world_size: int, fn: Callable[[int, int], Any]) -> dict[str, Any]:
    """In a rank: run ``fn`` and note every communication op torch dispatches, with a copy of each reduction's
    input, taken before the op changes it: an all-reduce's tensor (c10d's ``allreduce_`` and the functional
    ``all_reduce`` of DTensor), or a reduce-scatter's input, flattened; and what ``fn`` returned (``value``)."""
    moved: list[str] = []
    summands: list[torch.Tensor] = []
    scattered: list[torch.Tensor] = []

    def see(namespace: str, name: str, args: tuple) -> None:
        if namespace not in ("c10d", "_c10d_functional", "c10d_functional"):
            return
        if name in _ALL_REDUCE:
            summands.extend(t.detach().to("cpu", torch.float64, copy=True) for t in _flat(args[0]))
        elif name in _REDUCE_SCATTER:
            pieces = _flat(args[_REDUCE_SCATTER[name]])
            if pieces:  # none: torch's own call says what is wrong
                scattered.append(torch.cat([t.detach().reshape(-1).to("cpu", torch.float64) for t in pieces]))
        elif name in _MOVERS:
            moved.append(name.strip("_"))

    with FlopCounterMode(display=False) as flops, watching(see):
        value = fn(rank, world_size)
    return {"value": value, "moved": moved, "summands": summands, "scattered": scattered,
            "flops": flops.get_total_flops()}


def _not_the_summand(size: int, rank: int, reduced: torch.Tensor, what: str) -> str:
    """What to say when a rank reduced a tensor that is not its summand."""
    features = _features_of(reduced) if reduced.shape == (BATCH, FEATURES) else None
    if features is not None and features != (0, HIDDEN):  # every feature: every weight, on every rank (below)
        written_for = next((world for world in range(2, HIDDEN + 1) if HIDDEN % world == 0 and world != size
                            and _fixed_share(world, rank) == features), None)
        mine = f"its share with {size} ranks is features {_span(*_share(size, rank))}"
        if written_for is not None:
            return (f"Right values, but with {size} ranks rank {rank} all-reduced the summand of hidden features "
                    f"{_span(*features)}, its share with {written_for} ranks, where {mine}: your slice is written for "
                    f"{written_for} ranks (the check runs two world sizes). Compute it from world_size, e.g. "
                    "up.chunk(world_size, 0)[rank] and down.chunk(world_size, 1)[rank].")
        return (f"Right values, but with {size} ranks rank {rank} all-reduced the summand of hidden features "
                f"{_span(*features)}, where {mine}: compute each rank's slice from rank and world_size, e.g. "
                "up.chunk(world_size, 0)[rank] and down.chunk(world_size, 1)[rank].")
    return (f"Right values, but with {size} ranks rank {rank} {what}: tensor parallelism all-reduces each rank's "
            "summand gelu(x @ up_r.T) @ down_r.T, computed from its own rows of up and columns of down (the same "
            "numbers reached with every weight on every rank, or a batch split, are data parallelism or no "
            "parallelism at all).")


def _too_much_computed(size: int, rank: int, report: dict[str, Any]) -> str | None:
    """A rank that all-reduced its summand but multiplied more than its share (the whole MLP, say), or None."""
    share = MLP_FLOPS / size
    if report.get("flops", 0) <= 1.5 * share:
        return None
    return (f"Right values, but with {size} ranks rank {rank} multiplied {report['flops']:,} flops' worth of "
            f"matrices, where its share of the MLP is {share:,.0f}: it computed with more than its own rows of "
            "up and columns of down (the whole MLP, or part of it twice). Tensor parallelism's point is that each "
            "rank computes only its slice; the all-reduce of the summands gives every rank the output.")


def _unequal_shares(size: int, reports: Sequence[dict[str, Any]]) -> str | None:
    """Ranks whose summands add up but whose shares of the hidden features differ, or None."""
    features = [report.get("features") for report in reports]
    if any(mine is None for mine in features) or len({len(mine) for mine in features}) == 1:
        return None
    for rank, mine in enumerate(features):
        run = (min(mine), max(mine) + 1) if mine and len(mine) == max(mine) + 1 - min(mine) else (0, 0)
        if run != _share(size, rank) and any(_fixed_share(world, rank) == run for world in range(2, HIDDEN + 1)
                                             if world != size):  # a slice written for another world size
            return _not_the_summand(size, rank, _summand_of(*run).double(), "all-reduced another summand")
    return (f"Right values, but with {size} ranks the ranks computed {[len(mine) for mine in features]} hidden "
            f"features: give each rank an equal share ({HIDDEN // size}), or the others wait for the rank with the "
            "most at every all-reduce.")


def _judge_moves(size: int, rank: int, report: dict[str, Any]) -> str | None:
    """What is wrong with what rank ``rank`` moved, or None where it all-reduced its summand, at once or as a
    reduce-scatter and an all-gather."""
    summands, scattered, moved = report["summands"], report["scattered"], report["moved"]
    expected = _partial(size, rank)
    if scattered and not summands and len(scattered) == 1 and len(moved) == 1 and "gather" in moved[0]:
        flat, numbers = scattered[0], expected.reshape(-1)
        head = flat[:numbers.numel()]
        if (flat.numel() >= numbers.numel() and _features_in(head) is not None
                and not flat[numbers.numel():].abs().gt(0).any()):  # a summand, then any padding of zeros
            report["features"] = _features_in(head)
            return _too_much_computed(size, rank, report)
        return _not_the_summand(size, rank, head.reshape(BATCH, FEATURES) if head.numel() == expected.numel()
                                else head, "reduce-scattered a tensor that is not its summand")
    if moved and not summands and {name.split("_")[0] for name in moved} == {"reduce", "broadcast"}:
        return (f"Right values, but with {size} ranks rank {rank} summed through one rank: dist.reduce to it, then "
                "dist.broadcast from it, two collectives that wait for each other, with the root's link carrying "
                "every byte twice. One dist.all_reduce of the summands does both, and NCCL runs it as one ring.")
    if moved:
        return (f"Right values, but with {size} ranks rank {rank} also moved data "
                f"({', '.join(sorted(set(moved)))}): every rank already holds mlp_inputs, so it takes its slices "
                "locally, and the only communication the MLP needs is one all_reduce of the summands.")
    if len(summands) == 1 and _features_in(summands[0]) is not None:
        report["features"] = _features_in(summands[0])  # its own features: any that add up over the ranks
        return _too_much_computed(size, rank, report)
    if len(summands) != 1 or not _close(summands[0], expected):
        what = (f"{len(summands)} all-reduces" if len(summands) != 1 else
                f"a tensor of shape {tuple(summands[0].shape)}" if summands[0].shape != expected.shape else
                "a tensor that is not its summand")
        if len(summands) == 1 and summands[0].shape == expected.shape:
            return _not_the_summand(size, rank, summands[0], f"all-reduced {what}")
        return _not_the_summand(size, rank, expected.new_zeros(0), f"all-reduced {what}")
    return None


def _on_seed(fn: Callable[[int, int], Any], seed: int, rank: int, world_size: int) -> dict[str, Any]:
    """In a rank: ``fn(rank, world_size)`` with :func:`mlp_inputs` drawing from the check's ``seed``, and what it
    moved (:func:`_what_moved`, whose ``value`` is what ``fn`` returned)."""
    _seed[0] = seed
    return _what_moved(rank, world_size, fn)


def tensor_parallel_mlp(fn: Callable[[int, int], Any], world_size: int = 2, timeout: float = 60.0) -> Feedback:
    """Notebook 09: ``fn(rank, world_size)`` computes :func:`mlp_inputs`' MLP with its own slice of ``up`` and of
    ``down`` and returns the whole output on every rank; it runs with ``world_size`` ranks and with one more.

    Right: one process's output, reached through one all-reduce per rank of that rank's summand
    ``gelu(x @ up_r.T) @ down_r.T`` (or that all-reduce in its two halves, a reduce-scatter of the summand and an
    all-gather), and no other data moved. Each wrong answer is named: the missing all-reduce, an average, MAX,
    gelu in the wrong place, the first layer split by its input features, slices written for another world size,
    a shape that does not fit, and right numbers reached some other way (every rank computing everything, a
    broadcast, a batch split). :func:`mlp_inputs` gives new numbers in each check.
    """
    judged = [size for size in range(2, HIDDEN + 1) if HIDDEN % size == 0 and HIDDEN % (size + 1) == 0]
    if world_size not in judged:  # a share of the hidden features per rank, equal at both sizes the check runs
        raise ValueError(f"tensor_parallel_mlp checks world sizes {' or '.join(map(str, judged))}: it runs "
                         f"world_size ranks and one more, and the MLP's {HIDDEN} hidden features split evenly over "
                         f"both only then (got {world_size!r})")
    if not callable(fn):
        return Feedback(False, f"Pass your function itself, not {type(fn).__name__}.")
    seed = random.randrange(2**31)
    on_seed = functools.update_wrapper(functools.partial(_on_seed, fn, seed), fn)  # fn's name, in messages
    _seed[0] = seed  # this process's oracles draw the same numbers as the ranks
    try:
        return _judged(on_seed, world_size, timeout)
    finally:
        _seed[0] = _LESSON_SEED


def _judged(fn: Callable[[int, int], Any], world_size: int, timeout: float) -> Feedback:
    """:func:`tensor_parallel_mlp`'s verdict on ``fn``, already bound to the check's numbers and to
    :func:`_what_moved`: once the values are right, what the same runs moved is judged, size by size."""
    runs: list[list[Any]] = []  # every rank's report (_what_moved), in each run
    verdict = judge(fn, TENSOR_PARALLEL_MLP, world_size, timeout, runs=runs)
    if not verdict.ok:
        return verdict
    in_two_steps = False
    for size, reports in zip((world_size, world_size + 1), runs, strict=True):
        for rank, report in enumerate(reports):
            wrong = _judge_moves(size, rank, report)
            if wrong is not None:
                return Feedback(False, wrong)
            in_two_steps = in_two_steps or bool(report["scattered"])
        unequal = _unequal_shares(size, reports)
        if unequal is not None:
            return Feedback(False, unequal)
    if in_two_steps:
        return Feedback(True, f"Every rank holds the MLP's output, with {world_size} ranks and with {world_size + 1}: "
                              "column parallel (rows of up) then row parallel (columns of down), the split Megatron-LM "
                              "uses. Your reduce-scatter then all-gather of the summands is an all-reduce in its two "
                              "halves (section 5), the same bytes on a ring; one dist.all_reduce(y) does both in one "
                              "call.")
    return verdict
