"""Write a file so that a failure never leaves a damaged one: write beside it, then rename.

``os.replace`` within one directory is atomic: a reader (or a resumed job) finds the old file or
the new one, never a mix. A full disk, a crash or an exception half way through leaves the old
file as it was. Example::

    write_atomically("ckpt.pt", lambda file: torch.save(state, file))
"""

from __future__ import annotations

import contextlib
import glob
import os
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
