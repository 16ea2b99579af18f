#!/usr/bin/env bash
# The test suite and every notebook (nbval) on another torch, in an environment of its own:
#   make test-torch TORCH=2.11          # or: TORCH=2.11 scripts/test_torch.sh [pytest arguments]
# It creates (or reuses) .venv-torch$TORCH, installs torch==$TORCH.* from the registry (on most machines
# a CUDA build of a few GB, which runs on the CPU too: never part of make setup), then the lock's other
# packages and dtlib, and runs pytest as make test does, without the browser (nbval runs the notebooks).
# The first run prints the figures docs/results/torch_versions.md records.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=${TORCH:?"say which torch, e.g. make test-torch TORCH=2.11"}
PYTHON=${PYTHON:-python3}
VENV=${TORCH_VENV:-.venv-torch$TORCH}
PY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1
case "$TORCH" in
    *[!0-9.]* | "") echo "test-torch: TORCH must be a version such as 2.11, not '$TORCH'" >&2; exit 2 ;;
esac
stamp="$VENV/.dtlib-installed"
if [ ! -f "$stamp" ] || [ "$stamp" -ot requirements.lock ] || [ "$stamp" -ot pyproject.toml ]; then
    [ -x "$PY" ] || "$PYTHON" -m venv "$VENV"
    spec="torch==$TORCH"
    [[ "$TORCH" == *.*.* ]] || spec="torch==$TORCH.*"
    echo "test-torch: installing $spec into $VENV (a CUDA build of a few GB on most machines)"
    "$PY" -m pip install -q "$spec"
    "$PY" scripts/lockfile.py without-torch-deps requirements.lock "$VENV/lock-without-torch-deps.txt"
    "$PY" -m pip install -q -c "$VENV/lock-without-torch-deps.txt" -e ".[dev]"
    "$PY" -m ipykernel install --sys-prefix --name python3 >/dev/null
    touch "$stamp"
fi
"$PY" -c 'import torch; print("test-torch: torch", torch.__version__)'
# The browser tests need the set-up's Chromium; nbval runs every notebook here instead.
DTLIB_NO_BROWSER=1 DTLIB_TEST_TORCH="$TORCH" "$PY" -m pytest -p no:cacheprovider -n "${PYTEST_WORKERS:-2}" --dist loadfile "$@"
