#!/usr/bin/env bash
# Create or reuse the local virtual environment and install dtlib with its dev extra.
#   scripts/setup.sh            # uses $VENV (default .venv) and $PYTHON (default python3)
# A torch that the base Python already has (your own CUDA build, say) is kept: the venv
# then sees the base site-packages. Otherwise torch comes from constraints.txt (CPU build).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
stamp="$VENV/.dtlib-installed"

if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt constraints.txt ]; then
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

if "$PY" -c 'import torch' 2>/dev/null; then
    "$PY" - <<'PYCHECK'
import sys, torch
major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
if (major, minor) < (2, 6):
    sys.exit(f"setup: torch {torch.__version__} is too old for dtlib (needs >= 2.6); "
             "upgrade it, or use a Python without torch so that set-up installs the CPU build")
PYCHECK
    "$PY" -m pip install -q -e ".[dev]"
else
    "$PY" -m pip install -q -c constraints.txt -e ".[dev]"
fi
"$PY" -m ipykernel install --sys-prefix --name python3 >/dev/null
touch "$stamp"
echo "setup: ready ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
