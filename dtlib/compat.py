"""The one place that knows torch versions differ.

Everything else in dtlib calls these helpers instead of branching on versions. The course supports torch
:data:`MIN_TORCH` to :data:`MAX_TORCH` (set-up refuses others; docs/results/torch_versions.md says what ran on
which). The notebooks teach torch 2.13's names; on an older torch, :func:`install` (run by ``import dtlib``)
adds the few the course uses that it lacks, each a thin spelling of the older call, and :func:`shims` names
them in one line each (notebook 00 prints them).
"""

from __future__ import annotations

import functools
import inspect
import socket
import time
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Logger
from torch.nn.parallel import DistributedDataParallel

#: The oldest torch the course runs on: what GPU images and cloud notebooks ship (2.11) is tested here.
MIN_TORCH = (2, 11)
#: The newest release the course knows of; a newer one may rename what the cells call.
MAX_TORCH = (2, 15)

#: Collectives torch 2.13 renamed: the name the course teaches -> the name older torch has.
RENAMED_COLLECTIVES = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}
#: The functional collectives' functions that 2.13 renamed alike (``torch.distributed._functional_collectives``,
#: where DTensor's redistributions come from): only ever named, never supplied.
RENAMED_FUNCTIONAL = {"all_gather_single": "all_gather_tensor", "reduce_scatter_single": "reduce_scatter_tensor",
                      "all_gather_single_autograd": "all_gather_tensor_autograd",
                      "reduce_scatter_single_autograd": "reduce_scatter_tensor_autograd"}
_OLD_TO_NEW = {old: new for renamed in (RENAMED_COLLECTIVES, RENAMED_FUNCTIONAL) for new, old in renamed.items()}
_installed: list[str] = []


def torch_version() -> tuple[int, int]:
    """``(major, minor)`` of the installed torch, e.g. ``(2, 13)`` for ``2.13.0+cpu``."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def supported(version: tuple[int, int] | None = None) -> str | None:
    """None where ``version`` (default: the installed torch) is in the supported range, else why not.

    Example: ``supported((2, 9))`` says that 2.9 is older than 2.11.
    """
    version = version or torch_version()
    low, high = (".".join(map(str, v)) for v in (MIN_TORCH, MAX_TORCH))
    if version < MIN_TORCH:
        return f"torch {version[0]}.{version[1]} is older than {low}, the oldest this course runs on ({low} to {high})"
    if version > MAX_TORCH:
        return (f"torch {version[0]}.{version[1]} is newer than {high}, the newest this course was checked on "
                f"({low} to {high})")
    return None


def current_name(call: str) -> str:
    """The name the course teaches for a ``torch.distributed`` call, whichever spelling ran.

    Example: ``current_name("all_gather_into_tensor")`` is ``"all_gather_single"``, and so is the functional
    ``current_name("all_gather_tensor")``; other names are unchanged.
    """
    return _OLD_TO_NEW.get(call, call)


def install() -> list[str]:
    """Give an older torch the 2.13 names the course's cells use; return a line for each (none on 2.13).

    Idempotent; ``import dtlib`` calls it, so every rank and the kernel see the same names. Each addition is the
    older call under the new name (``dist.all_gather_single`` is ``dist.all_gather_into_tensor``), and
    ``DistributedDataParallel(forward_sync_buffers=...)`` becomes ``broadcast_buffers=...`` with the buffers
    still broadcast from rank 0 at construction, as 2.13's ``forward_sync_buffers`` does.
    """
    if _installed:
        return list(_installed)
    version = ".".join(map(str, torch_version()))
    for new, old in RENAMED_COLLECTIVES.items():
        if not hasattr(dist, new) and hasattr(dist, old):
            setattr(dist, new, getattr(dist, old))
            _installed.append(f"torch {version} has no dist.{new} (new in 2.13): dtlib runs dist.{old} for it")
    _guard_ddp_construction_log()
    if _give_ddp_forward_sync_buffers():
        _installed.append(f"torch {version}'s DistributedDataParallel has no forward_sync_buffers (new in 2.13): "
                          "dtlib passes it as broadcast_buffers and syncs the buffers at construction")
    _installed.append("")  # marks the work done, even when nothing was missing
    return shims()


def shims() -> list[str]:
    """One line for each 2.13 name :func:`install` gave this older torch; empty on 2.13 and newer.

    Example: on torch 2.11, ``["torch 2.11 has no dist.all_gather_single (new in 2.13): ...", ...]``.
    """
    return [line for line in _installed if line]


def _guard_ddp_construction_log() -> None:
    """Skip DDP's construction log under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, where on gloo it kills the process.

    DETAIL wraps the process group to check each collective across ranks (live ranks turn it on). DDP's
    constructor then logs its settings through ``Logger.set_construction_data_and_log``, whose C++ casts the
    wrapped gloo group to ``ProcessGroupGloo`` to read its thread count: SIGSEGV on torch 2.11 and 2.13 alike
    (``tests/test_compat.py``). The log only records settings for torch's usage logging; nothing reads it back.
    """
    original = Logger.set_construction_data_and_log
    if getattr(original, "dtlib_guard", False):
        return

    def set_construction_data_and_log(self: Any, *args: Any, **kwargs: Any) -> None:
        if dist.get_debug_level() == dist.DebugLevel.DETAIL:
            return None
        return original(self, *args, **kwargs)

    set_construction_data_and_log.dtlib_guard = True  # type: ignore[attr-defined]
    Logger.set_construction_data_and_log = set_construction_data_and_log


def _give_ddp_forward_sync_buffers() -> bool:
    """Teach an older ``DistributedDataParallel`` the ``forward_sync_buffers`` keyword; False where it knows it."""
    original = DistributedDataParallel.__init__
    if "forward_sync_buffers" in inspect.signature(original).parameters:
        return False

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, forward_sync_buffers: bool | None = None, **kwargs: Any) -> None:
        if forward_sync_buffers is None:
            return original(self, *args, **kwargs)
        if kwargs.get("broadcast_buffers") is not None:
            raise TypeError("give forward_sync_buffers or broadcast_buffers, not both")
        original(self, *args, broadcast_buffers=forward_sync_buffers, **kwargs)
        if not forward_sync_buffers and kwargs.get("init_sync", True):
            # broadcast_buffers=False also skips the buffers' sync at construction; forward_sync_buffers does not.
            group = self.process_group
            source = dist.get_global_rank(group, 0) if group is not dist.GroupMember.WORLD else 0
            for buffer in self.module.buffers():
                dist.broadcast(buffer.data, src=source, group=group)

    DistributedDataParallel.__init__ = __init__  # type: ignore[method-assign]
    return True


def destroy_process_group(group: Any = None) -> None:
    """``dist.destroy_process_group(group)``, without the deadlock of torch 2.6 and 2.7.

    Before torch 2.8 (fixed by pytorch#154976), a gloo group's destructor waits for
    its worker threads while holding the GIL. A worker still releasing the tensors
    of a finished collective (``all_gather_object`` makes such temporaries) needs
    the GIL for that, so both wait for ever. Sleeping first hands the GIL to the
    workers. Measured on torch 2.6: init, ``all_gather_object``, destroy in a loop
    hung within 100 rounds without the pause and passed 600 rounds with it.
    """
    if torch_version() < (2, 8):
        time.sleep(0.05)  # releases the GIL so gloo's workers can drop their tensors
    dist.destroy_process_group(group)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op: Any = None,
                          group: Any = None, async_op: bool = False) -> Any:
    """Reduce-scatter one flat tensor: ``output`` gets this rank's reduced slice of ``input``.

    torch 2.13 renamed ``reduce_scatter_tensor`` to ``reduce_scatter_single`` and
    warns on the old name; older versions have only the old name.

    Example: with 2 ranks, ``input`` of 4 elements and ``output`` of 2, rank 1 gets
    the sum over ranks of ``input[2:4]``.
    """
    op = dist.ReduceOp.SUM if op is None else op
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=op, group=group, async_op=async_op)


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: Any = None,
                      async_op: bool = False) -> Any:
    """All-gather into one flat tensor (``all_gather_into_tensor`` before torch 2.13).

    Example: with 2 ranks each holding 2 elements, ``output`` (4 elements) ends as
    rank 0's elements followed by rank 1's.
    """
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def loopback_listener(backlog: int = 128) -> socket.socket:
    """A TCP socket listening on 127.0.0.1 only, on a free port: the rendezvous address.

    A TCPStore created the usual way listens on every interface. Binding the
    socket ourselves keeps it on loopback, and holding it from the start means no
    other process can take the port between choosing it and using it. Connections
    wait in the backlog until :func:`store_on` starts serving the socket.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(max(128, backlog))
    except BaseException:
        sock.close()
        raise
    return sock


def store_on(listener: socket.socket) -> dist.TCPStore:
    """Serve a rendezvous store on ``listener``, which the store owns from then on.

    The libuv store learned to serve a handed-over socket only in torch 2.8
    (pytorch#150215); before that, the older backend does it.
    """
    port = listener.getsockname()[1]
    return dist.TCPStore(
        "127.0.0.1",
        port,
        world_size=None,
        is_master=True,
        wait_for_workers=False,
        master_listen_fd=listener.detach(),  # closed by the store when it is deleted
        use_libuv=torch_version() >= (2, 8),
    )


def ddp_buffer_sync(enabled: bool) -> dict[str, bool]:
    """The DDP keyword that turns the buffer sync before each forward on or off.

    torch 2.13 deprecated ``broadcast_buffers`` (a FutureWarning) for
    ``forward_sync_buffers``; older versions have only ``broadcast_buffers``.

    Example: ``DistributedDataParallel(model, **ddp_buffer_sync(False))``.
    """
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": enabled}
    return {"broadcast_buffers": enabled}


def fsdp1_cpu_offload_state_dict_works() -> bool:
    """Whether FSDP1's documented full-state-dict route (``offload_to_cpu=True``) survives CPU ranks.

    Measured: torch 2.11 and 2.13 free the gathered flat parameter that ``.to("cpu")`` returned unchanged
    and crash (``setStorage ... out of bounds``); 2.15 works. 2.12 and 2.14 were not measured.
    """
    return torch_version() >= (2, 15)


#: FSDP2 on CPU tensors needs torch 2.7: 2.6's CPU Stream has no record_event (added by pytorch#145935).
FSDP2_ON_CPU = (2, 7)


def collective_check_works() -> bool:
    """Whether torch's DETAIL mode (each collective checked across ranks; live ranks turn it on) runs the course.

    On torch 2.11 the check's wrapper sends a DTensor's all-gather to gloo as ``allgather_into_tensor_coalesced``,
    which gloo lacks: ``full_tensor()`` raises "Backend gloo does not support allgather_into_tensor_coalesced".
    2.13 runs it; 2.12 was never tried here, so it is counted with 2.11 (``tests/test_compat.py`` runs the
    DTensor under DETAIL on the installed torch and holds this answer to it).
    """
    return torch_version() >= (2, 13)


def fsdp2_runs_on_cpu() -> bool:
    """True where ``fully_shard`` can train on the CPU with gloo (torch >= 2.7); GPUs need only 2.6."""
    return torch_version() >= FSDP2_ON_CPU


def gloo_has_avg() -> bool:
    """Whether the default group's backend accepts ``ReduceOp.AVG`` (gloo gained it after 2.7).

    A collective: every rank must call it. FSDP2's HSDP averages across replicas with AVG.
    """
    try:
        dist.all_reduce(torch.zeros(1), op=dist.ReduceOp.AVG)
        return True
    except (RuntimeError, ValueError) as err:
        if "AVG" not in str(err):
            raise
        return False


def fsdp_params(model: Any) -> list[Any]:
    """FSDP2's per-parameter states (``FSDPParam``) in every unit of ``model``; none where nothing is sharded.

    FSDP2 has no public view of the unsharded gradients it keeps between micro-batches while
    ``set_requires_gradient_sync(False)`` holds back the reduce-scatter, so :mod:`dtlib.measure` reads them here:
    each state's ``_unsharded_param.grad``, or ``unsharded_accumulated_grad`` when a ``reduce_dtype`` differs
    (torch 2.6 to 2.13).
    """
    found: list[Any] = []
    for module in model.modules():
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        group = getattr(state, "_fsdp_param_group", None)
        found += list(getattr(group, "fsdp_params", None) or [])
    return found
