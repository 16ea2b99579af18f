"""The expert-parallel exercise of notebook 13: a mixture-of-experts layer whose experts live round-robin.

Every rank gets the same router, ``nn.Linear(DIM, E, bias=False)``, its own :data:`TOKENS` tokens, and its
own experts as a dict ``{e: expert}``: expert ``e`` lives on rank ``e % p``, so with 8 experts on 3 ranks rank 0
holds experts 0, 3 and 6 and rank 2 holds 2 and 5. The learner's ``fn(x, router, experts, top_k, group)`` routes
each token to its ``top_k`` experts (softmax over the router's logits, the ``top_k`` largest, renormalised to sum
to 1), sends it to the ranks of those experts, runs them there and brings the outputs home, weighted by the
gates.

Right: on every rank, the output, the gradient of ``x``, this rank's share of the router's gradient and the
gradients of this rank's experts equal one process applying the whole layer to every rank's tokens; the
tokens travelled by all-to-all only, each assignment out once and each output home once.

Each check draws a new seed for the weights and tokens, and with it ``top_k`` (2 or 3, :func:`top_k_of`) and the
number of experts E (10, 14 or 16, :func:`experts_of`; the lesson's inputs keep 8), so no answer can rebuild another
rank's experts or tokens for itself or hard-code top-2 or 8 experts. Rank 0's tokens never choose the experts that
rank 1 holds at 3 ranks or at 4 (:func:`quiet_of`: 1, 4, 5 and 7 of 8), so with either it sends rank 1 nothing: an
empty split, which a plan assuming every pair of ranks exchanges tokens gets wrong.

Example: ``expert_parallel_moe(fn)``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import random
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtlib.checks.feedback import Feedback
from dtlib.checks.skeleton import UNREADABLE, Answer, RankExercise, judge, same_collectives_hang
from dtlib.errors import WorkerError
from dtlib.launch.device import rank_device
from dtlib.measure.counting import watching

DIM, HIDDEN, EXPERTS, TOP_K, TOKENS = 8, 16, 8, 2, 12
_SEED = 13  # moe_inputs' default; each check draws its own


def experts_of(seed: int) -> int:
    """How many experts the check drawn from ``seed`` has: the lesson's 8 for its own inputs, else 10, 14 or 16.
    Always more than 8: an answer that hard-codes the lesson's 8 then files two experts' tokens under one key,
    and fails every check (with fewer experts than it assumes, its grid of counts would only be larger). None
    divides by 3, so 3 ranks always hold uneven shares."""
    return EXPERTS if seed == _SEED else random.Random(seed + 1).choice((10, 14, 16))


def quiet_of(experts: int) -> tuple[int, ...]:
    """The experts rank 0's tokens never choose: those rank 1 holds at 3 ranks or at 4 (``e % p == 1``), so that
    at either size rank 0 sends rank 1 nothing. Of 8: (1, 4, 5, 7)."""
    return tuple(e for e in range(experts) if e % 3 == 1 or e % 4 == 1)


def top_k_of(seed: int) -> int:
    """How many experts each token goes to in the check drawn from ``seed``: 2 or 3, drawn with the weights, so
    that no answer can hard-code it (the lesson's own inputs, :func:`moe_inputs`' default seed, keep top-2)."""
    return TOP_K if seed == _SEED else random.Random(seed).choice((2, 3))


def owner(expert: int, world_size: int) -> int:
    """The rank that holds ``expert`` in this exercise's round-robin layout: ``expert % world_size``."""
    return expert % world_size


def _build(world_size: int, device: torch.device | str, seed: int) -> tuple[torch.Tensor, nn.Linear, list[nn.Module]]:
    """Every rank's tokens, the router and all the experts, the same in every process for one seed."""
    torch.manual_seed(seed)
    count = experts_of(seed)
    router = nn.Linear(DIM, count, bias=False)
    experts = [nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM)) for _ in range(count)]
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randn(world_size * TOKENS, DIM, generator=generator)
    quiet = torch.tensor(quiet_of(count))
    with torch.no_grad():
        fits = torch.empty(0, DIM)
        while len(fits) < TOKENS:  # about one random token in five avoids the quiet experts
            pool = torch.randn(16 * TOKENS, DIM, generator=generator)
            avoids = ~torch.isin(router(pool).topk(top_k_of(seed), dim=-1).indices, quiet).any(-1)
            fits = torch.cat([fits, pool[avoids]])
    tokens[:TOKENS] = fits[:TOKENS]
    torch.seed()  # a fresh random seed: torch.initial_seed() must not hand the check's seed to an answer
    return tokens.to(device), router.to(device), [expert.to(device) for expert in experts]


def moe_inputs(rank: int, world_size: int, device: torch.device | str | None = None, seed: int = _SEED
               ) -> tuple[torch.Tensor, nn.Linear, dict[int, nn.Module]]:
    """This rank's ``x`` (TOKENS, DIM), the router (the same on every rank) and this rank's experts,
    ``{e: expert}`` for every ``e`` with ``e % world_size == rank``, on ``device`` (default: the rank's own).

    Example: ``x, router, experts = moe_inputs(0, 3)``; ``sorted(experts) == [0, 3, 6]``.
    """
    device = rank_device() if device is None else device
    tokens, router, experts = _build(world_size, device, seed)
    mine = {e: expert for e, expert in enumerate(experts) if owner(e, world_size) == rank}
    return tokens.chunk(world_size)[rank].clone(), router, mine


def _probe(world_size: int, seed: int) -> torch.Tensor:
    """The weights of the loss, ``(y * probe).sum()``: every output number gets its own gradient."""
    return torch.randn(world_size * TOKENS, DIM, generator=torch.Generator().manual_seed(seed + 1))


def _layer(x: torch.Tensor, router: nn.Module, experts: Mapping[int, nn.Module], top_k: int = TOP_K,
           renormalise: bool = True, gated: bool = True, scored_detached: bool = False) -> torch.Tensor:
    """The mixture of experts in one process: each token's ``top_k`` experts, weighted by their gates (a wrong
    variant: the router scores ``x.detach()``, so x's gradient comes through the tokens alone)."""
    gates, chosen = router(x.detach() if scored_detached else x).softmax(-1).topk(top_k, dim=-1)
    if renormalise:
        gates = gates / gates.sum(-1, keepdim=True)
    y = torch.zeros_like(x)
    for e, expert in experts.items():
        token, slot = (chosen == e).nonzero(as_tuple=True)
        weight = gates[token, slot, None] if gated else 1.0
        y = y.index_add(0, token, weight * expert(x[token]))
    return y


def _grads(module: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().double().cpu() for p in module.parameters()]


def _traffic_bound(chosen: torch.Tensor, size: int) -> list[int]:
    """Per rank, the token rows an expert-parallel layer sends to other ranks in forward: each assignment
    whose expert lives elsewhere once, and each output of another rank's assignment home once."""
    owners = owner(chosen, size).view(size, -1)  # (rank, this rank's assignments)
    ranks = torch.arange(size).unsqueeze(1)
    out = (owners != ranks).sum(1)
    back = torch.stack([((owners == r) & (ranks != r)).sum() for r in range(size)])
    return (out + back).tolist()


def _expected(size: int, seed: int, **variant: Any) -> list[dict[str, Any]]:
    """Per rank, what one process gives: the output and the gradients (a variant: a known wrong layer). A copy
    of the kept one: no caller's edit in place reaches the next check's oracle."""
    return copy.deepcopy(_expected_kept(size, seed, **variant))


@functools.lru_cache(maxsize=32)
def _expected_kept(size: int, seed: int, top_k: int | None = None, **variant: bool) -> list[dict[str, Any]]:
    """What :func:`_expected` copies, kept per (size, seed, variant); ``top_k`` other than the check's is a
    variant too."""
    tokens, router, experts = _build(size, "cpu", seed)
    probe = _probe(size, seed)
    everyone = tokens.clone().requires_grad_(True)
    top_k = top_k_of(seed) if top_k is None else top_k
    (_layer(everyone, router, dict(enumerate(experts)), top_k, **variant) * probe).sum().backward()
    expert_grads = {e: _grads(expert) for e, expert in enumerate(experts)}
    bound = _traffic_bound(router(tokens).topk(top_k, dim=-1).indices, size)
    out = []
    for rank in range(size):
        router.zero_grad()
        x = tokens.chunk(size)[rank].clone().requires_grad_(True)
        y = _layer(x, router, dict(enumerate(experts)), top_k, **variant)
        (y * probe.chunk(size)[rank]).sum().backward()
        out.append({"y": y.detach().double(), "x_grad": x.grad.double(), "router_grad": _grads(router)[0],
                    "expert_grads": {e: g for e, g in expert_grads.items() if owner(e, size) == rank},
                    "bound": bound[rank], "seed": seed})
    return out


def _rows_to_others(op: str, args: tuple, rank: int, size: int) -> float:
    """Token rows' worth (floating-point elements / DIM) an all-to-all sends to ranks other than ``rank``,
    whatever their shape: flattening the tokens does not hide them. Integer tensors (counts, expert numbers)
    are not counted; a float per row beside the tokens (a gate) is allowed for by :func:`_over_bound`."""
    if op == "alltoall_":  # c10d's list form: (outputs, inputs, group, ...)
        return sum(t.numel() for i, t in enumerate(args[1]) if i != rank and t.is_floating_point()) / DIM
    tensor, splits = (args[0], args[2]) if op == "all_to_all_single" else (args[1], args[4])
    rows = tensor.shape[0] if tensor.dim() else 0
    if not tensor.is_floating_point() or rows == 0:  # nothing to send: an expert no token chose
        return 0
    own = list(splits)[rank] if splits else rows // size
    return (rows - own) * (tensor.numel() // rows) / DIM


def _over_bound(rows_sent: float, bound: int) -> bool:
    """Whether an answer sent more than expert parallelism needs: each needed row, and one float beside it."""
    return rows_sent > bound * (DIM + 1) / DIM + 1e-9


def _given(rank: int, world_size: int, seed: int) -> tuple[Any, ...]:
    """What the check hands rank ``rank`` alone, built in the checker's process: its tokens, the router, its own
    experts, its rows of the loss's weights and top_k. The seed stays behind: no frame an answer can reach in the
    rank holds it, or any other rank's tokens or experts."""
    x, router, experts = moe_inputs(rank, world_size, "cpu", seed=seed)
    return x, router, experts, _probe(world_size, seed).chunk(world_size)[rank].clone(), top_k_of(seed)


def _run(fn: Callable[..., Any], rank: int, world_size: int, given: tuple[Any, ...]) -> dict[str, Any]:
    """In a rank: call ``fn`` on this rank's inputs (:func:`_given`, moved to the rank's device), noting the token
    rows its all-to-alls send elsewhere, then back-propagate ``(y * probe).sum()`` through it."""
    device = rank_device()
    x, router, experts, probe, top_k = given
    x, router, probe = x.to(device), router.to(device), probe.to(device)
    experts = {e: expert.to(device) for e, expert in experts.items()}
    del given
    x.requires_grad_(True)
    sent = [0.0]

    def see(namespace: str, name: str, args: tuple) -> None:
        if (namespace, name) in (("_c10d_functional", "all_to_all_single"), ("c10d", "alltoall_base_"),
                                 ("c10d", "alltoall_")):
            sent[0] += _rows_to_others(name, args, rank, world_size)

    with watching(see):
        y = fn(x, router, experts, top_k, dist.group.WORLD)
    report: dict[str, Any] = {"rank": rank, "kind": type(y).__name__, "y": None, "rows_sent": sent[0]}
    if not isinstance(y, torch.Tensor):
        return report
    report.update(dtype=str(y.dtype).removeprefix("torch."), shape=tuple(y.shape), requires_grad=y.requires_grad)
    if y.shape != x.shape or not y.is_floating_point():
        return report
    if y.requires_grad:
        (y * probe.to(y.device)).sum().backward()
    report.update(y=y.detach().double().cpu(), x_grad=None if x.grad is None else x.grad.double().cpu(),
                  router_grad=_grads(router)[0], expert_grads={e: _grads(m) for e, m in experts.items()})
    return report


#: How far a right float32 result may be from one process's, per tensor, in units of float32's epsilon times the
#: tensor's largest magnitude: the model answer on 2 to 4 ranks stayed under 2.3 in 1,308 comparisons (8 draws);
#: an output rounded to 4 decimals is hundreds of units off, one computed in 16 bits thousands.
FLOAT32_UNITS = 16


def _close(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """``a`` is ``b`` at float32's precision: the same shape, every number within :data:`FLOAT32_UNITS`."""
    if a is None or b is None or a.shape != b.shape:
        return False
    bound = FLOAT32_UNITS * torch.finfo(torch.float32).eps * b.abs().max().item() if b.numel() else 0.0
    return bool(((a - b).abs() <= bound).all())


def _close_grad(got: torch.Tensor | None, want: torch.Tensor) -> bool:
    """A gradient never computed (an expert no token chose, never called) counts as zeros."""
    return _close(torch.zeros_like(want) if got is None else got, want)


def _read(value: Any) -> Any:
    return value if isinstance(value, dict) and value.get("y") is not None else UNREADABLE


def _same_output(value: Mapping[str, Any], expected: Sequence[Mapping[str, Any]]) -> bool:
    return _close(value["y"], expected[value["rank"]]["y"])


def _experts_right(value: Mapping[str, Any], expected: Sequence[Mapping[str, Any]]) -> bool:
    mine = expected[value["rank"]]["expert_grads"]
    return value["expert_grads"].keys() == mine.keys() and all(
        _close_grad(got, want) for e in mine for got, want in zip(value["expert_grads"][e], mine[e], strict=True))


def _same(value: Mapping[str, Any], expected: Sequence[Mapping[str, Any]]) -> bool:
    """Outputs and every gradient as one process's (the traffic is judged apart, see :func:`_within_bound`)."""
    want = expected[value["rank"]]
    return (_same_output(value, expected) and _close(value["x_grad"], want["x_grad"])
            and _close(value["router_grad"], want["router_grad"]) and _experts_right(value, expected))


def _within_bound(value: Mapping[str, Any], expected: Sequence[Mapping[str, Any]]) -> bool:
    return _same(value, expected) and not _over_bound(value["rows_sent"], expected[value["rank"]]["bound"])


def _misplaced(size: int, seed: int, how: str) -> list[torch.Tensor]:
    """Per rank, the output when the outputs come home sorted by destination and are not put back in their
    tokens' rows (``how="kept sorted"``), or are put back with the order itself instead of its inverse
    (``how="wrong inverse"``, ``y_sorted = back[order]``). A copy of the kept one, as :func:`_expected`'s."""
    return copy.deepcopy(_misplaced_kept(size, seed, how))


@functools.lru_cache(maxsize=32)
def _misplaced_kept(size: int, seed: int, how: str) -> list[torch.Tensor]:
    """What :func:`_misplaced` copies, kept per (size, seed, how)."""
    tokens, router, experts = _build(size, "cpu", seed)
    top_k, out = top_k_of(seed), []
    with torch.no_grad():
        for rank in range(size):
            x = tokens.chunk(size)[rank]
            gates, chosen = router(x).softmax(-1).topk(top_k, dim=-1)
            gates = gates / gates.sum(-1, keepdim=True)
            flat = chosen.flatten()
            order = ((flat % size) * len(experts) + flat).argsort(stable=True)
            outputs = torch.stack([experts[int(e)](x[a // top_k]) for a, e in enumerate(flat)])
            arrived = outputs[order]  # what comes home, in the order it was sent
            y_flat = arrived if how == "kept sorted" else arrived[order]
            out.append((gates.unsqueeze(-1) * y_flat.view(len(x), top_k, -1)).sum(1).double())
    return out


def _misplaced_as(how: str) -> Callable[[Answer], bool]:
    return lambda a: _close(a.value["y"], _misplaced(a.size, a.expected[0]["seed"], how)[a.rank])


def _like(**variant: bool) -> Callable[[Answer], bool]:
    return lambda a: _close(a.value["y"], _expected(a.size, a.expected[0]["seed"], **variant)[a.rank]["y"])


def _other_top_k(a: Answer) -> int | None:
    """The number of experts per token that the answer used where the check asked for another, or None."""
    seed = a.expected[0]["seed"]
    return next((k for k in (1, 2, 3, 4) if k != top_k_of(seed)
                 and _close(a.value["y"], _expected(a.size, seed, top_k=k)[a.rank]["y"])), None)


def _right_output(a: Answer) -> bool:
    return a.value is not UNREADABLE and _same_output(a.value, a.expected)


def _returned(a: Answer) -> str:
    report = a.returned
    if report.get("shape") is None:
        return f"a {report['kind']}"
    return f"a {report['dtype']} tensor of shape {report['shape']}"


def _near_miss(a: Answer) -> str | None:
    """The first of the rank's results that is one process's to a 16-bit float's precision (1%) but not to
    float32's, named with how far off it is: a step rounded, or ran in bf16 or fp16. None for any other answer."""
    if a.value is UNREADABLE:
        return None
    value, want = a.value, a.expected[a.rank]
    results = [("outputs", value["y"], want["y"]), ("x's gradient", value["x_grad"], want["x_grad"]),
               ("router's gradient", value["router_grad"], want["router_grad"])]
    results += [(f"expert {e}'s gradients", got, ref) for e in want["expert_grads"]
                for got, ref in zip(value["expert_grads"].get(e, ()), want["expert_grads"][e], strict=False)]
    for name, got, ref in results:
        if _close(got, ref):
            continue
        if got is None or ref is None or got.shape != ref.shape or not ref.numel():
            return None
        scale, off = ref.abs().max().item(), (got - ref).abs().max().item()
        if off > 1e-2 * scale:
            return None
        allowed = FLOAT32_UNITS * torch.finfo(torch.float32).eps * scale
        return (f"Rank {a.rank}'s {name} are one process's to a 16-bit float's precision, not to float32's: off by "
                f"up to {off:.2g}, where float32's rounding allows {allowed:.2g}. A step rounded its numbers, or ran "
                "in bf16 or fp16 (a cast, a 16-bit all-to-all): keep the tokens and their outputs in float32.")
    return None


def _router_scored_others(a: Answer) -> bool:
    """Right outputs, a router gradient that is not this rank's own, and yet the ranks' router gradients sum to the
    whole job's: the gates of every token were computed on every rank, each rank's for its own experts (a gather
    of the tokens, whose bytes can stay within the bound when nearly every assignment goes elsewhere)."""
    if a.value is UNREADABLE or not _same_output(a.value, a.expected):
        return False
    got, want = a.value["router_grad"], a.expected[a.rank]["router_grad"]
    grads = [value["router_grad"] if value is not UNREADABLE else None for value in a.values]
    if got is None or _close(got, want) or any(grad is None or grad.shape != want.shape for grad in grads):
        return False
    total, expected = sum(grads), sum(e["router_grad"] for e in a.expected)
    return bool(torch.allclose(total, expected, rtol=0, atol=1e-4 * expected.abs().max().item()))


HINTS: list[tuple[Callable[[Answer], bool], Callable[[Answer], str]]] = [
    (lambda a: a.value is UNREADABLE,
     lambda a: f"Rank {a.rank} returned {_returned(a)}: return the outputs of this rank's own tokens, a float tensor "
               f"shaped like x, ({TOKENS}, {DIM}), in x's order."),
    (lambda a: _excess(a.calls) is not None,
     lambda a: _excess(a.calls) or ""),
    (lambda a: _near_miss(a) is not None, lambda a: _near_miss(a) or ""),
    (lambda a: _right_output(a) and _over_bound(a.value["rows_sent"], a.expected[a.rank]["bound"]),
     lambda a: f"Right outputs, but rank {a.rank}'s all-to-alls sent {a.value['rows_sent']:.0f} token rows to other "
               f"ranks where expert parallelism needs {a.expected[a.rank]['bound']}: each assignment whose expert "
               "lives elsewhere goes out once, to that expert's rank, and each output of another rank's token goes "
               "home once. Sending every token to every rank is an all-gather, whatever the call is named."),
    (lambda a: _same_output(a.value, a.expected) and not a.returned["requires_grad"],
     lambda a: f"Rank {a.rank}'s outputs are right but carry no gradient: nothing could train the experts or the "
               "router. dist.all_to_all_single writes into a tensor that autograd does not track; move the tokens "
               "both ways with all_to_all_single_autograd (torch.distributed._functional_collectives), whose "
               "backward is the all-to-all the other way."),
    (lambda a: _same_output(a.value, a.expected) and not _experts_right(a.value, a.expected),
     lambda a: f"Rank {a.rank}'s outputs are right, but its experts' gradients are not "
               f"({_expert_grads_said(a)}): the way back must carry gradients to the experts. Bring the outputs "
               "home with all_to_all_single_autograd, not dist.all_to_all_single, and do not detach them."),
    (_router_scored_others,
     lambda a: f"Rank {a.rank}'s outputs are right, but its router's gradient is not its own tokens', although the "
               "ranks' router gradients add up to the whole job's: its router scored other ranks' tokens, for its own "
               "experts, as after an all-gather of the tokens. Expert parallelism scores each token once, on the rank "
               "that holds it, and sends it to its experts' ranks with an all-to-all: sending every token to every "
               "rank is an all-gather, whatever the call is named."),
    (lambda a: _same_output(a.value, a.expected)
     and not _close(a.value["router_grad"], a.expected[a.rank]["router_grad"]),
     lambda a: f"Rank {a.rank}'s outputs and its experts' gradients are right, but the router's gradient is not: "
               "compute the gates on this rank, from router(x), and keep them in the graph (no detach, no "
               "torch.no_grad)."),
    (lambda a: _same_output(a.value, a.expected) and _close(
        a.value["x_grad"], _expected(a.size, a.expected[0]["seed"], scored_detached=True)[a.rank]["x_grad"]),
     lambda a: f"Rank {a.rank}'s outputs are right, but the gradient of its tokens is not: it reaches x only through "
               "the tokens that went to the experts, not through the router. Score router(x) itself, not x.detach() "
               "(nor under torch.no_grad): the gates depend on x, and backward must go through them too."),
    (lambda a: _same_output(a.value, a.expected) and not _close(a.value["x_grad"], a.expected[a.rank]["x_grad"]),
     lambda a: f"Rank {a.rank}'s outputs are right, but the gradient of its tokens is not: it reaches x only through "
               "the router. The tokens must leave with all_to_all_single_autograd too, so that their gradients come "
               "back from the experts' ranks in backward."),
    (lambda a: _other_top_k(a) is not None,
     lambda a: f"Rank {a.rank} sent each token to {_other_top_k(a)} experts, but this check asked for top_k="
               f"{top_k_of(a.expected[0]['seed'])}: use the top_k argument, which each check draws anew (2 or 3), "
               "not a fixed number."),
    (_misplaced_as("kept sorted"),
     lambda a: f"Rank {a.rank} used the outputs in the order they came home, sorted by destination: put each back "
               "in its token's slot first, with the inverse of the sort (y_sorted[order] = back)."),
    (_misplaced_as("wrong inverse"),
     lambda a: f"Rank {a.rank} put the outputs back with the sort's order itself (back[order]): that sorts them a "
               "second time. The inverse writes through the order: y_sorted[order] = back."),
    (_like(gated=False),
     lambda a: f"Rank {a.rank} added its experts' outputs without their gates: weight each expert's output by "
               "the token's gate for that expert before adding them."),
    (_like(renormalise=False),
     lambda a: f"Rank {a.rank} weighted the experts by the softmax's probabilities as they are: renormalise each "
               "token's top-k gates to sum to 1 (gates / gates.sum(-1, keepdim=True)), as one process does."),
]


def _expert_grads_said(a: Answer) -> str:
    got = a.value["expert_grads"]
    if all(g is None for grads in got.values() for g in grads):
        return "none at all"
    return "some differ from one process's"


def _your_line(traceback: str) -> str:
    """Where the traceback last ran the learner's code (neither dtlib's nor torch's), as " (at line N of NAME)":
    the function and its line, not the kernel's file for the cell (``/tmp/ipykernel_.../...py``), or ""."""
    frames = [line.strip() for line in traceback.splitlines() if line.strip().startswith("File ")]
    mine = [f for f in frames if "/dtlib/" not in f and "/torch/" not in f and "multiprocessing" not in f]
    if not mine:
        return ""
    found = re.search(r'line (\d+), in (\S+)', mine[-1])
    return f" (at line {found[1]} of {found[2]})" if found else ""


def _plain(said: str) -> str:
    """An error's own words without the C++ source path gloo or c10d put before them ("[enforce fail at
    /__w/pytorch/.../alltoall.cc:29] "): code the learner never wrote, on a machine they never saw."""
    return re.sub(r"\[enforce fail at [^\]]*\]\s*", "", said).strip()


def _failure(err: WorkerError, experts: int = EXPERTS) -> str:
    """What a raising answer did wrong, with ``experts``, the number this check drew, in its examples."""
    failure = err.cause()
    said = failure.headline()
    last = _plain(said.splitlines()[-1]) if said else ""
    where = _your_line(failure.traceback)
    if "KeyError" in said:
        return (f"A rank looked up an expert it does not hold ({last}){where}. Here expert e lives on rank e % p "
                f"(with this check's {experts} experts on 3 ranks, rank 0 holds 0, 3, 6, ...): send each token to "
                "owner = expert % world_size, and on arrival look its expert up by its global number.")
    # gloo's own words before torch 2.15; 2.15's functional all-to-all refuses the tensor first, in its own
    if any(words in said for words in ("in->size % context->size", "divisible", "does not divide equally")):
        return (f"An all-to-all without split sizes needs a first dimension that divides by the ranks ({last})"
                f"{where}: a rank's tensor did not (this check's {experts} experts give {experts} counts, which do "
                "not split over 3 ranks). Lay the counts out as a grid, one row of E counts per "
                "destination rank (p x E numbers, zeros included, E = router.out_features), so that each rank "
                "receives E counts from every rank.")
    if "split" in said.lower() or "alltoall" in said.lower() or "all_to_all" in said.lower():
        return (f"The all-to-all's sizes did not fit on a rank ({last}){where}. What rank i sends to rank j must be "
                "what j expects from i: exchange the counts first (all_to_all_single of a tensor of counts), and "
                f"pass them as output_split_sizes; with this check's {experts} experts on 3 ranks the ranks hold "
                f"{', '.join(str(len(range(r, experts, 3))) for r in range(3))}, and a rank may send nothing to "
                "another, so no count may assume an equal or a nonzero share.")
    return f"Your function raised on a rank{where}:\n{said}"


def _excess(calls: Sequence[dict[str, int]]) -> str | None:
    for rank, counted in enumerate(calls):
        other = sorted(name for name, times in counted.items() if times and name not in ("all_to_all_single",
                                                                                          "all_to_all"))
        if other:
            return (f"Rank {rank} moved data with {', '.join(other)}: expert parallelism sends each token only to "
                    "the ranks of its experts and brings the outputs back the same way, with all-to-alls, and the "
                    "counts too (each rank needs only what is sent to it). A gather or an all-reduce moves every "
                    "rank's data to every rank.")
    return None


EXPERT_PARALLEL_MOE = RankExercise(
    expected=_expected,  # bound to a seed, with the inputs, by expert_parallel_moe
    read=_read,
    same=_within_bound,
    hints=HINTS,
    otherwise=lambda a: (
        f"With {a.size} ranks, rank {a.rank}'s outputs differ from one process's by up to "
        f"{(a.value['y'] - a.expected[a.rank]['y']).abs().max().item():.3g}. Check the three steps: each token goes "
        "to the ranks of its top-k experts (expert e on rank e % p), each arriving token meets its own expert "
        "there, and each output comes home to its token's row, weighted by its gate. This check drew "
        f"{experts_of(a.expected[0]['seed'])} experts and top_k={top_k_of(a.expected[0]['seed'])}: take them from "
        "router.out_features and top_k, not from the lesson's 8 and 2."),
    no_collective=lambda rank, expected, calls: (
        f"Rank {rank} has the right outputs but communicated nothing: it cannot hold every expert. Send the tokens "
        "to the experts' ranks with an all-to-all."),
    right=lambda first, second, values: (
        f"With {first} ranks and with {second}, every rank's outputs and gradients equal one process's: tokens "
        "dispatched to their experts' ranks and brought back by all-to-alls that carry gradients, with experts "
        "spread round-robin, however unevenly they divide."),
    hang=same_collectives_hang,
    failure=_failure,
    excess=_excess,
)


def expert_parallel_moe(fn: Callable[..., Any], world_size: int = 3, timeout: float = 60.0,
                        seed: int | None = None) -> Feedback:
    """Notebook 13: ``fn(x, router, experts, top_k, group)`` is the expert-parallel layer of this module's
    docstring; it runs on ``world_size`` ranks and on one more (by default 3 and 4), with a number of experts and a
    ``top_k`` drawn for each check (:func:`experts_of`, :func:`top_k_of`), so the ranks hold uneven shares.

    Each wrong answer is named: outputs without gradients (``dist.all_to_all_single`` for the tokens), gradients
    that miss the experts or the tokens, outputs in sorted order, gates left out or not renormalised, an expert
    looked up on the wrong rank, split sizes that assume equal shares, and tokens moved by gathers or all-reduces.
    """
    if not callable(fn):
        return Feedback(False, f"Pass your function itself, not {type(fn).__name__}.")
    seed = random.randrange(2**31) if seed is None else seed
    exercise = dataclasses.replace(
        EXPERT_PARALLEL_MOE, expected=lambda inputs: _expected(len(inputs), seed),
        inputs=lambda size, generator: [_given(rank, size, seed) for rank in range(size)],
        failure=lambda err: _failure(err, experts_of(seed)))
    return judge(functools.partial(_run, fn), exercise, world_size, timeout)
