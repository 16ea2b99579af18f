"""dtlib.train.checkpoint: the old file or the new one, never a mix, and nothing left over; a digest record that
must list every file of the checkpoint, and name the one loaded."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch

from dtlib.errors import ChangedFile
from dtlib.train.checkpoint import (
    DIGESTS,
    load_file,
    save_file,
    sha256,
    verify_digests,
    write_atomically,
    write_digests,
)


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
    """What a notebook writes goes to one folder of this kernel's own, emptied when the notebook runs again."""
    import socket
    import stat

    from dtlib.train.checkpoint import private_folder

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = private_folder("notebooks", "04", empty=True)
    assert folder == str(tmp_path / "dtlib" / "notebooks" / "04" / f"run-{socket.gethostname()}-{os.getpid()}")
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    (pathlib.Path(folder) / "sub").mkdir()
    (pathlib.Path(folder) / "ckpt.pt").write_bytes(b"last run")
    assert private_folder("notebooks", "04") == os.path.dirname(folder) and len(os.listdir(folder)) == 2
    assert private_folder("notebooks", "04", empty=True) == folder and os.listdir(folder) == []


@pytest.mark.timeout(120)
def test_two_kernels_running_one_notebook_keep_each_others_files(tmp_path, monkeypatch):
    """Two kernels ran 04 at once: each emptied the one shared folder, deleting the other's checkpoint mid-run,
    and the error then blamed the file. Each process now has its own; a folder whose process ended goes."""
    import socket

    from dtlib.train.checkpoint import private_folder

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    code = ("import sys, time; from dtlib.train.checkpoint import private_folder; "
            "folder = private_folder('notebooks', '04', empty=True); open(folder + '/ckpt.pt', 'w').write('theirs'); "
            "print(folder, flush=True); sys.stdin.read()")
    other = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)})
    try:
        theirs = other.stdout.readline().strip()
        mine = private_folder("notebooks", "04", empty=True)
        assert mine != theirs and pathlib.Path(theirs, "ckpt.pt").read_text() == "theirs"
    finally:
        other.stdin.close()
        other.wait(timeout=60)
    stale = tmp_path / "dtlib" / "notebooks" / "04" / f"run-{socket.gethostname()}-{other.pid}"
    elsewhere = tmp_path / "dtlib" / "notebooks" / "04" / "run-another-machine-1"
    elsewhere.mkdir()
    assert stale.exists()
    private_folder("notebooks", "04", empty=True)
    assert not stale.exists() and elsewhere.exists()  # the ended kernel's folder goes; another host's is not judged


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


# --- a digest record checks only what it lists: it must list every file, and name the one loaded ------------


def _saved_with_a_weight_flipped(tmp_path) -> pathlib.Path:
    """``ckpt.pt`` saved with its record, then one bit of one weight flipped: torch.load alone reads the changed
    number without a word (the flip is in the tensor's bytes, which the zip format does not check)."""
    path = tmp_path / "ckpt.pt"
    save_file(path, {"weight": torch.arange(1000, dtype=torch.float32)})
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the 4,000 bytes of the weight
    path.write_bytes(bytes(data))
    assert not torch.equal(torch.load(path, weights_only=True)["weight"], torch.arange(1000, dtype=torch.float32))
    return path


def _empty_the_record(path: pathlib.Path) -> None:
    (path.parent / f"{path.name}.sha256").write_text("")


def _record_another_file(path: pathlib.Path) -> None:
    """The record of ``other.pt``, an intact file saved beside it, put in ``ckpt.pt.sha256``'s place."""
    save_file(path.parent / "other.pt", {"weight": torch.zeros(3)})
    (path.parent / "other.pt.sha256").replace(path.parent / f"{path.name}.sha256")


@pytest.mark.parametrize("break_record, says", [
    (_empty_the_record, r"ckpt.pt.sha256 lists no file, so it checks nothing"),
    (_record_another_file, r"ckpt.pt.sha256 records other.pt, which is not part of this checkpoint \(ckpt.pt\): "
                           r"it is another file's record"),
    (lambda path: None, r"ckpt.pt changed since it was written"),
], ids=["record emptied", "record of another file", "record intact"])
def test_a_flipped_weight_is_refused_whatever_its_record_says(tmp_path, break_record, says):
    """Before: an emptied record, or another file's, checked nothing, and the flipped weight loaded as a changed
    number. The record must name the file being loaded; with an intact record the flip is caught as before."""
    path = _saved_with_a_weight_flipped(tmp_path)
    break_record(path)
    with pytest.raises(ChangedFile, match=says):
        load_file(str(path), "cpu")


def test_a_saved_file_loads_and_its_record_names_it_alone(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_file(path, {"step": 3})
    assert (tmp_path / "ckpt.pt.sha256").read_text() == f"{sha256(path)}  ckpt.pt\n"
    assert load_file(str(path), "cpu") == {"step": 3}


def _folder_with_a_weight_flipped(tmp_path) -> pathlib.Path:
    """A folder checkpoint as DCP lays it out, its record written by write_digests, then a byte of one file flipped."""
    folder = tmp_path / "a"
    folder.mkdir()
    for name, size in ((".metadata", 300), ("__0_0.distcp", 4000), ("__1_0.distcp", 4000)):
        (folder / name).write_bytes(os.urandom(size))
    write_digests(folder, os.listdir(folder))
    data = bytearray((folder / "__1_0.distcp").read_bytes())
    data[2000] ^= 0x01
    (folder / "__1_0.distcp").write_bytes(bytes(data))
    return folder


def _drop_the_last_line(folder: pathlib.Path) -> None:
    lines = (folder / DIGESTS).read_text().splitlines(keepends=True)
    assert lines[-1].endswith("  __1_0.distcp\n")  # sorted: the flipped file's line is last
    (folder / DIGESTS).write_text("".join(lines[:-1]))  # cut at a line's end: every line left is well formed


def _record_a_planted_file_alone(folder: pathlib.Path) -> None:
    (folder / "notes.txt").write_text("nothing to see")
    write_digests(folder, ["notes.txt"])


@pytest.mark.parametrize("break_record, says", [
    (lambda folder: (folder / DIGESTS).write_text(""), r"a/SHA256SUMS lists no file, so it checks nothing"),
    (_drop_the_last_line, r"a/__1_0.distcp is not in .*a/SHA256SUMS: the record must list every file"),
    (_record_a_planted_file_alone, r"a/.metadata is not in .*a/SHA256SUMS \(nor are 2 more\)"),
], ids=["record emptied", "record cut short", "record of another file"])
def test_a_folder_record_that_leaves_a_file_out_is_refused(tmp_path, break_record, says):
    folder = _folder_with_a_weight_flipped(tmp_path)
    break_record(folder)
    with pytest.raises(ChangedFile, match=says):
        verify_digests(folder)


def test_a_file_added_to_a_folder_since_its_record_is_refused(tmp_path):
    """Every file in the folder must be in the record: one put there since the save could be read as part of it."""
    folder = _folder_with_a_weight_flipped(tmp_path)
    write_digests(folder, os.listdir(folder))  # the flip recorded: the folder as saved
    assert sorted(verify_digests(folder)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    (folder / "__2_0.distcp").write_bytes(b"added later")
    with pytest.raises(ChangedFile, match=r"a/__2_0.distcp is not in .*SHA256SUMS.*Remove the file if you put it"):
        verify_digests(folder)
