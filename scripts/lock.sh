#!/usr/bin/env bash
# Regenerate requirements.lock: every package set-up installs, direct and transitive, at an exact version.
#   scripts/lock.sh                                  # keep the current pins where they still fit (make lock)
#   scripts/lock.sh --upgrade-package cloudpickle    # try a newer release of one package, then run make test
#   scripts/lock.sh --upgrade                        # move every package to its newest release
# Extra arguments go to `uv pip compile`. The lock is universal (Linux and macOS, Python 3.11 and newer).
# torch itself is left out, with the CUDA libraries only its GPU builds need (nvidia-*, cuda-*, triton):
# set-up installs torch from constraints.txt, or keeps the user's own build. torch's pure-Python
# dependencies (sympy, networkx, ...) are locked like every other package. environment.yml (conda)
# then gets the same versions, as they are on Python 3.11.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
UV_VERSION=0.13.9
LOCK=requirements.lock

# uv lives outside the venv (build/uv), so that the venv holds exactly what the lock names.
tools=build/uv
uv="$tools/bin/uv"
if ! PYTHONPATH="$tools" "$uv" --version 2>/dev/null | grep -qx "uv $UV_VERSION"; then
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade --target "$tools" "uv==$UV_VERSION"
fi

compile() {  # compile [uv options...]: the lock's resolution, written to stdout
    UV_CUSTOM_COMPILE_COMMAND="make lock" "$uv" pip compile pyproject.toml --extra dev \
        --constraint constraints.txt --universal --python-version 3.11 --quiet \
        --output-file "$LOCK" --no-emit-package torch "$@"
}

# First pass: find the packages that only torch's GPU builds pull in; second pass: leave them out too.
compile "$@"
gpu_only=$(grep -oE '^(nvidia-[a-z0-9-]+|cuda-[a-z0-9-]+|triton)==' "$LOCK" | tr -d '=' | sort -u || true)
args=()
for name in $gpu_only; do args+=(--no-emit-package "$name"); done
compile "${args[@]}" "$@"
"$VENV/bin/python" scripts/lockfile.py conda-pins "$LOCK" environment.yml
echo "lock: $(grep -cE '^[A-Za-z0-9]' "$LOCK") packages pinned in $LOCK"
