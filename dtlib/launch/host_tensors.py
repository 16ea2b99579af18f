"""NCCL's device rule on a machine without a GPU: a tensor that a GPU machine would hold on the CPU is refused by
a collective, as NCCL refuses it there.

On a GPU machine each NCCL rank works on its own GPU, and NCCL takes only tensors on it: a tensor made without
``device=`` (``torch.tensor([rank])``, ``torch.zeros(n)``) or brought back with ``.cpu()`` sits in host memory,
and the collective fails ("No backend type associated with device type cpu"). On a laptop every tensor is on the
CPU, the rank's device included, so gloo accepts the same code and the mistake waits for the first GPU run.

:func:`watching` tracks, while it is on, which tensors the learner's own code made on the host: a factory called
without ``device=`` (``torch.zeros``, ``torch.tensor``, ``torch.arange``, ...), or ``.cpu()`` (which, as on a GPU,
now returns a copy), and every result computed from such tensors alone. A tensor made with ``device=`` (the rank's
device, ``dtlib.rank_device()``), moved with ``.to(device)``, made ``*_like`` an input or ``x.new_*``, stays on the
rank's device. Strict mode (:mod:`dtlib.launch.strict`) then refuses a host tensor in a collective or a transfer,
naming the call that made it. Only calls made from outside torch and dtlib are marked: torch's own host tensors
(DCP's, DDP's) are torch's business. Every checker runs answers this way (:mod:`dtlib.checks.skeleton`).

Example (inside a gloo rank under strict mode)::

    with watching():
        count = torch.tensor([3.0])   # no device=: on a GPU machine, in host memory
        dist.all_reduce(count)        # ValueError: ... NCCL refuses it ...
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._pytree import tree_flatten

#: The factories that make a tensor from nothing: without ``device=`` they make it in host memory, on any machine.
FACTORIES = frozenset({
    torch.tensor, torch.as_tensor, torch.asarray, torch.from_numpy, torch.frombuffer, torch.zeros, torch.ones,
    torch.empty, torch.full, torch.rand, torch.randn, torch.randint, torch.randperm, torch.arange, torch.linspace,
    torch.logspace, torch.eye, torch.empty_strided, torch.scalar_tensor,
})
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_DTLIB_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_MARK = "_dtlib_made_on_the_host"  # the attribute a host tensor carries: the call that made it, in words


def made_on_the_host(tensor: torch.Tensor) -> str | None:
    """The call that put ``tensor`` in host memory, as a GPU machine would have it ("torch.zeros without
    device="), or None for a tensor on the rank's device."""
    return getattr(tensor, _MARK, None)


def _learners(depth: int = 2) -> bool:
    """Whether the call being intercepted came from code that is neither torch's nor dtlib's."""
    name = sys._getframe(depth).f_code.co_filename
    return not (name.startswith(_TORCH_DIR) or name.startswith(_DTLIB_DIR))


def _mark(value: Any, how: str | None) -> None:
    for item in tree_flatten(value)[0]:
        if isinstance(item, torch.Tensor):
            try:
                setattr(item, _MARK, how)
            except (AttributeError, RuntimeError):  # a tensor that keeps no attributes (rare subclasses)
                pass


class HostTensors(TorchFunctionMode):
    """Marks the tensors the learner's code makes on the host, and what it computes from them alone. Strict mode
    (:mod:`dtlib.launch.strict`) treats a ``torch.distributed`` call this mode passes on as torch's own: those
    functions hand themselves to the mode, which calls them again."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.cpu and args and isinstance(args[0], torch.Tensor) and _learners():
            copy = args[0].clone()  # a GPU's .cpu() copies: the rank's tensor stays where it was
            _mark(copy, ".cpu()")
            return copy
        result = func(*args, **kwargs)
        if func in FACTORIES:
            if kwargs.get("device") is None and _learners():
                _mark(result, f"torch.{func.__name__} without device=")
            return result
        if func is torch.Tensor.to:
            target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
            if target is not None:  # "cpu" in so many words is the host; any other device is the rank's
                if result is args[0] and made_on_the_host(result) is not None and target != "cpu":
                    result = result.clone()  # a GPU's .to(device) copies a host tensor: the host one keeps its mark
                _mark(result, '.to("cpu")' if target == "cpu" and _learners() else None)
            return result
        inputs = [item for item in tree_flatten((args, kwargs))[0] if isinstance(item, torch.Tensor)]
        outputs = [item for item in tree_flatten(result)[0] if isinstance(item, torch.Tensor)]
        if not outputs or any(output is given for output in outputs for given in inputs):
            return result  # in place (a tensor returned as it came): it stays where it was
        hows = {made_on_the_host(item) for item in inputs}
        if inputs and None not in hows:  # computed from host tensors alone: on the host too
            _mark(result, sorted(hows)[0])
        return result


_watching = False


@contextlib.contextmanager
def watching() -> Iterator[None]:
    """Track host tensors (see the module's docstring) while the block runs; strict mode refuses them."""
    global _watching
    before, _watching = _watching, True
    try:
        with HostTensors():
            yield
    finally:
        _watching = before


@contextlib.contextmanager
def resumed() -> Iterator[None]:
    """Inside :func:`watching`, in code that torch calls back without the modes its caller had (autograd runs a
    tensor's hooks with none): watch again for the block. Nothing outside :func:`watching`."""
    if not _watching or any(isinstance(mode, HostTensors) for mode in _get_current_function_mode_stack()):
        yield
        return
    with HostTensors():
        yield


def refuse(name: str, arguments: dict[str, Any]) -> None:
    """A ValueError naming the first tensor argument of ``dist.<name>`` that a GPU machine would hold on the host,
    while :func:`watching` is on; nothing otherwise."""
    if not _watching:
        return
    for key, value in arguments.items():
        for tensor in tree_flatten(value)[0]:
            how = made_on_the_host(tensor) if isinstance(tensor, torch.Tensor) else None
            if how is not None:
                raise ValueError(
                    f"dist.{name}: {key} was made by {how}, so on a GPU machine it sits in host memory, and NCCL "
                    "takes only tensors on the rank's GPU: it refuses this call ('No backend type associated with "
                    "device type cpu'), where gloo on a laptop accepted it. Make it on the rank's device: "
                    "device=dtlib.rank_device(), or like your input (torch.zeros_like(x), x.new_zeros(n), "
                    "x.new_tensor([...]))")
