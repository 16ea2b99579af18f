"""The GPU check's report (``make gpu-check``, scripts/gpu_check.sh): what the machine is, what each part of the
check did, and the benchmarks' tables as ``docs/results/*_gpu.md``. The script runs the parts; this module only
reads what they left in the log folder and writes Markdown::

    python -m dtlib.bench.gpu_report machine > build/gpu-check/machine.json
    python -m dtlib.bench.gpu_report share      # NCCL's version; 2 NCCL ranks on one GPU where NCCL allows it
    python -m dtlib.bench.gpu_report write --logs build/gpu-check --results docs/results --total-s 412.5

The log folder holds ``machine.json``, ``parts.tsv`` (one line per part: name, rc, seconds, limit in seconds,
command, note; the script appends them), ``<stem>.xml`` (a pytest part's JUnit XML), ``<stem>.out`` (a
benchmark's table) and ``<stem>.jobs`` (every job the part started, :mod:`dtlib.launch.joblog`), where ``<stem>``
is the part's name with ``-`` for spaces.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from dtlib.launch import device, joblog
from dtlib.launch.spawn import spawn

TIME_LIMIT_S = 480  # the whole check, on one H100
# A benchmark part's name, the file its table goes to, and that file's title.
TABLES = {"bench allreduce": ("collectives_gpu.md", "Collective sweep on the GPU machine"),
          "bench ddp": ("ddp_gpu.md", "DDP on the GPU machine"),
          "bench fsdp": ("fsdp_gpu.md", "DDP against FSDP on the GPU machine")}
# What a world size of 1 means for each table: one GPU runs NCCL on one rank only.
ONE_RANK_NOTES = {
    "bench allreduce": "With one rank nothing crosses a link: busbw (algbw x 2(n-1)/n, nccl-tests' factor) is 0, "
                       "and each time is NCCL's cost of one call on one GPU.",
    "bench ddp": "With one GPU every row runs one rank (NCCL refuses two ranks on one GPU): the rows set DDP's "
                 "buckets and hooks beside no wrapper at the same batch, so the speed-up column is an overhead, "
                 "not a gain from data parallelism.",
    "bench fsdp": "With one rank nothing is sharded: every row holds the whole model state, and a ring of one "
                  "sends nothing (sent/rank 0).",
}


def _driver() -> str:
    """The NVIDIA driver's version, from nvidia-smi; "unknown" where it cannot be asked."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return "unknown (nvidia-smi not found or failed)"
    versions = sorted({line.strip() for line in done.stdout.splitlines() if line.strip()})
    return ", ".join(versions) or "unknown"


#: The commit a run checks, where its checkout has no ``.git`` (a copied working tree): ``DTLIB_COMMIT=<hash>``.
COMMIT_ENV = "DTLIB_COMMIT"


def commit() -> str:
    """The commit this checkout is (short hash, ``+ changes`` when its files differ from it), from git or from
    :data:`COMMIT_ENV`; "unknown" without either. Every sentence about a GPU run cites it (docs/gpu_status.md)."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        return head + (" + changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get(COMMIT_ENV) or "unknown"


def machine() -> dict[str, object]:
    """This machine's GPUs, driver, torch, CUDA and NCCL versions (initialises CUDA: run it in its own process).

    Example: ``machine()["nccl"]`` is ``"2.27.3"`` on a CUDA build of torch, ``None`` on a CPU one.
    """
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = [torch.cuda.get_device_name(index) for index in range(count)]
    memory_gib = [torch.cuda.get_device_properties(index).total_memory / 2**30 for index in range(count)]
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if count else None
    except (AttributeError, RuntimeError):
        nccl = None
    return {"gpus": names, "gpu_memory_gib": memory_gib, "driver": _driver() if count else None,
            "torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl,
            "python": platform.python_version(), "cpu_cores": os.cpu_count(), "commit": commit()}


def describe(facts: dict[str, object]) -> str:
    """The machine in one line, e.g. ``1 x NVIDIA H100 80GB HBM3 (driver 570.86), 16 CPU cores, torch 2.11.0+cu130
    (CUDA 13.0), NCCL 2.27.3``."""
    names = Counter(facts["gpus"])
    gpus = ", ".join(f"{n} x {name}" for name, n in names.items()) or "no GPU"
    driver = f" (driver {facts['driver']})" if facts.get("driver") else ""
    return (f"{gpus}{driver}, {facts['cpu_cores']} CPU cores, torch {facts['torch']} (CUDA {facts['cuda']}), "
            f"NCCL {facts['nccl']}")


@dataclass
class Part:
    """One part of the check, as the script recorded it; ``rc`` -1 means it was not run (``note`` says why)."""

    name: str
    rc: int
    seconds: float
    limit_s: int
    command: str
    note: str = ""

    @property
    def stem(self) -> str:
        return self.name.replace(" ", "-")

    def verdict(self) -> str:
        if self.rc == 0:
            return "passed"
        if self.rc == -1:
            return f"not run: {self.note}"
        if self.rc in (124, 137):  # timeout(1): past its limit (137: killed after the grace period)
            return f"FAILED: stopped at its limit of {self.limit_s} s"
        return f"FAILED (exit status {self.rc})"


def read_parts(logs: Path) -> list[Part]:
    """The parts the script recorded in ``logs/parts.tsv``, in order."""
    parts = []
    for line in (logs / "parts.tsv").read_text().splitlines():
        if line.strip():
            name, rc, seconds, limit_s, command, *note = line.split("\t")
            command = re.sub(r" --junitxml=\S+", "", command)  # the check's own bookkeeping, not the command
            parts.append(Part(name, int(rc), float(seconds), int(limit_s), command, "\t".join(note)))
    return parts


@dataclass
class Counts:
    """A pytest run's outcome, from its JUnit XML; ``failures`` lists ``(test id, why)`` (:func:`failure_reason`)."""

    passed: int
    failed: int
    errors: int
    skipped: int
    failures: list[tuple[str, str]]
    by_file: dict[str, Counter]
    skip_reasons: Counter


def _test_id(case: ElementTree.Element) -> tuple[str, str]:
    """``(file or class, test name)`` of a JUnit test case (pytest's classname for tests/gpu/test_x.py is
    ``tests.gpu.test_x``; nbval's for a notebook, ``notebooks.00_setup_check.ipynb``)."""
    return case.get("classname", ""), case.get("name", "")


_ANSI = re.compile(r"(?:\x1b|#x1B)\[[0-9;]*m")  # colours, raw or as JUnit XML escapes them
_RAISED = re.compile(r"^\s*(?:[\w.]*(?:Error|Exception|Timeout|Interrupt)\b[^:\n]*: .*|rank \d+ raised .*)$")


def failure_reason(text: str) -> str:
    """The line that says why a test failed: the last exception line of its report (a ``WorkerError: 2 ranks
    failed:`` line carries the first rank's reason after it), else the line after nbval's ``Traceback:``, else
    its first line; colours removed, at most 300 characters. Example: nbval's "Notebook cell execution failed"
    report gives "NameError: name 'rows' is not defined"."""
    lines = [line.rstrip() for line in _ANSI.sub("", text).splitlines() if line.strip()]
    raised = [i for i, line in enumerate(lines) if _RAISED.match(line)]
    if not raised:  # nbval's "Cell outputs differ" report says how after its "Traceback:" line
        after = [lines[i + 1] for i, line in enumerate(lines[:-1]) if line.strip() == "Traceback:"]
        return (after or lines or [""])[0].strip()[:300]
    first_worker = next((i for i in raised if lines[i].lstrip().startswith("WorkerError")), None)
    at = first_worker if first_worker is not None else raised[-1]
    reason = lines[at].strip()
    if reason.endswith(":") and at + 1 < len(lines):
        reason += " " + lines[at + 1].strip()
    return reason[:300]


def junit_counts(path: Path) -> Counts | None:
    """Passed, failed, errors and skipped in a JUnit XML file, overall and per file; None if there is none."""
    if not path.is_file():
        return None
    try:
        root = ElementTree.parse(path).getroot()
    except ElementTree.ParseError:
        return None
    outcome: Counter = Counter()
    by_file: dict[str, Counter] = {}
    failures, skip_reasons = [], Counter()
    for case in root.iter("testcase"):
        kind = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        kind = {"failure": "failed", "error": "errors"}.get(kind, kind)
        outcome[kind] += 1
        where, name = _test_id(case)
        by_file.setdefault(where, Counter())[kind] += 1
        if kind in ("failed", "errors"):
            child = next(child for child in case if child.tag in ("failure", "error"))
            failures.append((f"{where}::{name}", failure_reason(f"{child.get('message') or ''}\n{child.text or ''}")))
        if kind == "skipped":
            skip_reasons[next(child for child in case if child.tag == "skipped").get("message", "")] += 1
    return Counts(outcome["passed"], outcome["failed"], outcome["errors"], outcome["skipped"], failures, by_file,
                  skip_reasons)


def table_file(part: Part, facts: dict[str, object], table: str, measured: str) -> str:
    """A ``docs/results/*_gpu.md`` file: the machine, the command and its time, the table, what it means."""
    name, title = TABLES[part.name][0], TABLES[part.name][1]
    world_size = int(part.command.split("--world-size ")[1].split()[0])
    ranks = "1 rank" if world_size == 1 else f"{world_size} ranks"
    where = "NCCL, one GPU per rank" if facts["gpus"] else "gloo on the CPU (no GPU: a run that tests the check itself)"
    cpu_table = name.replace("_gpu", "_cpu")
    lines = [f"# {title}", "",
             f"Machine: {describe(facts)}. {ranks}, {where}. Measured {measured} by `make gpu-check` "
             f"(scripts/gpu_check.sh; its run: [gpu_run.md](gpu_run.md)), in {part.seconds:.0f} s. Command:", "",
             f"    {part.command}", "", "```", table.rstrip(), "```"]
    if world_size == 1:
        lines += ["", ONE_RANK_NOTES[part.name]]
    lines += ["", f"The CPU machine's tables (gloo, 2 CPU cores): [{cpu_table}]({cpu_table})."]
    return "\n".join(lines) + "\n"


COLUMNS = ("nccl", "gloo: fewer GPUs than ranks", "gloo: asked for")  # joblog.why's columns, in the table's order


def world_size_section(parts: list[Part], logs: Path, gpus: int) -> list[str]:
    """``## What ran at each world size``: per part and world size, the jobs on NCCL, those on gloo because the
    machine had fewer GPUs than ranks, and those that asked for gloo; then a sentence on what lack of GPUs left
    out. No lines where no part left a job log."""
    rows, short = [], Counter()
    for part in parts:
        for size, columns in joblog.by_world_size(joblog.read(logs / f"{part.stem}.jobs")).items():
            rows.append(f"| {part.name} | {size} | " + " | ".join(str(columns[column]) for column in COLUMNS) + " |")
            short[size] += columns[COLUMNS[1]]
    if not rows:
        return []
    lines = ["", "## What ran at each world size", "",
             "Every job the parts started (`dtlib.spawn`, live ranks, `dtlib.run` under torchrun), from "
             "`DTLIB_JOB_LOG`. Each live-rank restart is a job of its own.", "",
             "| part | world size | NCCL | gloo: fewer GPUs than ranks | gloo: asked for |",
             "|---|---:|---:|---:|---:|", *rows, ""]
    missing = {size: n for size, n in short.items() if n}
    if missing:
        told = ", ".join(f"{n} at {size} ranks" for size, n in sorted(missing.items()))
        lines.append(f"Not run on NCCL for lack of GPUs ({gpus} here): {told}. They ran on gloo on the CPU; a "
                     "machine with a GPU per rank runs them on NCCL.")
    else:
        lines.append(f"Every job that asked for NCCL, or for the machine's own backend, got NCCL ({gpus} GPU(s)).")
    return lines


def run_file(parts: list[Part], facts: dict[str, object], counts: dict[str, Counts | None], total_s: float,
             measured: str, logs: Path | None = None) -> str:
    """``docs/results/gpu_run.md``: the machine, each part's verdict, counts and time, the commands, the failures."""
    passed = sum(part.rc == 0 for part in parts)
    gib = ", ".join(f"{g:.1f} GiB" for g in facts["gpu_memory_gib"])
    lines = ["# The GPU check", "",
             f"`make gpu-check` (scripts/gpu_check.sh), {measured}, at commit {facts.get('commit', 'unknown')}: "
             f"{passed} of {len(parts)} parts passed, in {total_s:.0f} s (its limit: {TIME_LIMIT_S} s on one H100).",
             "",
             "| machine | |", "|---|---|",
             f"| GPUs | {', '.join(facts['gpus']) or 'none'} ({gib or '-'}) |",
             f"| driver | {facts['driver'] or '-'} |",
             f"| torch | {facts['torch']} |", f"| CUDA (torch's build) | {facts['cuda'] or '-'} |",
             f"| NCCL | {facts['nccl'] or '-'} |", f"| Python | {facts['python']} |",
             f"| CPU cores | {facts['cpu_cores']} |",
             "", "| part | verdict | passed | failed | errors | skipped | time (s) | limit (s) |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for part in parts:
        found = counts.get(part.name)
        numbers = [found.passed, found.failed, found.errors, found.skipped] if found else ["-"] * 4
        lines.append(f"| {part.name} | {part.verdict()} | {' | '.join(map(str, numbers))} | {part.seconds:.1f} | "
                     f"{part.limit_s} |")
    lines += ["", "Commands, from the repository root, with `PYTHONPATH=$PWD`, `DTLIB_GPU_SUITE=1` and "
                  "`DTLIB_BACKEND` unset (so that `backend=\"auto\"` is NCCL wherever there is a GPU per rank):", ""]
    lines += [f"    {part.command}" for part in parts]
    notebooks = counts.get("notebooks")
    if notebooks and notebooks.by_file:
        lines += ["", "## Notebooks (nbval, one test per cell)", "",
                  "| notebook | passed | failed | errors | skipped |", "|---|---:|---:|---:|---:|"]
        for where, outcome in sorted(notebooks.by_file.items()):
            numbers = " | ".join(str(outcome[kind]) for kind in ("passed", "failed", "errors", "skipped"))
            lines.append(f"| {where.removeprefix('notebooks.')} | {numbers} |")
    lines += world_size_section(parts, logs, len(facts["gpus"])) if logs is not None else []
    failures = [(part.name, failure) for part in parts if counts.get(part.name)
                for failure in counts[part.name].failures]
    if failures:
        lines += ["", "## Failures", ""]
        lines += [f"- {name}: `{test}`: {message}" for name, (test, message) in failures]
    skipped = [(part.name, reason, n) for part in parts if counts.get(part.name)
               for reason, n in counts[part.name].skip_reasons.most_common()]
    if skipped:
        lines += ["", "## Skipped", ""]
        lines += [f"- {name}: {n} x {reason or '(no reason given)'}" for name, reason, n in skipped]
    return "\n".join(lines) + "\n"


def write(logs: Path, results: Path, total_s: float) -> list[Path]:
    """Write ``gpu_run.md``, and the table of every benchmark that passed, into ``results``; the paths written."""
    facts = json.loads((logs / "machine.json").read_text())
    parts = read_parts(logs)
    measured = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    counts = {part.name: junit_counts(logs / f"{part.stem}.xml") for part in parts if part.name not in TABLES}
    results.mkdir(parents=True, exist_ok=True)
    written = []
    for part in parts:
        table = logs / f"{part.stem}.out"
        if part.name in TABLES and part.rc == 0 and table.is_file() and table.read_text().strip():
            path = results / TABLES[part.name][0]
            path.write_text(table_file(part, facts, table.read_text(), measured))
            written.append(path)
    path = results / "gpu_run.md"
    path.write_text(run_file(parts, facts, counts, total_s, measured, logs))
    return [path, *written]


def _summed(rank: int, world_size: int) -> float:
    value = torch.tensor([rank + 1.0], device=device.rank_device())
    dist.all_reduce(value)
    return value.item()


def share() -> str:
    """The line the check prints first: this torch's NCCL, and two NCCL ranks all-reducing on one GPU where NCCL
    2.30's opt-in allows it (``NCCL_MULTI_RANK_GPU_ENABLE=1``, set here for the two ranks), else why not."""
    version = device.nccl_version()
    said = "no NCCL" if version is None else "NCCL " + ".".join(map(str, version))
    if not torch.cuda.is_available():
        return f"{said}; no GPU: two NCCL ranks on one GPU not tried"
    before = {name: os.environ.get(name) for name in (device.MULTI_RANK_GPU, "CUDA_VISIBLE_DEVICES")}
    os.environ[device.MULTI_RANK_GPU] = "1"  # for this probe's two ranks only
    os.environ["CUDA_VISIBLE_DEVICES"] = (before["CUDA_VISIBLE_DEVICES"] or "0").split(",")[0]  # one GPU
    try:
        why = device.why_gpus_cannot_be_shared()
        if why is not None:
            return f"{said}; two NCCL ranks on one GPU not tried: {why}"
        sums = spawn(_summed, 2, backend="nccl", timeout=60, output="none")
    except Exception as err:  # noqa: BLE001 - the probe reports; the check goes on
        return f"{said}; two NCCL ranks on one GPU failed: {type(err).__name__}: {str(err)[:300]}"
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return f"{said}; two NCCL ranks on one GPU all-reduced 1 + 2: {sums} ({'right' if sums == [3.0, 3.0] else 'WRONG'})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtlib.bench.gpu_report", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="what", required=True)
    commands.add_parser("machine", help="this machine's GPUs and versions, as JSON")
    commands.add_parser("share", help="NCCL's version, and two NCCL ranks on one GPU where NCCL allows it")
    writer = commands.add_parser("write", help="gpu_run.md and the _gpu tables from the check's log folder")
    writer.add_argument("--logs", type=Path, required=True)
    writer.add_argument("--results", type=Path, required=True)
    writer.add_argument("--total-s", type=float, required=True, help="the whole check's wall time, seconds")
    options = parser.parse_args(argv)
    if options.what == "machine":
        print(json.dumps(machine(), indent=2))
        return 0
    if options.what == "share":
        print(f"gpu-check: {share()}")
        return 0
    for path in write(options.logs, options.results, options.total_s):
        print(f"gpu-check: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
