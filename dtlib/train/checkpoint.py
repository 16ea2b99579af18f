"""Checkpoint files, saved and loaded so that nothing damaged is ever read: each file written beside its
place and renamed onto it, its SHA-256 recorded and verified on load (a file changed or cut short since is
refused by name), in folders of dtlib's own, private to you, that a rerun reuses instead of adding another.

A record checks only what it lists, so a load first checks the record itself: it must list every file of the
checkpoint (for a folder, every file in it) and nothing else, so an emptied record, one cut short, another
file's record, or a file put in the folder since the save is refused by name, as is a digest that differs.

``os.replace`` within one directory is atomic: a reader (or a resumed job) finds the old file or
the new one, never a mix. A full disk, a crash or an exception half way through leaves the old
file as it was. The DDP runner's checkpoint is one file (:func:`save_file`, :func:`load_file`); FSDP's
sharded and full-state checkpoints build on these in :mod:`dtlib.train.fsdp_checkpoint`. Example::

    save_file("ckpt.pt", {"model": model.state_dict(), "step": 3})
    load_file("ckpt.pt", map_location="cpu")["step"]     # 3
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import pickle
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any, BinaryIO

import torch

from dtlib.errors import ChangedFile
from dtlib.launch.proctree import running

DIGESTS = "SHA256SUMS"  # a folder's record: one "<sha256>  <name>" line per file, as sha256sum writes them


def write_atomically(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> None:
    """Call ``write`` on a new file next to ``path``, flush it to disk, then rename it onto ``path``.

    On any failure the partial file is removed, ``path`` is left as it was, and an ``OSError``
    names the path, says what went wrong, and that the previous file is unchanged. The new file is
    readable by its owner only (``tempfile.mkstemp``'s mode 0o600). A partial file that a killed
    process left behind (no ``except`` runs on SIGKILL) is removed after the next successful write.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    existed = os.path.exists(path)
    started = time.time()
    partial = None
    try:
        handle, partial = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".partial")
        with os.fdopen(handle, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())  # the bytes are on disk before the name points at them
        os.replace(partial, path)
    except BaseException as error:
        if partial is not None:
            with contextlib.suppress(OSError):
                os.unlink(partial)
        if not isinstance(error, Exception):  # KeyboardInterrupt, SystemExit: as they are
            raise
        before = f"the previous {path} is unchanged" if existed else f"nothing was written to {path}"
        raise OSError(f"could not write {path}: {type(error).__name__}: {error}; {before}") from error
    _sync_directory(folder)
    for stale in glob.glob(os.path.join(glob.escape(folder), f".{glob.escape(os.path.basename(path))}.*.partial")):
        with contextlib.suppress(OSError):
            if os.stat(stale).st_mtime < started:  # older than this write: no writer of ours is still on it
                os.unlink(stale)


def sha256(path: str | os.PathLike[str]) -> str:
    """The file's SHA-256, hex, read in 1 MiB pieces. Example: ``sha256("ckpt.pt")``."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for piece in iter(lambda: file.read(1 << 20), b""):
            digest.update(piece)
    return digest.hexdigest()


def write_digests(folder: str | os.PathLike[str], names: Iterable[str], record: str = DIGESTS) -> str:
    """Record the SHA-256 of each of ``names`` (files in ``folder``) in ``folder/record``, written atomically
    in ``sha256sum``'s format, so that ``sha256sum -c SHA256SUMS`` in the folder checks them too. Returns the
    record's path. Example: ``write_digests("ckpt", os.listdir("ckpt"))``."""
    folder = os.fspath(folder)
    lines = "".join(f"{sha256(os.path.join(folder, name))}  {name}\n" for name in sorted(names) if name != record)
    path = os.path.join(folder, record)
    write_atomically(path, lambda file: file.write(lines.encode()))
    return path


def _read_record(path: str) -> dict[str, str]:
    """``{name: sha256}`` from a record in ``sha256sum``'s format, refusing a line dtlib never writes."""
    try:
        with open(path) as file:
            lines = file.read().splitlines()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is missing: dtlib records the SHA-256 of every file it saves there, "
                                "so without it nothing in the folder can be trusted to be what was written") from None
    recorded: dict[str, str] = {}
    for line in lines:
        expected, _, name = line.partition("  ")
        if (len(expected) != 64 or name in ("", ".", "..", os.path.basename(path)) or os.sep in name
                or name in recorded):
            raise ChangedFile(f"{path} is not a record dtlib wrote: {line[:80]!r}. Load an earlier checkpoint, "
                              "or save again")
        recorded[name] = expected
    return recorded


def verify_digests(folder: str | os.PathLike[str], record: str = DIGESTS,
                   holds: Iterable[str] | None = None, hash_only: Iterable[str] | None = None) -> list[str]:
    """Check that ``folder/record`` lists exactly the files of the checkpoint, each with the SHA-256 it has now;
    return their names.

    ``holds`` names the checkpoint's files; by default every entry of ``folder`` but the record (a folder that is
    one checkpoint, as DCP writes it). A record that lists no file, leaves one of them out (cut short, or a file
    put in the folder since) or lists a file that is not one of them (another file's record) checks nothing for
    the file it skips: each raises :class:`dtlib.ChangedFile`, naming the file. So does a file whose bytes
    changed or were cut short since they were recorded. ``FileNotFoundError`` names a missing record or a listed
    file that is missing. ``hash_only`` names the files this call hashes (the record is still checked against
    every file): the ranks of a job share the reading, each hashing its part. Example: ``verify_digests("ckpt")``
    before loading from ``ckpt``.
    """
    folder = os.fspath(folder)
    path = os.path.join(folder, record)
    recorded = _read_record(path)
    held = sorted(set(os.listdir(folder) if holds is None else holds) - {record})
    what = ", ".join(held) if holds is not None else f"the files in {folder}"
    if not recorded:
        raise ChangedFile(f"{path} lists no file, so it checks nothing: an emptied record cannot vouch for {what}. "
                          "Load an earlier checkpoint, or save again")
    for name in recorded:
        listed = os.path.join(folder, name)
        if not os.path.exists(listed):
            raise FileNotFoundError(f"{listed} is missing: {path} lists it as part of what was saved")
        if name not in held:
            raise ChangedFile(f"{path} records {name}, which is not part of this checkpoint ({what}): it is "
                              "another file's record, and checks nothing here. Load an earlier checkpoint, or "
                              "save again")
    unrecorded = [name for name in held if name not in recorded]
    if unrecorded:
        raise ChangedFile(f"{os.path.join(folder, unrecorded[0])} is not in {path}"
                          + (f" (nor are {len(unrecorded) - 1} more)" if len(unrecorded) > 1 else "")
                          + ": the record must list every file of the checkpoint, and one it leaves out could hold "
                          "anything (a record cut short, or a file put there since the save). Remove the file if "
                          "you put it there; else load an earlier checkpoint, or save again")
    mine = None if hash_only is None else set(hash_only)
    for name, expected in recorded.items():
        if mine is not None and name not in mine:
            continue
        listed = os.path.join(folder, name)
        found = sha256(listed)
        if found != expected:
            raise ChangedFile(f"{listed} changed since it was written: its SHA-256 is {found[:12]}..., "
                              f"{record} recorded {expected[:12]}... ({os.path.getsize(listed):,} bytes now). "
                              "A flipped byte, a copy cut short, or a save killed half way: load an earlier "
                              "checkpoint, or save again")
    return list(recorded)


def write_digest(path: str | os.PathLike[str]) -> str:
    """Record the SHA-256 of the file ``path`` beside it, in ``path.sha256`` (``sha256sum``'s format), which
    :func:`verify_digest` checks. Returns the record's path. Example: ``write_digest("ckpt.pt")``."""
    folder, name = os.path.split(os.path.abspath(path))
    return write_digests(folder, [name], record=f"{name}.sha256")


def verify_digest(path: str | os.PathLike[str]) -> None:
    """Check the file ``path`` against the SHA-256 :func:`write_digest` recorded beside it, in a record that must
    name ``path`` and nothing else (an emptied record, or another file's, is refused); raises as
    :func:`verify_digests` does, naming the file or its record. Example: ``verify_digest("ckpt.pt")``."""
    folder, name = os.path.split(os.path.abspath(path))
    verify_digests(folder, record=f"{name}.sha256", holds=[name])


def _sync_directory(folder: str) -> None:
    """Make the rename itself durable (POSIX); where directories cannot be opened, skip it."""
    with contextlib.suppress(OSError):
        handle = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)


def private_folder(*parts: str, empty: bool = False) -> str:
    """``<cache>/dtlib/<parts>`` (``$XDG_CACHE_HOME`` or ``~/.cache``), readable and writable by you alone
    (mode 0o700): created if missing, tightened if looser, refused if another user owns any level of it,
    who could plant a file there. Every process on one machine gets the same path (ranks find their runner's
    checkpoints this way). Example: ``private_folder("checkpoints", "ddp")``.

    ``empty=True`` (a notebook's folder, ``private_folder("notebooks", "04", empty=True)``) returns this process's
    own folder below that path, ``run-<host>-<pid>``, emptied: a notebook run again in one kernel reuses one
    folder instead of leaving one more, a second kernel running the same notebook gets a folder of its own (one
    shared folder let each kernel empty the other's checkpoints mid-run), and the folders of this machine's
    processes that no longer run go first.
    """
    if not parts or not all(isinstance(part, str) and part and os.sep not in part and part not in (".", "..")
                            for part in parts):
        raise ValueError(f"parts must be folder names (no separators, not '.' or '..'), got {parts!r}")
    path = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    for part in ("dtlib", *parts):
        path = _private_level(os.path.join(path, part))
    if not empty:
        return path
    host = socket.gethostname().replace(os.sep, "_")
    for entry in os.scandir(path):
        found = re.fullmatch(rf"run-{re.escape(host)}-(\d+)", entry.name)
        if found is None and entry.name.startswith("run-"):
            continue  # another machine's process (a home folder shared over the network): not ours to judge
        if found is None or not running(int(found[1])) or int(found[1]) == os.getpid():
            _remove(entry)  # a dead process's folder, this process's last run, or what an older dtlib left loose
    return _private_level(os.path.join(path, f"run-{host}-{os.getpid()}"))


def _private_level(path: str) -> str:
    """Make ``path`` a folder of mode 0o700 owned by this user, or refuse it (another user's, or a link)."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    info = os.lstat(path)
    if info.st_uid != os.getuid() or os.path.islink(path):
        raise PermissionError(f"{path} belongs to another user (uid {info.st_uid}) or is a link, and could hold "
                              "files planted there; pass a directory of your own")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def _remove(entry: os.DirEntry[str]) -> None:
    if entry.is_dir(follow_symlinks=False):
        shutil.rmtree(entry.path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(entry.path)


def save_file(path: str | os.PathLike[str], state: Any) -> None:
    """``torch.save(state, path)``, written atomically (:func:`write_atomically`), its SHA-256 recorded beside
    it (``path.sha256``) for :func:`load_file` to check. Example: ``save_file("ckpt.pt", {"step": 3})``."""
    write_atomically(path, lambda file: torch.save(state, file))
    write_digest(path)


def load_file(path: str, map_location: Any, digest: bool = True) -> Any:
    """``torch.load(path, map_location=..., weights_only=True)``, with ``path`` named in any error: torch's own
    message for a truncated file ("failed finding central directory") names no file. The error keeps its type.

    With ``digest`` (the default) the file must match the SHA-256 recorded beside it when dtlib saved it
    (:func:`write_digest`, :func:`save_file`), in a record that names this file: a changed or truncated file, or
    a record that is empty or names another file, raises :class:`dtlib.ChangedFile`, a missing record
    ``FileNotFoundError``, each naming the file. Example: ``load_file("ckpt.pt", "cpu")``.
    """
    if digest:
        verify_digest(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError) as error:
        raise type(error)(f"{path} could not be loaded (cut short by a save that was killed, or not written by "
                          f"torch.save?): {error}") from error
