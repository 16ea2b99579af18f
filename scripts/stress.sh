#!/usr/bin/env bash
# Run some tests many times beside two busy loops (a busy learner's machine), and say how many runs passed.
#   scripts/stress.sh RUNS TEST...        e.g. scripts/stress.sh 50 tests/launch/test_launch_abuse.py::test_x
# BUSY=N sets the number of busy loops (default 2). Exits non-zero if any run failed. Used for
# docs/results/reaper_stress.md; the gate never runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:?usage: scripts/stress.sh RUNS TEST...}
shift
PY=${VENV:-.venv}/bin/python
busy=()
for _ in $(seq 1 "${BUSY:-2}"); do
    "$PY" -c 'while True: pass' &
    busy+=($!)
done
trap 'kill "${busy[@]}" 2>/dev/null || true' EXIT
began=$(date +%s)
status=0
PYTHONPATH=scripts "$PY" -m pytest -p repeat_tests --repeat "$runs" -n 0 -p no:cacheprovider -q \
    --durations=0 -o addopts="--strict-markers" "$@" || status=$?
echo "stress: $runs runs of $# test(s) beside ${BUSY:-2} busy loops in $(( $(date +%s) - began )) s; load $(cut -d' ' -f1-3 /proc/loadavg); pytest exit $status"
exit $status
