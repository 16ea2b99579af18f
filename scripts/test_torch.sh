#!/usr/bin/env bash
# The test suite and every notebook (nbval) on another torch, in an environment of its own:
#   make test-torch TORCH=2.11          # or: TORCH=2.11 scripts/test_torch.sh [pytest arguments]
# It creates (or reuses) .venv-torch$TORCH, installs torch==$TORCH.* from the registry (on most machines
# a CUDA build of a few GB, which runs on the CPU too: never part of make setup), then the lock's other
# packages and dtlib, and runs pytest as make test does, without the browser (nbval runs the notebooks).
# The first run prints the figures docs/results/torch_versions.md records. Any other TORCH than a release in
# dtlib.compat's range (MIN_TORCH to MAX_TORCH) is refused before anything is created or installed.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=${TORCH-}
PYTHON=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1
# Refuse before anything is created or installed: TORCH becomes a pip requirement and a directory name. Only a
# plain release (MAJOR.MINOR or MAJOR.MINOR.PATCH, digits only) inside dtlib.compat's range passes; the range
# and supported() are read from the file's text, since dtlib.compat imports torch and this Python may have none.
why=$("$PYTHON" - "$TORCH" <<'PYCHECK'
import ast, re, sys
torch = sys.argv[1]
names = ("MIN_TORCH", "MAX_TORCH")
kept = [node for node in ast.parse(open("dtlib/compat.py").read()).body
        if isinstance(node, ast.ImportFrom) and node.module == "__future__"
        or isinstance(node, ast.Assign) and any(getattr(target, "id", "") in names for target in node.targets)
        or isinstance(node, ast.FunctionDef) and node.name == "supported"]
compat = {}
exec(compile(ast.Module(body=kept, type_ignores=[]), "dtlib/compat.py", "exec"), compat)
low, high = (".".join(map(str, compat[name])) for name in names)
accepted = (f"a torch release as MAJOR.MINOR or MAJOR.MINOR.PATCH, digits only (no leading zeros), "
            f"from {low} to {high} (e.g. make test-torch TORCH={low})")
number = r"(0|[1-9][0-9]*)"  # ASCII digits ([0-9], not \d), no leading zero: the version as pip writes it
if not re.fullmatch(rf"{number}\.{number}(\.{number})?", torch):
    print(f"TORCH={torch!r} is not a torch release; give {accepted}")
elif why := compat["supported"](tuple(int(part) for part in torch.split(".")[:2])):
    print(f"TORCH={torch!r}: {why}; give {accepted}")
PYCHECK
) || { echo "test-torch: could not read the supported torch range from dtlib/compat.py with $PYTHON" >&2; exit 2; }
if [ -n "$why" ]; then
    echo "test-torch: $why" >&2
    exit 2
fi
VENV=${TORCH_VENV:-.venv-torch$TORCH}
PY="$VENV/bin/python"
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
