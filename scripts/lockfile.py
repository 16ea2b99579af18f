"""Read requirements.lock for set-up (scripts/setup.sh); standard library only.

    python scripts/lockfile.py without-torch-deps requirements.lock OUT   # the lock, less torch's own dependencies
    python scripts/lockfile.py unlocked requirements.lock                 # installed packages the lock does not name
    python scripts/lockfile.py conda-pins requirements.lock environment.yml  # give environment.yml the lock's versions

``without-torch-deps`` serves a user's own torch (a CUDA build, say): its dependencies stay as that torch
wants them, and everything else is held to the lock. ``unlocked`` names what an older lock left in the venv,
so that set-up can remove it and the venv holds exactly the lock. ``conda-pins`` (run by ``make lock``) sets
each package environment.yml names to the version the lock gives it on Python 3.11, the conda route's Python.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==")
CONDA_NAMES = {"pytorch": "torch", "playwright-python": "playwright"}  # conda-forge name -> pip name where they differ
CONDA_PYTHON = "3.11"
CONDA_LINE = re.compile(r"^(\s*- )([A-Za-z0-9_.-]+)(\S*)(.*)$")
# Installed but never in the lock: the installer, torch (constraints.txt or the user's), the project itself.
NOT_LOCKED = {"pip", "torch", "dtlib"}


def canonical(name: str) -> str:
    """PEP 503's normal form of a distribution name. Example: ``canonical("Jupyter_Core")`` is ``"jupyter-core"``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def locked_names(lock: Path) -> set[str]:
    """Every package the lock pins, under any marker."""
    return {canonical(m.group(1)) for line in lock.read_text().splitlines() if (m := PIN.match(line))}


def torch_requirements() -> set[str]:
    """The names of the distributions the installed torch requires."""
    return {canonical(re.split(r"[ ;<>=!~\[(]", r, maxsplit=1)[0]) for r in metadata.requires("torch") or []}


def versions_for(lock: Path, environment: dict[str, str]) -> dict[str, str]:
    """Each package's locked version where its marker holds in ``environment`` (PEP 508 marker variables)."""
    from packaging.markers import Marker

    versions = {}
    for line in lock.read_text().splitlines():
        if m := re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)\s*(?:;\s*(.*))?$", line):
            if not m.group(3) or Marker(m.group(3)).evaluate(environment):
                versions[canonical(m.group(1))] = m.group(2)
    return versions


def conda_pins(lock: Path, environment_yml: Path) -> None:
    """Rewrite environment.yml's ``- name...`` lines as ``- name==<locked version>`` (torch stays a lower bound)."""
    locked = versions_for(lock, {"python_version": CONDA_PYTHON, "python_full_version": f"{CONDA_PYTHON}.0",
                                 "sys_platform": "linux", "os_name": "posix", "platform_machine": "x86_64",
                                 "platform_system": "Linux", "implementation_name": "cpython",
                                 "platform_python_implementation": "CPython"})
    lines = []
    for line in environment_yml.read_text().splitlines():
        m = CONDA_LINE.match(line)
        if m and (pip_name := canonical(CONDA_NAMES.get(m.group(2), m.group(2)))) in locked:
            line = f"{m.group(1)}{m.group(2)}=={locked[pip_name]}{m.group(4)}"
        lines.append(line)
    environment_yml.write_text("\n".join(lines) + "\n")


def main(argv: list[str]) -> int:
    command, lock = argv[0], Path(argv[1])
    if command == "without-torch-deps":
        drop = torch_requirements()
        kept = [line for line in lock.read_text().splitlines()
                if not ((m := PIN.match(line)) and canonical(m.group(1)) in drop)]
        Path(argv[2]).write_text("\n".join(kept) + "\n")
    elif command == "unlocked":
        installed = {canonical(d.metadata["Name"]) for d in metadata.distributions()}
        print(" ".join(sorted(installed - locked_names(lock) - NOT_LOCKED)))
    elif command == "conda-pins":
        conda_pins(lock, Path(argv[2]))
    else:
        raise SystemExit(f"unknown command {command!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
