#!/usr/bin/env bash
# Create or reuse the local virtual environment and install dtlib with its dev extra, every package
# at the exact version requirements.lock gives (make lock regenerates it; docs/testing.md says how).
#   scripts/setup.sh            # uses $VENV (default .venv) and $PYTHON (default python3)
# A torch that the base Python already has (your own CUDA build, say) is kept, with the dependencies it
# wants: the venv then sees the base site-packages. Otherwise torch comes from constraints.txt (CPU build),
# and whatever an older lock left in the venv is removed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
stamp="$VENV/.dtlib-installed"
LOCK=requirements.lock

if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt constraints.txt ] && [ "$stamp" -nt "$LOCK" ]; then
    exit 0  # up to date
fi

"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || { echo "setup: Python 3.11 or newer is needed; $PYTHON is $("$PYTHON" -V)" >&2; exit 1; }

if [ ! -x "$VENV/bin/python" ]; then
    if "$PYTHON" -c 'import torch' 2>/dev/null; then
        echo "setup: keeping the torch that $PYTHON already has ($("$PYTHON" -c 'import torch; print(torch.__version__)'))"
        "$PYTHON" -m venv --system-site-packages "$VENV"
    else
        "$PYTHON" -m venv "$VENV"
    fi
fi
PY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1

if grep -q '^include-system-site-packages *= *true' "$VENV/pyvenv.cfg"; then
    # The user's own torch: check it, and lock everything but torch's own dependencies.
    "$PY" -c 'import torch' 2>/dev/null \
        || { echo "setup: $VENV sees the base Python's packages but no torch there; remove $VENV and retry" >&2; exit 1; }
    # The supported range is dtlib.compat's (MIN_TORCH to MAX_TORCH), read from the file: dtlib is not installed yet.
    "$PY" - <<'PYCHECK'
import runpy, sys
why = runpy.run_path("dtlib/compat.py")["supported"]()
if why:
    sys.exit(f"setup: {why}. Install a torch in that range into the Python you set up with, "
             "or use a Python without torch so that set-up installs the CPU build of torch 2.13")
PYCHECK
    "$PY" scripts/lockfile.py without-torch-deps "$LOCK" "$VENV/lock-without-torch-deps.txt"
    "$PY" -m pip install -q --no-compile -c "$VENV/lock-without-torch-deps.txt" -e ".[dev]"
else
    "$PY" -m pip install -q --no-compile -c constraints.txt -r "$LOCK" -e ".[dev]"
    unlocked=$("$PY" scripts/lockfile.py unlocked "$LOCK")
    if [ -n "$unlocked" ]; then
        echo "setup: removing what requirements.lock no longer names: $unlocked"
        # shellcheck disable=SC2086  # one word per package
        "$PY" -m pip uninstall -q -y $unlocked
    fi
fi
# Bytecode on every core (pip compiles on one): 65 s to 57 s of a fresh set-up on two cores. Needed, not optional, where
# PYTHONDONTWRITEBYTECODE is set: nothing would cache it later, and every rank would compile torch's sources again.
# As pip does, a file this Python cannot compile is passed over (torch ships one in Python 3.12's syntax).
"$PY" -m compileall -q -j0 "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
"$PY" -m ipykernel install --sys-prefix --name python3 >/dev/null
touch "$stamp"
echo "setup: ready ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
