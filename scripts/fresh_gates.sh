#!/usr/bin/env bash
# Run the gate as a new user would, on fresh clones of one commit, beside busy loops (a busy learner's machine).
#   scripts/fresh_gates.sh RUNS [COMMIT]      e.g. BUSY=2 scripts/fresh_gates.sh 3 HEAD
# Each run: `git clone` of this checkout into a new folder under ${GATE_DIR:-/tmp}, `git checkout COMMIT`, BUSY
# (default 2) `python -c 'while True: pass'` loops, then `CI=true PYTEST_ADDOPTS=--durations=0 make test
# </dev/null` (set-up included), one run after another. Each run's log stays beside its clone; a line per run says
# its exit code, wall time, load and counts. Exits non-zero if any run failed. Used for docs/testing.md; the gate
# never runs it. `python scripts/durations.py LOG` sums a log's durations per file.
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
runs=${1:?usage: scripts/fresh_gates.sh RUNS [COMMIT]}
commit=$(git -C "$here" rev-parse --short "${2:-HEAD}")
base=${GATE_DIR:-/tmp}/gates-$commit
mkdir -p "$base"
failed=0
for run in $(seq 1 "$runs"); do
    clone=$base/run-$run
    rm -rf "$clone"
    git clone -q "$here" "$clone" && git -C "$clone" checkout -q "$commit" || exit 2
    busy=()
    for _ in $(seq 1 "${BUSY:-2}"); do
        python3 -c 'while True: pass' &
        busy+=($!)
    done
    began=$(date +%s)
    (cd "$clone" && CI=true PYTEST_ADDOPTS=--durations=0 make test </dev/null >"$clone.log" 2>&1)
    status=$?
    kill "${busy[@]}" 2>/dev/null
    wait "${busy[@]}" 2>/dev/null
    counts=$(grep -aoE '[0-9]+ (passed|failed|skipped|error)' "$clone.log" | tail -4 | paste -sd' ')
    echo "gate $run of $runs, $commit: exit $status in $(( $(date +%s) - began )) s beside ${BUSY:-2} busy loops;" \
         "load $(cut -d' ' -f1-3 /proc/loadavg); $counts; log $clone.log" | tee -a "$base/summary"
    [ "$status" -eq 0 ] || failed=1
done
exit $failed
