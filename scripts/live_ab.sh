#!/usr/bin/env bash
# A plain %%ranks cell and a ranks.run call, timed on this checkout and on another commit, in turn: the per-pair
# ratio holds where the machine's speed drifts. Used for docs/results/live_cpu.md; the gate never runs it.
#   scripts/live_ab.sh COMMIT [PAIRS] [SAMPLES]      e.g. scripts/live_ab.sh 461c7f7 6 2000
# Each run starts 2 live ranks (the collective check on), warms 50 cells, then times SAMPLES cells and SAMPLES
# calls, and prints their medians in ms; the last line gives each pair's ratio (this checkout / COMMIT).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
commit=${1:?usage: scripts/live_ab.sh COMMIT [PAIRS] [SAMPLES]}
pairs=${2:-6}
samples=${3:-2000}
before=$(mktemp -d)
trap 'rm -rf "$before" "$before.py"' EXIT
git clone -q "$here" "$before" && git -C "$before" checkout -q "$commit"
timer=$before.py
cat > "$timer" <<'PY'
import contextlib, io, statistics, sys, time


def main(samples: int) -> None:  # under a __main__ guard: the forkserver imports the main module
    import dtlib
    from IPython.core.interactiveshell import InteractiveShell

    shell, cells, calls = InteractiveShell.instance(), [], []
    with contextlib.redirect_stdout(io.StringIO()):
        shell.run_cell("%load_ext dtlib")
        shell.run_cell("%ranks start 2")
        for _ in range(50):
            shell.run_cell("%%ranks\nNone")
        for _ in range(samples):
            start = time.perf_counter()
            shell.run_cell("%%ranks\nNone")
            cells.append(time.perf_counter() - start)
        shell.run_cell("%ranks stop")
    with dtlib.LiveRanks(2) as live:
        for _ in range(50):
            live.run("None")
        for _ in range(samples):
            start = time.perf_counter()
            live.run("None")
            calls.append(time.perf_counter() - start)
    print(f"{statistics.median(cells) * 1e3:.3f} {statistics.median(calls) * 1e3:.3f}")


if __name__ == "__main__":
    main(int(sys.argv[1]))
PY
ratios=()
for pair in $(seq 1 "$pairs"); do
    read -r cell_b call_b < <(cd /tmp && PYTHONPATH=$before "$here/.venv/bin/python" "$timer" "$samples")
    read -r cell_a call_a < <(cd /tmp && PYTHONPATH=$here "$here/.venv/bin/python" "$timer" "$samples")
    echo "pair $pair: %%ranks cell $cell_a ms here, $cell_b ms at $commit; ranks.run $call_a ms here, $call_b ms there"
    ratios+=("$(python3 -c "print(round($cell_a / $cell_b, 3), round($call_a / $call_b, 3))")")
done
echo "ratios here/$commit (cell, run) per pair: ${ratios[*]}"
