"""scripts/test_torch.sh (make test-torch): a TORCH that is not a torch release in dtlib.compat's range is refused
before anything is created or installed; one that is gets as far as pytest (on a stand-in environment)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dtlib.compat import MAX_TORCH, MIN_TORCH, supported

ROOT = Path(__file__).resolve().parents[1]
RANGE = f"from {'.'.join(map(str, MIN_TORCH))} to {'.'.join(map(str, MAX_TORCH))}"
ABOVE = f"{MAX_TORCH[0]}.{MAX_TORCH[1] + 1}"


def _recording_python(path: Path, log: Path, runs: str | None = sys.executable) -> Path:
    """A python that notes its arguments in ``log``, then runs them with ``runs`` (None: runs nothing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    then = f'exec "{runs}" "$@"' if runs else "exit 0"
    path.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\n{then}\n')
    path.chmod(0o755)
    return path


def _test_torch(torch: str, tmp_path: Path, *command: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCH": torch, "TORCH_VENV": str(tmp_path / "venv"),
           "PYTHON": str(_recording_python(tmp_path / "python", tmp_path / "python.log"))}
    return subprocess.run(list(command) or ["scripts/test_torch.sh"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)  # a hang guard: a refusal takes a second


@pytest.mark.parametrize("torch", ["2..13", "2.13a", "latest", "1.13", "", ABOVE, "2.011", "2.11.0.1", "v2.11",
                                   "2.11 2.12", "2.11\n", "2.11;touch", "../2.11", "2.11.*", "2.11+cpu"])
def test_test_torch_refuses_what_is_not_a_supported_release_before_installing_anything(torch, tmp_path):
    done = _test_torch(torch, tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"test-torch: TORCH={torch!r}" in done.stderr and RANGE in done.stderr, done.stderr
    assert "MAJOR.MINOR or MAJOR.MINOR.PATCH, digits only" in done.stderr, done.stderr
    assert not (tmp_path / "venv").exists()
    calls = (tmp_path / "python.log").read_text()  # the check alone, reading stdin: no "-m venv", no "-m pip"
    assert calls.startswith("- ") and " -m " not in f" {calls}", calls


@pytest.mark.parametrize("version", [(1, 13), (MIN_TORCH[0], MIN_TORCH[1] - 1), (MAX_TORCH[0], MAX_TORCH[1] + 1)])
def test_test_torch_says_why_a_release_outside_dtlib_compats_range_is_refused(version, tmp_path):
    done = _test_torch(".".join(map(str, version)), tmp_path)
    assert done.returncode == 2 and supported(version) in done.stderr, done.stderr


def test_make_test_torch_hands_the_script_the_whole_value(tmp_path):
    torch = f"2.11 ; touch {tmp_path / 'injected'}"  # split by the recipe's shell, it would run touch
    done = _test_torch(torch, tmp_path, "make", "-s", "--no-print-directory", "test-torch", f"TORCH={torch}")
    assert done.returncode != 0 and f"test-torch: TORCH={torch!r}" in done.stderr, done.stderr
    assert not (tmp_path / "injected").exists() and not (tmp_path / "venv").exists()


@pytest.mark.parametrize("torch", [".".join(map(str, MIN_TORCH)), f"{MAX_TORCH[0]}.{MAX_TORCH[1]}.1"])
def test_test_torch_takes_a_supported_release_on_to_pytest(torch, tmp_path):
    """An environment already set up (its stamp newer than the lock) stands in: nothing is installed."""
    log = tmp_path / "venv.log"
    _recording_python(tmp_path / "venv" / "bin" / "python", log, runs=None)
    (tmp_path / "venv" / ".dtlib-installed").touch()
    done = _test_torch(torch, tmp_path, "scripts/test_torch.sh", "--collect-only")
    assert done.returncode == 0, done.stderr
    assert log.read_text().splitlines()[-1].startswith("-m pytest -p no:cacheprovider"), log.read_text()
