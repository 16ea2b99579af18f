#!/usr/bin/env bash
# make gpu-check: one command that checks a machine with NVIDIA GPUs and the course on it, in at most 8 minutes
# on one H100 (each part stops at its own limit below: 420 s in all, 445 s with the grace periods; the first run,
# 2026-11-26 on one H100, took 34 s for the GPU tests and 172 s for the notebooks, 285 s in all):
#   1. the GPU tests: every test marked gpu (tests/gpu, and those beside the CPU tests), NCCL with a GPU per rank
#      and gloo with several ranks on one GPU, each against a one-process oracle;
#   2. every notebook under nbval, its ranks on the machine's own backend (NCCL where there is a GPU per rank);
#   3. python -m dtlib.bench allreduce, ddp and fsdp at small sizes, on NCCL: docs/results/collectives_gpu.md,
#      ddp_gpu.md and fsdp_gpu.md;
# then writes docs/results/gpu_run.md: the GPUs, driver, torch, CUDA and NCCL versions, each part's pass and fail
# counts and time (dtlib/bench/gpu_report.py). Exit status 0 when every part passed, else 1.
#
#   make gpu-check                  # .venv's python where make setup made one, else python3
#   PYTHON=python3 scripts/gpu_check.sh     # a machine without make setup: plain python3, PYTHONPATH=$PWD
#
# Without a CUDA GPU it prints what it would run and exits 0. Settings (environment):
#   GPU_CHECK_RESULTS  where the tables and gpu_run.md go (default docs/results)
#   GPU_CHECK_LOGS     where each part's log, JUnit XML and table go (default build/gpu-check)
#   GPU_CHECK_NOTEBOOKS  the notebooks to run (default: notebooks/, all of them)
#   GPU_CHECK_ANYWAY=1   run the parts even without a GPU (to test this script; its tables are then the CPU's)
#   GPU_CHECK_CORES      the CPU cores to plan for (default: this machine's)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
if [ -z "${PYTHON:-}" ]; then
    if [ -x "${VENV:-.venv}/bin/python" ]; then PYTHON=${VENV:-.venv}/bin/python; else PYTHON=python3; fi
fi
RESULTS=${GPU_CHECK_RESULTS:-docs/results}
LOGS=${GPU_CHECK_LOGS:-build/gpu-check}
NOTEBOOKS=${GPU_CHECK_NOTEBOOKS:-notebooks/}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # dtlib from this checkout, installed or not
export PYTHONUNBUFFERED=1
export DTLIB_GPU_SUITE=1  # tests/conftest.py then leaves backend="auto" to the machine: NCCL with a GPU per rank
unset DTLIB_BACKEND

say() { echo "gpu-check: $*"; }

if ! gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)'); then
    say "$PYTHON cannot import torch; set PYTHON to a Python with a CUDA build of torch" >&2
    exit 1
fi
cores=${GPU_CHECK_CORES:-$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)}
has() { "$PYTHON" -c "import $1" 2>/dev/null; }

xdist() {  # pytest-xdist's options for $1 workers, where it is installed and more than one would help
    if [ "$1" -gt 1 ] && has xdist; then echo "-n $1 --dist loadfile"; fi
}
# The test files with a test marked gpu (collecting only them keeps the CPU suite's imports out of this check).
gpu_test_files=$(grep -rlE --include='test_*.py' 'pytest\.mark\.gpu' tests | sort | tr '\n' ' ')

plan() {  # plan GPUS: sets ranks, the workers and PARTS for a machine with GPUS GPUs and this machine's cores
    # World size: one rank per GPU (NCCL before 2.30 refuses two ranks on one GPU), a power of two up to 8, which
    # divides the benchmarks' global batches (ddp: 2048 samples, fsdp: 16).
    ranks=1 doublings=0
    while [ $((ranks * 2)) -le "$1" ] && [ $((ranks * 2)) -le 8 ]; do ranks=$((ranks * 2)) doublings=$((doublings + 1)); done
    # With more GPUs the notebooks' 2- to 8-rank cells take NCCL, each rank a CUDA context and an NCCL init: the
    # limits grow with each doubling of the ranks. An NCCL rank keeps a core busy while it waits (CUDA spins on a
    # synchronise, NCCL's proxy thread polls), where gloo's ranks sleep, so the notebook workers get a core for
    # each NCCL rank a cell may start: cores / max(2, N), at most 7. With fewer workers the notebooks' limit grows
    # in proportion (1 GPU, 16 cores, 7 workers: 172 s measured of its 220; the rest are a GPU run's to confirm).
    notebook_workers=$(( cores / (ranks > 2 ? ranks : 2) ))
    notebook_workers=$(( notebook_workers < 1 ? 1 : (notebook_workers > 7 ? 7 : notebook_workers) ))
    notebook_limit=$(( ((220 + 25 * doublings) * 7 + notebook_workers - 1) / notebook_workers ))
    test_workers=$(( cores >= 6 ? 3 : 1 ))
    # name | limit in seconds | command (python stands for $PYTHON)
    PARTS=(
        "gpu tests|$((90 + 10 * doublings))|python -m pytest -p no:cacheprovider $gpu_test_files-m gpu --continue-on-collection-errors $(xdist "$test_workers") -q --junitxml=$LOGS/gpu-tests.xml"
        "notebooks|$notebook_limit|python -m pytest -p no:cacheprovider --nbval-lax $NOTEBOOKS $(xdist "$notebook_workers") -q --junitxml=$LOGS/notebooks.xml"
        "bench allreduce|$((30 + 5 * doublings))|python -m dtlib.bench allreduce --world-size $ranks --min-bytes 1K --max-bytes 256M --iters 20 --warmup 5"
        "bench ddp|$((40 + 5 * doublings))|python -m dtlib.bench ddp --world-size $ranks --steps 12"
        "bench fsdp|$((40 + 5 * doublings))|python -m dtlib.bench fsdp --world-size $ranks --steps 6"
    )
    PARTS=("${PARTS[@]//  / }")  # where xdist added nothing
}
plan "$gpus"

if [ "$gpus" -eq 0 ] && [ -z "${GPU_CHECK_ANYWAY:-}" ]; then
    torch_version=$("$PYTHON" -c 'import torch; print(torch.__version__)')
    say "no CUDA GPU here ($PYTHON: torch $torch_version): nothing to check, nothing written."
    if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
        say "nvidia-smi sees GPUs, but this torch cannot use them: run it with a CUDA build, PYTHON=/path/to/python"
    fi
    say "on a machine with GPUs it runs, from $ROOT, with PYTHONPATH=$ROOT, DTLIB_GPU_SUITE=1, DTLIB_BACKEND unset"
    say "first: NCCL's version, and two NCCL ranks on one GPU where NCCL 2.30's opt-in allows it (never fatal)"
    say "then, on $cores CPU cores, by the machine's GPUs (N = one rank per GPU: a power of two up to 8; each part"
    say "stops at its limit; the limits past one GPU are a GPU run's to confirm):"
    for count in 1 2 4 8; do
        plan "$count"
        total=0
        for part in "${PARTS[@]}"; do IFS='|' read -r _ limit _ <<<"$part"; total=$((total + limit)); done
        echo "  $count GPU(s): N = $ranks, $notebook_workers notebook worker(s), at most $total s in all;" \
             "jobs of at most $ranks rank(s) on NCCL$([ "$ranks" -lt 8 ] && echo ", larger ones on gloo for lack of GPUs")"
        for part in "${PARTS[@]}"; do
            IFS='|' read -r name limit command <<<"$part"
            printf '    %-16s at most %3s s: %s\n' "$name" "$limit" "$command"
        done
    done
    say "then writes $RESULTS/gpu_run.md and $RESULTS/{collectives,ddp,fsdp}_gpu.md"
    exit 0
fi

mkdir -p "$LOGS" || exit 1
for part in "${PARTS[@]}"; do  # this check's own files from an earlier run, nothing else in the folder
    stem=${part%%|*} && stem=${stem// /-}
    rm -f "$LOGS/$stem.xml" "$LOGS/$stem.out" "$LOGS/$stem.err" "$LOGS/$stem.log" "$LOGS/$stem.jobs"
done
: >"$LOGS/parts.tsv"
limited=(timeout -k 5 -s INT)  # each part stops at its limit (SIGINT first: pytest still writes its report)
command -v timeout >/dev/null || { limited=(); say "no timeout(1) here: the parts run without their limits"; }
started=$(date +%s.%N)
say "$gpus GPU(s), $cores CPU cores, $PYTHON; logs in $LOGS"
"$PYTHON" -m dtlib.bench.gpu_report machine >"$LOGS/machine.json" || { say "cannot read the machine's versions"; exit 1; }
cat "$LOGS/machine.json"
# NCCL's version, and 2 NCCL ranks on one GPU where NCCL 2.30's opt-in allows it: reported, never fatal
"${limited[@]}" ${limited[@]:+90} "$PYTHON" -m dtlib.bench.gpu_report share | tee "$LOGS/share.log" || \
    say "the probe of two NCCL ranks on one GPU did not finish"

elapsed() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
run_part() {  # name limit command: run it under its limit, its output shown and kept, its line in parts.tsv
    local name=$1 limit=$2 command=$3 stem=${1// /-} note="" rc
    local -a argv
    read -r -a argv <<<"$command"
    argv[0]=$PYTHON
    if [ "$name" = notebooks ] && ! { has nbval && has ipykernel; }; then
        rc=-1 note="nbval and ipykernel are not installed for $PYTHON (pip install nbval ipykernel)"
        say "$name: $note"
        printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" 0 "$limit" "$command" "$note" >>"$LOGS/parts.tsv"
        return
    fi
    say "$name (at most $limit s): $command"
    local start
    start=$(date +%s.%N)
    export DTLIB_JOB_LOG="$LOGS/$stem.jobs"  # every job the part starts: the report's "at each world size"
    if [[ "$name" == bench* ]]; then  # the table alone on stdout, kept for the results file
        "${limited[@]}" ${limited[@]:+"$limit"} "${argv[@]}" 2>"$LOGS/$stem.err" | tee "$LOGS/$stem.out"
        rc=${PIPESTATUS[0]}
        cat "$LOGS/$stem.err" >&2
    else
        "${limited[@]}" ${limited[@]:+"$limit"} "${argv[@]}" 2>&1 | tee "$LOGS/$stem.log"
        rc=${PIPESTATUS[0]}
    fi
    local seconds
    seconds=$(elapsed "$start")
    say "$name: exit status $rc after $seconds s"
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$seconds" "$limit" "$command" "$note" >>"$LOGS/parts.tsv"
}

for part in "${PARTS[@]}"; do
    IFS='|' read -r name limit command <<<"$part"
    run_part "$name" "$limit" "$command"
done

total=$(elapsed "$started")
"$PYTHON" -m dtlib.bench.gpu_report write --logs "$LOGS" --results "$RESULTS" --total-s "$total" || exit 1
failed=$(awk -F'\t' '$2 != 0' "$LOGS/parts.tsv" | cut -f1 | paste -sd, -)
if [ -n "$failed" ]; then
    say "done in $total s; failed or not run: $failed (see $RESULTS/gpu_run.md and $LOGS)"
    exit 1
fi
say "done in $total s; every part passed (see $RESULTS/gpu_run.md)"
