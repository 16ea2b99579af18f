"""Checkers of how ranks are laid out, from numbers and names typed into a cell (no processes): the
micro-batches that keep a pipeline's bubble small (notebook 10), and a 2-D mesh laid on nodes (notebook 11).

Example: ``mesh_for_nodes((2, 4), ("dp", "tp"))`` passes: each tensor-parallel group stays inside a node.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import torch

from dtlib.checks.feedback import Feedback
from dtlib.checks.shapes import Extreme, judge_extreme
from dtlib.measure.stages import pipeline_bubble


def pipeline_micro_batches(answer: Any, stages: int = 4, target: float = 0.1, batch: int = 64) -> Feedback:
    """Notebook 10: the fewest micro-batches that split ``batch`` samples evenly, that a 1F1B schedule of
    ``stages`` ranks accepts (at least one per stage), and that keep it idle at most ``target`` of the time,
    :func:`pipeline_bubble`.

    Example: ``pipeline_micro_batches(16)`` says the bubble is still 3/19 = 16%.
    """
    if not 0 < target < 1:
        raise ValueError(f"target is the bubble's share, between 0 and 1 (0.1 for 10%), got {target!r}")
    bound = math.ceil((stages - 1) * (1 - target) / target - 1e-9)  # (p - 1) / (m + p - 1) <= target
    counts = [m for m in range(max(1, stages), batch + 1) if batch % m == 0]  # what a 1F1B step can take

    def allowed(count: int) -> str | None:
        if count < 1:
            return "A step needs at least one micro-batch."
        if count > batch or batch % count:
            return (f"{count} micro-batch{'es' if count != 1 else ''} do not split {batch} samples evenly: every "
                    "micro-batch must have the same size (the pipeline averages their gradients by dividing the "
                    f"sum by m), so choose a divisor of {batch}.")
        if count < stages:
            return (f"A 1F1B schedule needs at least one micro-batch per stage: with {count} on {stages} stages, "
                    "torch's Schedule1F1B refuses to start, and most ranks would wait anyway.")
        return None

    def fails(count: int) -> str:
        if pipeline_bubble(stages, batch) > target:
            return (f"No count of micro-batches that divides {batch} keeps the bubble at {target:.0%}: even {batch} "
                    f"leave {pipeline_bubble(stages, batch):.1%}. Ask for a larger batch, or fewer stages.")
        return (f"With {count} micro-batches the bubble is (p - 1) / (m + p - 1) = {stages - 1}/{count + stages - 1} "
                f"= {pipeline_bubble(stages, count):.1%}, above {target:.0%}: more micro-batches shrink it, because "
                "the p - 1 steps of filling and draining are shared by more of them.")

    def beaten(count: int, fewer: int) -> str:
        each = batch // count
        return (f"{count} micro-batches meet the target ({pipeline_bubble(stages, count):.1%}), but fewer do too: "
                f"each extra one makes every pass smaller (here {each} sample{'s' if each != 1 else ''}), which a GPU "
                "computes less efficiently, and sends one more message per stage. Find the fewest.")

    def right(count: int, fewer: int | None) -> str:
        each = batch // count
        batches, samples = f"micro-batch{'es' if count != 1 else ''}", f"sample{'s' if each != 1 else ''}"
        return (f"{count} {batches} of {each} {samples}: the bubble is {stages - 1}/{count + stages - 1} = "
                f"{pipeline_bubble(stages, count):.1%}. The bound alone asks m >= {bound}, and {count} is the fewest "
                f"at or above it that divides {batch}.")

    # The bubble only shrinks as m grows, so the next smaller count that a step can take is the one to beat.
    return judge_extreme(answer, Extreme(
        "micro-batches", allowed, lambda count: pipeline_bubble(stages, count) <= target,
        lambda count: max((m for m in counts if m < count), default=None), fails, beaten, right))


def _groups(shape: Sequence[int], dim: int) -> list[list[int]]:
    """The ranks of each group along ``dim`` of a mesh numbered as init_device_mesh numbers it (row-major)."""
    ranks = torch.arange(math.prod(shape)).reshape(tuple(shape))
    return [line.tolist() for line in ranks.movedim(dim, -1).reshape(-1, shape[dim])]


#: Words that say what a mesh dimension is for, when its name holds one ("tp", "fsdp", "dp_shard", "tensor").
#: Any distinct names are valid (init_device_mesh asks no more); the words only tell which dimension the learner
#: meant for which parallelism, and a dimension whose name says neither gets its role from the mesh's structure.
TP_NAME_WORDS = frozenset({"tp", "tensor", "tensorparallel", "mp", "model", "modelparallel"})
DP_NAME_WORDS = frozenset({"dp", "fsdp", "ddp", "hsdp", "data", "dataparallel", "shard", "replicate", "zero"})


def _mesh_role(name: str) -> str | None:
    """ "tp" or "dp" where the name says it ("dp_shard" -> "dp", "TP" -> "tp"), else None ("rows", "a", "dp_tp")."""
    words = set("".join(char if char.isalpha() else " " for char in name.lower()).split())
    says_tp, says_dp = bool(words & TP_NAME_WORDS), bool(words & DP_NAME_WORDS)
    return "tp" if says_tp and not says_dp else "dp" if says_dp and not says_tp else None


def _inside_nodes(shape: tuple[int, ...], dim: int, gpus_per_node: int) -> bool:
    return all(len({rank // gpus_per_node for rank in group}) == 1 for group in _groups(shape, dim))


def mesh_for_nodes(shape: Any, names: Any, nodes: int = 2, gpus_per_node: int = 4, tp_size: int = 4) -> Feedback:
    """Notebook 11: does ``init_device_mesh("cuda", shape, mesh_dim_names=names)`` give tensor parallelism groups
    of ``tp_size`` GPUs, each inside one node, and data parallelism (FSDP) across, on ``nodes`` nodes of
    ``gpus_per_node``?

    Any distinct names are right ("dp"/"tp", "fsdp"/"tp", "rows"/"cols"): the structure is judged. A name that
    says tensor or data parallelism (:data:`TP_NAME_WORDS`, :data:`DP_NAME_WORDS`) says which dimension the
    learner meant for which; where neither name says, the dimension of ``tp_size`` that stays inside nodes is
    the tensor-parallel one. Ranks are numbered node by node (torchrun: node n holds ranks n x g to n x g + g - 1),
    and the mesh fills them row-major: the last dimension's groups are runs of consecutive ranks. Example:
    ``mesh_for_nodes((4, 2), ("tp", "dp"))`` says which tp group crosses nodes.
    """
    if tp_size > gpus_per_node or gpus_per_node % tp_size:
        raise ValueError(f"tp groups of {tp_size} cannot each sit inside nodes of {gpus_per_node} GPUs: choose a "
                         "tp_size that divides gpus_per_node")
    sizes = tuple(shape) if isinstance(shape, tuple | list) else None
    if (sizes is None or not all(isinstance(size, numbers.Integral) and not isinstance(size, bool) for size in sizes)
            or not isinstance(names, tuple | list) or not all(isinstance(name, str) for name in names)):
        return Feedback(False, "Give the shape as a tuple of whole numbers, e.g. (2, 4), and the names as a tuple of "
                               "strings, e.g. (\"dp\", \"tp\").")
    shape, names = tuple(int(size) for size in sizes), tuple(names)
    world = nodes * gpus_per_node
    if len(set(names)) != len(names):  # init_device_mesh raises "Found repeated mesh_dim_name"
        return Feedback(False, f"The names {names} repeat one: init_device_mesh needs a different name for each "
                               "dimension (any names, e.g. (\"dp\", \"tp\")), and refuses these.")
    if len(names) != len(shape):  # init_device_mesh raises "should have same length"
        return Feedback(False, f"The shape {shape} has {len(shape)} dimension{'s' if len(shape) != 1 else ''} and "
                               f"names {names} name {len(names)}: init_device_mesh needs one name per dimension.")
    if len(shape) != 2:
        return Feedback(False, f"Give two dimensions, one for tensor parallelism and one for FSDP (names of your "
                               f"choice), got shape {shape} with names {names}.")
    if min(shape) < 1 or math.prod(shape) != world:
        return Feedback(False, f"A mesh of {shape} has {math.prod(shape)} ranks; the job has {nodes} x {gpus_per_node} "
                               f"= {world}: the sizes must be positive and multiply to the world size.")
    roles = [_mesh_role(name) for name in names]
    if roles[0] is not None and roles[0] == roles[1]:
        kind = "tensor" if roles[0] == "tp" else "data"
        return Feedback(False, f"Both names, \"{names[0]}\" and \"{names[1]}\", say {kind} parallelism, and the "
                               "exercise asks for one dimension of each: name them as you like, but let the names "
                               "say which one carries tensor parallelism and which FSDP.")
    if "tp" in roles or "dp" in roles:
        tp = roles.index("tp") if "tp" in roles else 1 - roles.index("dp")
        chosen = ""
    else:  # neither name says: the structure decides which dimension must carry tensor parallelism
        fitting = [dim for dim in (0, 1) if shape[dim] == tp_size]
        if not fitting:
            return Feedback(False, f"Neither dimension of {shape} has {tp_size} ranks: tensor parallelism over "
                                   f"{tp_size} GPUs needs a dimension of {tp_size}, and FSDP one of "
                                   f"{world // tp_size} for the rest.")
        tp = ([dim for dim in fitting if _inside_nodes(shape, dim, gpus_per_node)] or fitting)[-1]
        chosen = f"With \"{names[tp]}\" for tensor parallelism and \"{names[1 - tp]}\" for FSDP (your names do not " \
                 "say which is which, so the structure does). "
    tp_name, dp_name = names[tp], names[1 - tp]
    if shape[tp] != tp_size and shape[tp] <= gpus_per_node:
        ranks = f"{shape[tp]} rank{'s' if shape[tp] != 1 else ''}"
        other = f", and \"{dp_name}\" {tp_size}" if shape[1 - tp] == tp_size else ""
        return Feedback(False, f"This mesh makes tensor-parallel groups of {ranks}; the exercise asks for {tp_size} "
                               f"(each layer split over {tp_size} GPUs), and data parallelism over the rest. "
                               f"\"{tp_name}\" has size {shape[tp]}{other}.")
    if shape[tp] > gpus_per_node:
        return Feedback(False, f"A tensor-parallel group of {shape[tp]} ranks cannot fit in a node of {gpus_per_node} "
                               f"GPUs (\"{tp_name}\" has size {shape[tp]}): every one of its per-layer all-reduces "
                               "would cross the slow link between nodes.")
    for group in _groups(shape, tp):
        if len({rank // gpus_per_node for rank in group}) > 1:
            return Feedback(False, f"{chosen}The {tp_name} group {group} spans nodes "
                                   f"{sorted({r // gpus_per_node for r in group})}: ranks are numbered node by node, "
                                   f"and init_device_mesh fills its last dimension with consecutive ranks, so put "
                                   f"\"{tp_name}\" last to keep its groups inside a node.")
    dp_groups = _groups(shape, 1 - tp)
    across = ("crosses nodes: FSDP's all-gathers and reduce-scatters, once per layer in each pass and overlapped with "
              "compute on GPUs, take the slower link" if nodes > 1 else "stays in the one node too")
    return Feedback(True, f"{chosen}Each {tp_name} group ({_groups(shape, tp)[0]}, ...) is inside one node, on its "
                          f"fast links, and each {dp_name} group ({dp_groups[0]}, ...) {across}.")
