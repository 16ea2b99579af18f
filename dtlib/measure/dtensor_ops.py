"""DTensor's work in one CPU process: each operator with its inputs' placements, and each redistribution with the
collective it issues, read from torch's ``DebugMode`` while ``LocalTensorMode`` plays every rank of a mesh.

Live ranks show what each rank sent (``count_collectives``); this shows why: the operator whose placements forced a
redistribution, and which one. Both modes are private to torch (``torch.utils._debug_mode``, later
``torch.utils.debug_mode``; ``torch.distributed._local_tensor``): :func:`unavailable` says why they cannot be used
here, and :func:`trace` raises with that reason.

Example (a notebook cell; ``fn`` builds and runs with the mesh it is given, as a rank function would)::

    def mlp_step(mesh):
        mlp = parallelize_module(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)), mesh, plan)
        y = mlp(torch.randn(4, 16, requires_grad=True))
        dtensor_ops.note("backward")
        y.sum().backward()

    print(*dtensor_ops.trace(mlp_step, mesh_shape=(2,)), sep="\\n")
"""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

#: Left out: operators that only transpose, reshape or re-label a tensor (their placements follow from their
#: input's), with the placements DTensor gives their output, and those that wait for a collective already shown.
_QUIET = ("aten::detach(", "aten::t(", "aten::view(", "aten::transpose.int(", "aten::expand(", "aten::_unsafe_view(",
          "_c10d_functional::wait_tensor(", "_c10d_functional::_wrap_tensor_autograd(")
_GROUP = "ScriptObject <__torch__.torch.classes.c10d.ProcessGroup>"  # how torch prints a c10d op's group
_REDUCE_OP = "ScriptObject <__torch__.torch.classes.c10d.ReduceOp>"
_notes: list[list[tuple[int, str]]] = []  # the traces running now, innermost last: (operators so far, text)
_modes: list[Any] = []


def _debug_mode_class() -> Any:
    for name in ("torch.utils.debug_mode", "torch.utils._debug_mode"):
        try:
            return importlib.import_module(name).DebugMode
        except (ImportError, AttributeError):
            continue
    return None


def unavailable() -> str | None:
    """None where :func:`trace` works with this torch; otherwise why not, in one sentence."""
    if _debug_mode_class() is None:
        return "this torch has no DebugMode (torch.utils.debug_mode or torch.utils._debug_mode)"
    try:
        importlib.import_module("torch.distributed._local_tensor").LocalTensorMode  # noqa: B018 - a probe
    except (ImportError, AttributeError):
        return "this torch has no LocalTensorMode (torch.distributed._local_tensor)"
    if dist.is_initialized():
        return "a process group is already initialised in this process; trace plays every rank in a fake one"
    return None


def note(text: str) -> None:
    """Inside :func:`trace`'s ``fn``: a line ``-- text --`` at this point of the trace (say, where backward starts)."""
    if not _notes:
        raise RuntimeError("dtensor_ops.note is for inside trace's fn")
    _notes[-1].append((len(_modes[-1].operators), text))


def _record(func: Any, types: Any, args: tuple, kwargs: dict, result: Any) -> dict[str, str]:
    """A ``DebugMode`` record hook: for a collective, the name of its process group and its reduction, which torch
    prints as ``ScriptObject <...>`` for a c10d op (a functional op names its group by its last string)."""
    if getattr(func, "namespace", None) not in ("c10d", "_c10d_functional"):
        return {}
    if func.namespace == "_c10d_functional":
        return {"group": next((arg for arg in reversed(args) if isinstance(arg, str)), "")}
    seen = {}
    for arg in args:
        with contextlib.suppress(Exception):  # a torch that boxes them otherwise: the line keeps torch's text
            if str(arg) == _GROUP:
                seen["group"] = dist.ProcessGroup.unbox(arg).group_name
            elif str(arg) == _REDUCE_OP:
                seen["reduce_op"] = dist.ReduceOp.RedOpType(arg.op()).name.lower()  # 0 -> sum
    return seen


def _line(call: Any, dims: dict[str, str]) -> str | None:
    """A call as shown, or None for one left out: DTensor operators (an argument ``dt:``), collectives,
    redistributions and the placements an operator's output gets, indented by their depth. A collective's group
    is shown as the mesh dimension it spans where ``dims`` (group name -> dimension) names it, else as ``group``."""
    kind = type(call).__name__
    text = call.render([])
    if kind == "_OpCall":
        if text.startswith(_QUIET) or not ("dt:" in text or "c10d" in text):
            return None
    elif kind not in ("_RedistributeCall", "_OutputPlacementCall"):
        return None
    text = text.split("  ->  ")[0]  # what went in: torch prints what came out after "  ->  "
    record = getattr(call, "record", None) or {}
    dim = dims.get(record.get("group", ""))
    if dim and text.startswith("_c10d_functional::") and text.endswith(f", {record['group']})"):
        text = text[: -len(f"{record['group']})")] + f"{dim})"
    text = text.replace(_GROUP, dim or "group").replace(_REDUCE_OP, record.get("reduce_op", "reduce_op"))
    return "  " * call.call_depth + text


def trace(fn: Callable[[DeviceMesh], Any], mesh_shape: Sequence[int] = (2,),
          mesh_dim_names: Sequence[str] | None = None) -> list[str]:
    """Run ``fn(mesh)`` once in this process, every rank of a ``mesh_shape`` mesh played by ``LocalTensorMode`` on
    a fake process group, and return the lines of what DTensor did: each operator on DTensors with its inputs'
    placements (``dt: f32[4, 16]| S(1)``: the global shape, sharded on dimension 1), each redistribution
    (``P(sum)->R``) and the collective under it (``_c10d_functional::all_reduce``), its process group written as
    the mesh dimension it spans where ``mesh_dim_names`` names them (``all_reduce(t: f32[4, 16], sum, tp)``; on an
    unnamed mesh, ``group`` or the group's name). No bytes move and no process starts; the collectives are the ones
    live ranks would call. Raises ``RuntimeError`` with
    :func:`unavailable`'s reason where this torch cannot."""
    why = unavailable()
    if why:
        raise RuntimeError(f"dtensor_ops.trace cannot run: {why}")
    shape = tuple(mesh_shape)
    if not shape or not all(isinstance(size, int) and not isinstance(size, bool) and size >= 1 for size in shape):
        raise ValueError(f"mesh_shape must be a tuple of positive whole numbers, as (2,) or (2, 2), got {mesh_shape!r}")
    world_size = math.prod(shape)
    local_tensor_mode = importlib.import_module("torch.distributed._local_tensor").LocalTensorMode
    debug_mode = _debug_mode_class()
    hooks = getattr(debug_mode, "dispatch_hooks", None)  # record hooks: where absent, groups stay unnamed
    dist.init_process_group("fake", rank=0, world_size=world_size)
    try:
        with local_tensor_mode(world_size):
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=tuple(mesh_dim_names) if mesh_dim_names else None)
            dims = {mesh.get_group(name).group_name: name for name in mesh_dim_names or ()}  # this rank's groups
            with debug_mode(record_torchfunction=False) as mode, \
                    hooks(record_hook=_record) if hooks else contextlib.nullcontext():
                _modes.append(mode)
                _notes.append([])
                try:
                    fn(mesh)
                finally:
                    notes = _notes.pop()
                    _modes.pop()
    finally:
        dist.destroy_process_group()
    lines: list[str] = []
    shown_at: dict[int, bool] = {}  # depth -> whether the last operator at that depth is shown
    for index, call in enumerate(mode.operators):
        lines += [f"-- {text} --" for at, text in notes if at == index]
        shown = _line(call, dims)
        if type(call).__name__ == "_OpCall":
            shown_at[call.call_depth] = shown is not None
        elif type(call).__name__ == "_OutputPlacementCall" and not shown_at.get(call.call_depth - 1, True):
            shown = None  # the placements of an operator left out
        if shown is not None:
            lines.append(shown)
    lines += [f"-- {text} --" for at, text in notes if at >= len(mode.operators)]
    return lines
