"""Checkpoints of FSDP2, FSDP1 and DDP models through ``torch.distributed.checkpoint`` (DCP).

Two kinds, one API for all three wrappers (``get_state_dict`` / ``set_state_dict``):

- ``"sharded"``: every rank writes its own shards with ``dcp.save`` (FSDP1's
  SHARDED_STATE_DICT); loading re-shards to whatever the new job uses.
- ``"full"``: the whole model and optimizer state gathered, written once by rank 0 with
  ``torch.save`` (FSDP1's FULL_STATE_DICT): the file to export or load without FSDP.

Load only checkpoints you wrote. A checkpoint is code as well as numbers: torch's DCP reader
unpickles ``.metadata`` with plain ``pickle`` (torch 2.13 has no safe mode for it) and its
non-tensor entries with ``torch.load(weights_only=False)``, so a planted file runs what it likes.
:func:`load` reads both with only the classes a DCP checkpoint holds allowed (and full files with
``weights_only=True``), and refuses anything else; that guards against a tampered file, not a
trusted one. The default directory (:func:`default_directory`) is private to you, not a shared
folder such as ``/tmp``.

A save never damages the previous checkpoint: it writes into a fresh sub-folder and then
replaces ``step.json`` (which names the folder) in one rename; a failed save leaves
``step.json`` naming the old, complete one. The sub-folder's ``SHA256SUMS`` records every file's SHA-256,
and a load checks them first, so a file changed or cut short since is refused by name, not loaded. It checks
the record too: it must list every file in the sub-folder and every file ``.metadata`` names, so a record
emptied, cut short or copied from elsewhere, or a file added since the save, is refused as well.

On GPUs the full state dict is gathered with ``cpu_offload=True``, the documented
route. On the CPU it must not be: FSDP1's offload path calls ``flat_param.to("cpu")``,
which for a tensor already on the CPU returns the same tensor, and then frees the
unsharded buffer it still uses ("setStorage ... out of bounds for storage of size 0"
in torch 2.13). There is nothing to offload on the CPU anyway, so dtlib skips it.

Example (inside a rank; ``directory`` defaults to :func:`default_directory`)::

    save(model, optimizer, step=4, kind="sharded")
    step = load(model, optimizer, kind="sharded")
"""

from __future__ import annotations

import contextlib
import enum
import io
import json
import os
import pathlib
import pickle
import shutil
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from dtlib.launch.device import rank_device
from dtlib.train.checkpoint import DIGESTS, load_file, private_folder, verify_digests, write_atomically, write_digests

FULL_FILE = "full.pt"
STEP_FILE = "step.json"  # {"step": 4, "kind": "sharded", "folder": "a"}: written last, in one rename
FOLDERS = ("a", "b")  # a save writes into the one step.json does not name


def default_directory(name: str = "fsdp") -> str:
    """``<cache>/dtlib/checkpoints/<name>`` (:func:`dtlib.train.checkpoint.private_folder`): yours alone, mode 0o700.

    Every rank on one machine gets the same path. For ranks on several machines, pass a directory
    on a file system they share. Example: ``save(model, optimizer, 4, default_directory("run1"))``.
    """
    return private_folder("checkpoints", name)


@contextlib.contextmanager
def _torch_internal_warnings(notes: list[str]) -> Iterator[None]:
    """Collect the warnings torch's own state-dict code raises (FSDP1's goes through the deprecated
    ShardedTensor in torch 2.13) into ``notes``, once each, instead of printing them on every rank."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for message in sorted({str(w.message).strip() for w in caught}):
        if message not in notes:
            notes.append(message)


def _full_options() -> StateDictOptions:
    on_gpu = dist.get_backend() == "nccl"
    return StateDictOptions(full_state_dict=True, cpu_offload=on_gpu)


def save(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, directory: str | None = None,
         kind: str = "sharded", notes: list[str] | None = None) -> str:
    """Write a checkpoint of ``kind`` ("sharded" or "full") to ``directory``; every rank must call it.

    ``directory`` defaults to :func:`default_directory`. The checkpoint before it stays whole until
    this one is complete (module docstring). Warnings torch raises on the way are appended to
    ``notes`` instead of printed. Returns the directory.
    """
    if kind not in ("sharded", "full"):
        raise ValueError(f"kind must be 'sharded' or 'full', got {kind!r}")
    directory = os.fspath(directory) if directory else default_directory()
    os.makedirs(directory, mode=0o700, exist_ok=True)
    previous = _committed(directory)  # every rank reads it before rank 0 can replace it (barriers below)
    folder = FOLDERS[1] if previous and previous["folder"] == FOLDERS[0] else FOLDERS[0]
    target = os.path.join(directory, folder)
    if dist.get_rank() == 0:
        shutil.rmtree(target, ignore_errors=True)  # what a failed save left, or the checkpoint before last
        os.makedirs(target, mode=0o700)
    dist.barrier()
    with _torch_internal_warnings([] if notes is None else notes):
        _save(model, optimizer, target, kind)
    dist.barrier()  # every rank's files are complete: only now may step.json name them
    if dist.get_rank() == 0:
        write_digests(target, os.listdir(target))  # SHA256SUMS: load refuses a file changed or cut short since
        record = json.dumps({"step": step, "kind": kind, "folder": folder}).encode()
        write_atomically(os.path.join(directory, STEP_FILE), lambda file: file.write(record))
        if previous and previous["folder"] != folder:
            shutil.rmtree(os.path.join(directory, previous["folder"]), ignore_errors=True)
    dist.barrier()  # nobody reads a checkpoint that is still being written
    return directory


def _committed(directory: str) -> dict[str, Any] | None:
    """What ``step.json`` says (None if there is none), checked so that it cannot point elsewhere."""
    path = os.path.join(directory, STEP_FILE)
    try:
        with open(path) as file:
            record = json.load(file)
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is empty or cut short, not the record that dtlib.train.fsdp_checkpoint.save "
                         f"writes last ({error})") from None
    if not isinstance(record, dict) or record.get("folder") not in FOLDERS or record.get("kind") not in (
            "sharded", "full") or not isinstance(record.get("step"), int):
        raise ValueError(f"{path} is not one that dtlib.train.fsdp_checkpoint.save wrote: {record!r}")
    return record


def _save(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str, kind: str) -> None:
    if kind == "sharded":
        model_state, optim_state = get_state_dict(model, optimizer)  # DTensors: each rank's shards
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory)
    else:
        model_state, optim_state = get_state_dict(model, optimizer, options=_full_options())
        if dist.get_rank() == 0:
            state = {"model": model_state, "optim": optim_state}
            write_atomically(os.path.join(directory, FULL_FILE), lambda file: torch.save(state, file))


def _initialise_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Give the optimizer its state tensors with one zero-gradient step (Adam moves nothing then).

    DCP loads *into* the state dict it is given; a fresh optimizer has no state entries,
    and FSDP1's sharded load then silently loads none.
    """
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad()


def load(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str | None = None, kind: str = "sharded",
         notes: list[str] | None = None) -> int:
    """Load a checkpoint written by :func:`save` into this rank's model and optimizer; return its step.

    Load only checkpoints you wrote (module docstring): an object in the files that a checkpoint
    never holds is refused with ``pickle.UnpicklingError`` (inside DCP's ``CheckpointException`` for a
    sharded one). DCP keeps no checksum, so a flipped byte in a ``.distcp`` file would load as a changed weight;
    :func:`save` records every file's SHA-256 in ``SHA256SUMS``, and each machine checks them all here first: a
    changed or truncated file, or a record that leaves a file of the folder out (emptied, cut short, copied from
    elsewhere, or a file added since), raises :class:`dtlib.ChangedFile`; a missing file, or one ``.metadata``
    names that the record does not list, ``FileNotFoundError``; each by name.
    ``directory`` defaults to :func:`default_directory`.
    """
    directory = os.fspath(directory) if directory else default_directory()
    record = _committed(directory)
    if record is None:
        raise FileNotFoundError(f"no checkpoint in {directory}: {STEP_FILE} is missing (save writes it last)")
    if record["kind"] != kind:
        raise ValueError(f"{directory} holds a {record['kind']!r} checkpoint, not {kind!r}: "
                         f"use checkpoint_kind={record['kind']!r}")
    folder = os.path.join(directory, record["folder"])
    _verify_on_each_machine(folder, kind)  # before any reads; the verdict reaches every rank, so none hangs
    _initialise_optimizer_state(model, optimizer)
    with _torch_internal_warnings([] if notes is None else notes):
        _load(model, optimizer, folder, kind)
    return record["step"]


def _verify_on_each_machine(folder: str, kind: str) -> None:
    """:func:`_verify` with the reading shared: each rank of a machine (``LOCAL_RANK`` of ``LOCAL_WORLD_SIZE``)
    hashes its share of the checkpoint's files, every ``LOCAL_WORLD_SIZE``-th of them by name, plus the
    ``.metadata`` it reads anyway, and every rank then raises the first refusal any of them met (one collective),
    so that none goes on to a load its peers refused (and hangs there). Every rank reading every file was N x N
    reads of the whole checkpoint. Outside a process group, or in a group of one, this process checks alone."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        _verify(folder, kind)
        return
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    refusal: BaseException | None = None
    try:
        _verify(folder, kind, share=(local_rank, local_world))
    except (ValueError, OSError, pickle.UnpicklingError) as error:  # ChangedFile is a ValueError
        refusal = error
    verdicts: list[BaseException | None] = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, refusal)
    first = next((verdict for verdict in verdicts if verdict is not None), None)
    if first is not None:
        raise first


def _verify(folder: str, kind: str, share: tuple[int, int] = (0, 1)) -> None:
    """Check ``folder`` against its ``SHA256SUMS`` before anything in it is read: the record must list every file
    in the folder, each with its SHA-256 (:func:`dtlib.train.checkpoint.verify_digests`), and so every file this
    load reads: ``full.pt``, or ``.metadata`` and each data file it names (checked only after its own digest).
    ``share`` is (this rank's index, the ranks sharing the work): this call hashes the files whose place in the
    sorted list is the index modulo the ranks, and ``.metadata``, which it reads."""
    index, ranks = share
    files = sorted(name for name in os.listdir(folder) if name != DIGESTS) if os.path.isdir(folder) else []
    recorded = set(verify_digests(folder, hash_only={*files[index::ranks], ".metadata"}))
    needed = [FULL_FILE] if kind == "full" else [".metadata"]
    if kind == "sharded" and ".metadata" in recorded:
        storage = _CheckedReader(folder).read_metadata().storage_data or {}
        needed += sorted({getattr(info, "relative_path", "") for info in storage.values()})
    for name in needed:
        if name not in recorded:
            raise FileNotFoundError(f"{os.path.join(folder, name)} is missing: a {kind} checkpoint is read from it"
                                    + (", as .metadata says" if name != needed[0] else "")
                                    + f", and {DIGESTS} lists no such file. Load an earlier checkpoint, or save again")


def _load(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str, kind: str) -> None:
    if kind == "sharded":
        model_state, optim_state = get_state_dict(model, optimizer)  # templates with this job's sharding
        state = {"model": model_state, "optim": optim_state}
        reader = _CheckedReader(directory)
        # Read (and check) the metadata first: torch 2.11's dcp.load catches the reader's refusal and reports
        # only "metadata is None"; read here, the refusal says what it found.
        reader.read_metadata()
        # fills the templates in place
        dcp.load(state, storage_reader=reader, planner=_CheckedPlanner())
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        device = rank_device()  # the one place that knows this rank's device
        full = load_file(os.path.join(directory, FULL_FILE), device, digest=False)  # load checked SHA256SUMS
        set_state_dict(model, optimizer, model_state_dict=full["model"], optim_state_dict=full["optim"],
                       options=StateDictOptions(full_state_dict=True))


# What a DCP .metadata pickle may name: DCP's own metadata dataclasses and enums, torch.Size, dtypes,
# layouts, paths. All of them only build values; none can run a command or open a file.
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the names a DCP ``.metadata`` file holds (Python's
    "Restricting Globals" recipe); torch's own ``weights_only`` unpickler cannot read it (protocol 4 frames)."""

    def find_class(self, module: str, name: str) -> Any:
        if module in ("torch", "torch.serialization", "pathlib", "pathlib._local", *_METADATA_MODULES):
            found = super().find_class(module, name)
            if self._harmless(module, found):
                return found
        raise pickle.UnpicklingError(f"a DCP checkpoint's .metadata never names {module}.{name}; refusing to load "
                                     "it: the file was not written by torch.distributed.checkpoint.save (load only "
                                     "checkpoints you wrote)")

    @staticmethod
    def _harmless(module: str, found: Any) -> bool:
        if isinstance(found, torch.dtype) or found is torch.Size or found is torch.serialization._get_layout:
            return True
        if not isinstance(found, type):
            return False
        if issubclass(found, pathlib.PurePath):
            return True
        dataclass_or_enum = hasattr(found, "__dataclass_fields__") or issubclass(found, enum.Enum)
        return module in _METADATA_MODULES and found.__module__ == module and dataclass_or_enum


class _CheckedReader(dcp.FileSystemReader):
    """DCP's reader, with ``.metadata`` read by :class:`_MetadataUnpickler` instead of plain ``pickle``.

    The rest is what torch 2.13's ``FileSystemReader.read_metadata`` does after unpickling."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = os.path.join(self.path, ".metadata")  # dcp.save with a process group writes one, by that name
        with open(path, "rb") as file:
            metadata = _MetadataUnpickler(file).load()
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise pickle.UnpicklingError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
        for info in (metadata.storage_data or {}).values():  # the data files must lie in this folder
            relative = getattr(info, "relative_path", "")
            if os.path.basename(relative) != relative or relative in ("", ".", ".."):
                raise pickle.UnpicklingError(f"{path} points at {relative!r}, outside its own folder")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _CheckedPlanner(dcp.DefaultLoadPlanner):
    """DCP's default planner, except that non-tensor entries (the optimizer's lr, betas, ...) are read
    with ``torch.load(weights_only=True)``; torch's default reads them with ``weights_only=False``."""

    def __init__(self, *args: Any, whole: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.whole = whole  # False: load a part of the checkpoint on purpose

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        """As DCP's, then refuse a checkpoint with entries the model has no place for: DCP itself loads
        what fits and silently drops the rest (a 2-block checkpoint into a 1-block model), while the
        full-state path refuses the same mismatch."""
        super().set_up_planner(state_dict, metadata, is_coordinator)
        extra = sorted(set(getattr(metadata, "state_dict_metadata", {})) - set(self.state_dict))
        if extra and self.whole:
            shown = ", ".join(extra[:4]) + (f" and {len(extra) - 4} more" if len(extra) > 4 else "")
            raise ValueError(f"the checkpoint holds {len(extra)} entries this model and optimizer have no place "
                             f"for ({shown}): it was saved from a different model")

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            checked = torch.load(value, weights_only=True)  # refuses anything but plain values and tensors
        except pickle.UnpicklingError as error:
            said = [line.strip() for line in str(error).splitlines() if "GLOBAL" in line]  # names what it refused
            reason = said[0] if said else "not a plain value"
            raise pickle.UnpicklingError(f"the checkpoint's entry {read_item.dest_index.fqn} holds more than a value "
                                         f"({reason}); refusing to load it (load only checkpoints you wrote)") from None
        again = io.BytesIO()
        torch.save(checked, again)  # the parent unpickles what it gets; give it only what passed the check
        again.seek(0)
        super().load_bytes(read_item, again)
