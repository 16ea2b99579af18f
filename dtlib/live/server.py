"""The loop each live rank runs (see :class:`dtlib.LiveRanks`): take a command, do it in this
rank's namespace, answer.

A live rank is a :func:`dtlib.spawn` rank whose function, :func:`serve`, does not return until
it is told to. It talks to the kernel over two two-way channels (:func:`dtlib.launch.worker.channels`):

- ``commands``: ``(number, kind, body)`` in, one answer out per command, with the command's number:
  ``(number, "ok", pickled value)`` or ``(number, "error", details)``. Kinds: ``"run"`` (code, its cell
  number and whether to step), ``"push"`` (pickled names), ``"pull"`` (a name), ``"peek"`` (an expression),
  ``"exit"``. A stepped cell also answers ``(number, "paused", pickled Call)`` before each collective and then
  takes ``"step"``, ``"continue"``, ``"abort"``, ``"peek"`` and ``"pull"`` (:class:`dtlib.live.stepper.Pauses`).
  The first message out is ``(0, "ready", None)``. The kernel counts only a rank's answer to the newest command
  it sent that rank, so a rank's late answer to a cell the kernel gave up on is never read as the next cell's.
- ``doctor``: a question (any bytes) in, ``(question, the rank's newest collective)`` out
  (:func:`dtlib.live.doctor.last_collectives`), with what :class:`CallNotes` noted beside the Flight Recorder; a
  question that starts with ``where`` gets the main thread's Python stack instead (:func:`main_stack`). A thread
  answers it, so it is answered while the main thread waits inside a collective.

SIGINT raises KeyboardInterrupt only while a cell's code runs; it is ignored between cells.
"""

from __future__ import annotations

import ast
import linecache
import os
import pickle
import signal
import sys
import threading
import traceback
from contextlib import nullcontext
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist
from torch import nn

from dtlib.errors import collective_mismatch
from dtlib.launch import pickling
from dtlib.launch.device import rank_device
from dtlib.launch.worker import channels, describe, dumps_result
from dtlib.live.doctor import last_collectives
from dtlib.live.notes import CallNotes
from dtlib.live.pushed import rebuild_on_rank
from dtlib.live.stepper import PauseBeforeCollectives, Pauses

CELL_FILENAME = "<rank cell {number}>"


@dataclass(frozen=True)
class RemoteRepr:
    """A rank's value that could not be sent back (a module holding a process group, a lock): its ``repr``."""

    text: str
    type_name: str

    def __repr__(self) -> str:
        return self.text


class _Interrupts:
    """SIGINT as KeyboardInterrupt while user code runs, nothing otherwise."""

    def __init__(self) -> None:
        self.armed = False
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.armed:
            self.armed = False  # once: a second signal during the unwinding must not hit our own code
            raise KeyboardInterrupt


def _namespace(rank: int, world_size: int) -> dict[str, Any]:
    """What every rank's namespace starts with: ``rank``, ``world_size``, ``device``, ``torch``, ``dist``, ``nn``."""
    return {"__name__": "__main__", "__builtins__": __builtins__, "rank": rank, "world_size": world_size,
            "device": rank_device(), "torch": torch, "dist": dist, "nn": nn}


def run_cell(code: str, number: int, namespace: dict[str, Any]) -> Any:
    """Run ``code`` in ``namespace`` as IPython runs a cell: the value of a last bare expression, else None.

    The source goes into :mod:`linecache` under ``<rank cell N>``, so tracebacks show its lines.
    Example: ``run_cell("x = 2\\nx * 3", 1, {})`` is 6.
    """
    filename = CELL_FILENAME.format(number=number)
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    tree = ast.parse(code, filename)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, filename, "exec"), namespace)  # noqa: S102 - running the learner's cell is the point
    return None if last is None else eval(compile(last, filename, "eval"), namespace)  # noqa: S307


def _error(exc: BaseException) -> dict[str, str]:
    """The error's details, its traceback starting at the learner's cell (dtlib's frames left out)."""

    tb = exc.__traceback__
    while tb is not None and not tb.tb_frame.f_code.co_filename.startswith("<rank cell"):
        tb = tb.tb_next
    message = describe(exc)
    message = collective_mismatch(message) or message  # the collective check's error in a line; torch's: below
    try:
        text = "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))
    except BaseException:  # noqa: BLE001 - a broken exception must still be reported
        text = f"{type(exc).__qualname__}: {message}\n"
    return {"type": type(exc).__qualname__, "module": type(exc).__module__, "message": message, "traceback": text}


#: Frames a stack shown to a learner leaves out: wrappers and dtlib's own plumbing, not the calls they wrap.
_NOT_SHOWN = tuple(os.path.join(*parts) for parts in (
    ("dtlib", "launch", "strict.py"), ("distributed", "c10d_logger.py"), ("torch", "_compile.py"),
    ("_dynamo", "eval_frame.py"), ("torch", "_ops.py"), ("utils", "_python_dispatch.py"),
    ("utils", "_contextlib.py"), ("multiprocessing", "connection.py")))


def main_stack(limit: int = 12) -> str:
    """The main thread's Python stack from the innermost line of a cell inward (torch's frames included, dtlib's
    plumbing left out), innermost last; ``""`` between cells. Read from another thread: it works while the main
    thread waits inside gloo or NCCL."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    cells = [index for index, frame in enumerate(frames) if frame.f_code.co_filename.startswith("<rank cell")]
    if not cells:
        return ""
    paused = any(frame.f_code.co_filename.endswith(os.path.join("live", "stepper.py"))
                 and frame.f_code.co_name == "__call__" for frame in frames)  # inside Pauses.__call__: held
    inner = [frame for frame in frames[:cells[-1] + 1] if not frame.f_code.co_filename.endswith(_NOT_SHOWN)
             and os.sep + os.path.join("dtlib", "live") + os.sep not in frame.f_code.co_filename]
    lines = []
    for frame in reversed(inner[:limit]):
        filename = frame.f_code.co_filename
        shown = filename.rsplit("site-packages" + os.sep, 1)[-1]
        shown = "dtlib" + shown.rsplit(os.sep + "dtlib", 1)[-1] if os.sep + "dtlib" + os.sep in shown else shown
        lines.append(f'  File "{shown}", line {frame.f_lineno}, in {frame.f_code.co_name}')
        source = linecache.getline(filename, frame.f_lineno).strip()
        if source:
            lines.append(f"    {source}")
    if paused:
        lines.append("  (paused by %ranks --step before this call runs)")
    return "\n".join(lines)


def _answer_doctor(doctor: Connection, notes: CallNotes) -> None:
    while True:
        try:
            asked = doctor.recv_bytes()
            if asked.startswith(b"where"):
                doctor.send_bytes(pickle.dumps((asked, main_stack())))
                continue
            doctor.send_bytes(pickle.dumps((asked, last_collectives(notes.arguments, notes.members, notes.raised,
                                                                    notes.entries()))))
        except (EOFError, OSError):
            return


def _holds_the_group(value: Any) -> bool:
    """Whether ``value`` is a wrapper that holds the ranks' process group (DDP, FSDP1): it pickles here, then
    could not be rebuilt in the kernel."""
    kinds = (getattr(sys.modules.get("torch.nn.parallel.distributed"), "DistributedDataParallel", None),
             getattr(sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel"),
                     "FullyShardedDataParallel", None))  # loaded wherever such a value exists: nothing to import
    return any(kind is not None and isinstance(value, kind) for kind in kinds)


def _value(value: Any) -> bytes:
    """The pickled value; one that cannot travel is sent as its ``repr``, marked so."""

    if _holds_the_group(value):  # it would pickle here, then fail to unpickle in the kernel, with no word on why
        name = type(value).__name__
        return dumps_result(RemoteRepr(f"{value!r}\n# a {name} holds the ranks' process group, which cannot leave "
                                       "its rank: pull what it wraps instead (model.module, or its state_dict())",
                                       name))
    try:
        return dumps_result(value)
    except Exception:  # noqa: BLE001 - e.g. a module or a DDP-wrapped model: show it, do not fail the cell
        try:
            text = repr(value)
        except Exception:  # noqa: BLE001
            text = f"<{type(value).__qualname__} whose repr() failed>"
        return dumps_result(RemoteRepr(text, type(value).__qualname__))


def _do(kind: str, body: Any, namespace: dict[str, Any], interrupts: _Interrupts,
        notes: CallNotes, pauses: Pauses | None = None) -> tuple[str, Any]:
    try:
        if kind == "run":
            code, number = body[:2]
            notes.raised = None
            interrupts.armed = True
            mode = PauseBeforeCollectives(pauses) if pauses is not None else None
            try:
                with mode if mode is not None else nullcontext():
                    value = run_cell(code, number, namespace)
            finally:
                interrupts.armed = False
            # A stepped cell's end says how many collectives the rank ran, those after continue included.
            return "ok", (_value(value), mode.count) if mode is not None else _value(value)
        if kind == "push":
            data, sources = body
            pickling.install_sources(sources)
            pushed = cloudpickle.loads(data)
            for name, value in pushed.items():  # every rank rebuilds, in the same order: meshes are collective
                pushed[name] = rebuild_on_rank(value, dist.get_rank(), rank_device())
            namespace.update(pushed)
            return "ok", _value(None)
        if kind == "pull":
            if body not in namespace:
                raise NameError(f"name {body!r} is not defined on this rank")
            return "ok", _value(namespace[body])
        if kind == "peek":  # a rank whose stepped cell ended while others are paused
            return "ok", _value(eval(body, namespace))  # noqa: S307 - the learner's expression
        raise ValueError(f"unknown command {kind!r}")
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the kernel; the rank lives on
        try:
            notes.raised = notes.raised_in(exc) if kind == "run" else None
        except Exception:  # noqa: BLE001 - the doctor then knows less; the error is still reported
            notes.raised = None
        return "error", _error(exc)


def serve(rank: int, world_size: int) -> None:
    """The function a live rank runs: answer commands until ``"exit"`` or until the kernel goes away."""

    commands, doctor = channels()
    interrupts = _Interrupts()
    namespace = _namespace(rank, world_size)
    notes = CallNotes()
    notes.install()
    threading.Thread(target=_answer_doctor, args=(doctor, notes), name="dtlib-doctor", daemon=True).start()
    commands.send_bytes(pickle.dumps((0, "ready", None)))
    while True:
        try:
            number, kind, body = pickle.loads(commands.recv_bytes())
        except (EOFError, OSError):
            return
        if kind == "exit":
            return
        stepped = kind == "run" and body[2:3] == (True,)
        pauses = Pauses(commands, number, _value, namespace=namespace) if stepped else None
        status, answer = _do(kind, body, namespace, interrupts, notes, pauses)
        if pauses is not None:
            number = pauses.number  # a stepped cell ends in answer to the newest step
        sys.stdout.flush()  # the cell's output reaches the kernel before its answer
        sys.stderr.flush()
        commands.send_bytes(pickle.dumps((number, status, answer)))
