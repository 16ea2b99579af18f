"""dtlib.train.checkpoint.write_atomically: the old file or the new one, never a mix, and nothing left over."""

from __future__ import annotations

import os
import time

import pytest

from dtlib.train.checkpoint import write_atomically


def test_a_write_replaces_the_file_and_leaves_no_partial(tmp_path):
    target = tmp_path / "ckpt.pt"
    target.write_bytes(b"old")
    write_atomically(target, lambda file: file.write(b"new"))
    assert target.read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


def test_a_failed_write_keeps_the_old_file_and_says_so(tmp_path):
    target = tmp_path / "ckpt.pt"
    target.write_bytes(b"old")

    def fails(file):
        file.write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(OSError, match=r"could not write .*ckpt.pt: RuntimeError: disk full; the previous .* unchanged"):
        write_atomically(target, fails)
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


def test_the_partial_file_of_a_killed_writer_goes_with_the_next_write(tmp_path):
    """SIGKILL runs no cleanup: a '.ckpt.pt.<random>.partial' stays. The next successful write removes it,
    but not one that another writer may still be filling (newer than this write), nor other files' partials."""
    stale, other = tmp_path / ".ckpt.pt.abc123.partial", tmp_path / ".other.pt.abc123.partial"
    for path in (stale, other):
        path.write_bytes(b"half a checkpoint")
        os.utime(path, (time.time() - 60, time.time() - 60))
    fresh = tmp_path / ".ckpt.pt.def456.partial"

    def write(file):
        fresh.write_bytes(b"another writer, right now")
        file.write(b"new")

    write_atomically(tmp_path / "ckpt.pt", write)
    assert not stale.exists() and other.exists() and fresh.exists()


def test_a_private_folder_is_reused_and_emptied_on_request(tmp_path, monkeypatch):
    """What a notebook writes goes to one folder of its own, emptied when the notebook runs again."""
    import stat

    from dtlib.train.checkpoint import private_folder

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = private_folder("notebooks", "04", empty=True)
    assert folder == str(tmp_path / "dtlib" / "notebooks" / "04")
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    (tmp_path / "dtlib" / "notebooks" / "04" / "sub").mkdir()
    (tmp_path / "dtlib" / "notebooks" / "04" / "ckpt.pt").write_bytes(b"last run")
    assert private_folder("notebooks", "04") == folder and len(os.listdir(folder)) == 2  # kept unless asked
    assert private_folder("notebooks", "04", empty=True) == folder and os.listdir(folder) == []


@pytest.mark.parametrize("parts", [(), ("..",), ("a/b",), ("",), (3,)])
def test_a_private_folder_takes_folder_names_only(tmp_path, monkeypatch, parts):
    from dtlib.train.checkpoint import private_folder

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(ValueError, match="parts must be folder names"):
        private_folder(*parts)


def test_a_private_folder_that_is_a_link_is_refused(tmp_path, monkeypatch):
    from dtlib.train.checkpoint import private_folder

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "dtlib").mkdir()
    (tmp_path / "dtlib" / "notebooks").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(PermissionError, match="or is a link"):
        private_folder("notebooks", "04", empty=True)
