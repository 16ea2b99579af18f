"""Write a file so that a failure never leaves a damaged one: write beside it, then rename; and
folders of dtlib's own, private to you, that a rerun reuses instead of adding another.

``os.replace`` within one directory is atomic: a reader (or a resumed job) finds the old file or
the new one, never a mix. A full disk, a crash or an exception half way through leaves the old
file as it was. Example::

    write_atomically("ckpt.pt", lambda file: torch.save(state, file))
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import BinaryIO


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
    who could plant a file there. ``empty=True`` removes what an earlier run left in it first, so a
    notebook run again reuses one folder instead of leaving one more. Every process on one machine gets
    the same path. Example: ``private_folder("notebooks", "04", empty=True)``.
    """
    if not parts or not all(isinstance(part, str) and part and os.sep not in part and part not in (".", "..")
                            for part in parts):
        raise ValueError(f"parts must be folder names (no separators, not '.' or '..'), got {parts!r}")
    path = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    for part in ("dtlib", *parts):
        path = os.path.join(path, part)
        os.makedirs(path, mode=0o700, exist_ok=True)
        info = os.lstat(path)
        if info.st_uid != os.getuid() or os.path.islink(path):
            raise PermissionError(f"{path} belongs to another user (uid {info.st_uid}) or is a link, and could hold "
                                  "files planted there; pass a directory of your own")
        if info.st_mode & 0o077:
            os.chmod(path, 0o700)
    if empty:
        for entry in os.scandir(path):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
    return path
