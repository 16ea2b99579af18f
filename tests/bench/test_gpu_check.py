"""make gpu-check (scripts/gpu_check.sh) where there is no GPU, the report it writes where there is one (from a log
folder made here), and the notebook code that the GPU tests take from the notebooks."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dtlib.bench import gpu_report

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _plans(tmp_path: Path, cores: int) -> tuple[subprocess.CompletedProcess, list[str]]:
    """The script's output without a GPU, planned for ``cores`` CPU cores, and its plan for 1, 2, 4 and 8 GPUs."""
    results, logs = tmp_path / "results", tmp_path / "logs"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable, "GPU_CHECK_RESULTS": str(results),
           "GPU_CHECK_LOGS": str(logs), "GPU_CHECK_CORES": str(cores)}  # no GPU to torch, even on a machine with some
    done = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not results.exists() and not logs.exists()
    return done, done.stdout.split("GPU(s): N = ")[1:]


def _limits(plan: str) -> dict[str, int]:
    return {line.split()[0] + (" " + line.split()[1] if line.split()[0] == "bench" else ""):
            int(line.split("at most")[1].split()[0]) for line in plan.splitlines() if "s: python" in line}


@pytest.mark.timeout(120)
def test_without_cuda_the_check_says_what_it_would_run_writes_nothing_and_exits_0(tmp_path):
    done, plans = _plans(tmp_path, cores=16)  # the lent machine's cores
    assert done.stdout.startswith("gpu-check: no CUDA GPU here"), done.stdout
    for expected in ("tests/gpu/test_gpu_collectives.py tests/gpu/test_gpu_tensor_parallel.py", "-m gpu",
                     "tests/train/test_fsdp.py", "--nbval-lax notebooks/", "two NCCL ranks on one GPU",
                     f"{tmp_path / 'results'}/gpu_run.md"):
        assert expected in done.stdout, expected
    assert [int(plan.split(",")[0]) for plan in plans] == [1, 2, 4, 8], done.stdout
    for ranks, plan in zip((1, 2, 4, 8), plans, strict=True):
        for bench in ("allreduce", "ddp", "fsdp"):
            assert f"dtlib.bench {bench} --world-size {ranks} " in plan, plan
        limits = _limits(plan)
        assert len(limits) == 5 and f"at most {sum(limits.values())} s in all" in plan
        assert f"jobs of at most {ranks} rank(s) on NCCL" in plan
        assert ("larger ones on gloo for lack of GPUs" in plan) == (ranks < 8)
    # one H100 (16 cores) measured 285 s of it; a lent machine's command runs 10 minutes at most
    assert sum(_limits(plans[0]).values()) <= gpu_report.TIME_LIMIT_S - 30
    assert sum(_limits(plans[1]).values()) <= 600 - 30


@pytest.mark.timeout(120)  # one script run, 6 s on a quiet laptop: each machine its own test, its own limit
@pytest.mark.parametrize(("cores", "workers"), [(16, [7, 7, 4, 2]), (96, [7, 7, 7, 7]), (2, [1, 1, 1, 1])])
def test_the_notebook_workers_get_a_core_per_nccl_rank_and_their_limit_grows_as_they_shrink(tmp_path, cores, workers):
    _, plans = _plans(tmp_path, cores)
    assert [int(plan.split(", ")[1].split()[0]) for plan in plans] == workers, cores
    for plan, count in zip(plans, workers, strict=True):
        (notebooks,) = [line for line in plan.splitlines() if "--nbval-lax" in line]
        assert f"notebooks/ -n {count} --dist" in notebooks if count > 1 else "notebooks/ -q" in notebooks
    # the same work shared by fewer workers: each doubling's limit times the workers stays put (rounded up)
    first = _limits(plans[0])["notebooks"] * workers[0]
    assert all(0 <= _limits(plan)["notebooks"] * count - first - 25 * doubling * 7 < count
               for doubling, (plan, count) in enumerate(zip(plans, workers, strict=True)))
    if cores == 96:  # enough cores: every plan fits one call of a lent machine
        assert all(sum(_limits(plan).values()) <= 600 - 30 for plan in plans)


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


H100 = {"gpus": ["NVIDIA H100 80GB HBM3"], "gpu_memory_gib": [79.2], "driver": "570.86.15", "torch": "2.11.0+cu130",
        "cuda": "13.0", "nccl": "2.27.7", "python": "3.12.3", "cpu_cores": 16}
JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="5">
<testcase classname="tests.gpu.test_gpu_collectives" name="test_a" time="1.0"/>
<testcase classname="tests.gpu.test_gpu_collectives" name="test_b" time="1.0">
  <failure message="AssertionError: all_reduce on rank 0&#10;second line">traceback</failure></testcase>
<testcase classname="tests.gpu.test_gpu_training" name="test_c" time="1.0">
  <skipped type="pytest.skip" message="needs 2 CUDA GPUs">skip</skipped></testcase>
<testcase classname="tests.gpu.test_gpu_training" name="test_d" time="1.0">
  <skipped type="pytest.skip" message="needs 2 CUDA GPUs">skip</skipped></testcase>
<testcase classname="tests.train.test_fsdp" name="test_e" time="1.0">
  <error message="fixture blew up">x</error></testcase>
</testsuite></testsuites>"""
NBVAL = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="3">
<testcase classname="notebooks.00_setup_check.ipynb" name="Cell 0" time="1.0"/>
<testcase classname="notebooks.00_setup_check.ipynb" name="Cell 1" time="1.0"/>
<testcase classname="notebooks.02_collectives.ipynb" name="Cell 4" time="1.0"><failure message="output differs">
</failure></testcase></testsuite></testsuites>"""
TABLE = "# dtlib.bench ddp: torch 2.11.0+cu130, ...\n# setting  ranks\n  1 rank, whole global batch  1\n"


@pytest.fixture
def logs(tmp_path):
    """A log folder as scripts/gpu_check.sh leaves it: one part failed, one not run, one timed out."""
    folder = tmp_path / "logs"
    folder.mkdir()
    (folder / "machine.json").write_text(json.dumps(H100))
    rows = [("gpu tests", 1, 61.2, 120, "python -m pytest tests -m gpu", ""),
            ("notebooks", 1, 150.0, 190, "python -m pytest --nbval-lax notebooks/", ""),
            ("bench allreduce", 124, 30.1, 30, "python -m dtlib.bench allreduce --world-size 1", ""),
            ("bench ddp", 0, 20.5, 40, "python -m dtlib.bench ddp --world-size 1 --steps 12", ""),
            ("bench fsdp", -1, 0, 40, "python -m dtlib.bench fsdp --world-size 2", "no reason at all")]
    (folder / "parts.tsv").write_text("".join("\t".join(map(str, row)) + "\n" for row in rows))
    (folder / "gpu-tests.xml").write_text(JUNIT)
    (folder / "notebooks.xml").write_text(NBVAL)
    (folder / "bench-allreduce.out").write_text("# half a table\n")
    (folder / "bench-ddp.out").write_text(TABLE)
    return folder


def test_the_report_gives_each_parts_verdict_counts_and_failures(logs, tmp_path):
    written = gpu_report.write(logs, tmp_path / "results", total_s=262.0)
    assert [path.name for path in written] == ["gpu_run.md", "ddp_gpu.md"]  # only a benchmark that passed
    report = written[0].read_text()
    for line in ("| GPUs | NVIDIA H100 80GB HBM3 (79.2 GiB) |", "| driver | 570.86.15 |", "| NCCL | 2.27.7 |",
                 "| torch | 2.11.0+cu130 |", "| CUDA (torch's build) | 13.0 |",
                 "| gpu tests | FAILED (exit status 1) | 1 | 1 | 1 | 2 | 61.2 | 120 |",
                 "| notebooks | FAILED (exit status 1) | 2 | 1 | 0 | 0 | 150.0 | 190 |",
                 "| bench allreduce | FAILED: stopped at its limit of 30 s | - | - | - | - | 30.1 | 30 |",
                 "| bench ddp | passed | - | - | - | - | 20.5 | 40 |",
                 "| bench fsdp | not run: no reason at all | - | - | - | - | 0.0 | 40 |",
                 "| 00_setup_check.ipynb | 2 | 0 | 0 | 0 |", "| 02_collectives.ipynb | 0 | 1 | 0 | 0 |",
                 "- gpu tests: `tests.gpu.test_gpu_collectives::test_b`: AssertionError: all_reduce on rank 0",
                 "- gpu tests: `tests.train.test_fsdp::test_e`: fixture blew up",
                 "- notebooks: `notebooks.02_collectives.ipynb::Cell 4`: output differs",
                 "- gpu tests: 2 x needs 2 CUDA GPUs", "    python -m dtlib.bench ddp --world-size 1 --steps 12"):
        assert line in report.splitlines(), line
    assert "1 of 5 parts passed, in 262 s" in report


def test_a_table_file_names_the_machine_command_and_what_one_rank_means(logs, tmp_path):
    (path,) = [p for p in gpu_report.write(logs, tmp_path / "results", total_s=1.0) if p.name == "ddp_gpu.md"]
    text = path.read_text()
    assert text.startswith("# DDP on the GPU machine\n")
    assert "Machine: 1 x NVIDIA H100 80GB HBM3 (driver 570.86.15), 16 CPU cores, torch 2.11.0+cu130 (CUDA 13.0), " \
           "NCCL 2.27.7. 1 rank, NCCL, one GPU per rank." in text
    assert "\n    python -m dtlib.bench ddp --world-size 1 --steps 12\n" in text
    assert f"```\n{TABLE}```" in text
    assert gpu_report.ONE_RANK_NOTES["bench ddp"] in text and "[ddp_cpu.md](ddp_cpu.md)" in text


def test_a_failure_is_told_by_its_exception_not_by_nbvals_coloured_headline():
    """The first GPU run's reports, as its JUnit XML held them: the reason is the exception, colours gone."""
    cell = ("#x1B[91mNotebook cell execution failed#x1B[0m\n#x1B[94mCell 0: Cell execution caused an exception\n"
            "Traceback (most recent call last):\n  File \"x.py\", line 1\n"
            "WorkerError: 3 ranks failed (1, 2, 3):\n  rank 1 raised AcceleratorError: CUDA error: invalid device "
            "ordinal\nGPU device may be out of range\n--- remote traceback of rank 1 ---\n"
            "torch.AcceleratorError: CUDA error: invalid device ordinal\n")
    assert gpu_report.failure_reason(cell) == ("WorkerError: 3 ranks failed (1, 2, 3): rank 1 raised "
                                               "AcceleratorError: CUDA error: invalid device ordinal")
    assert gpu_report.failure_reason("NameError\nTraceback\nNameError: name 'rows' is not defined\n") == \
        "NameError: name 'rows' is not defined"
    differs = ("#x1B[91mNotebook cell execution failed#x1B[0m\nCell 19: Cell outputs differ\n\n#x1B[94mTraceback:"
               "#x1B[0m\n#x1B[91mUnexpected output fields from running code: {'stderr'}#x1B[0m\n")
    assert gpu_report.failure_reason(differs) == "Unexpected output fields from running code: {'stderr'}"
    assert gpu_report.failure_reason("AssertionError\n") == "AssertionError"
    assert gpu_report.failure_reason("") == ""


def test_no_junit_file_means_no_counts(tmp_path):
    assert gpu_report.junit_counts(tmp_path / "missing.xml") is None
    (tmp_path / "cut.xml").write_text("<testsuites><testsuite>")  # a run stopped while writing it
    assert gpu_report.junit_counts(tmp_path / "cut.xml") is None


def _notebook_code():
    spec = importlib.util.spec_from_file_location("notebook_code", ROOT / "tests" / "gpu" / "notebook_code.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_tests_find_the_notebooks_rank_functions_and_run_nothing_else():
    """What tests/gpu takes from notebooks 04 and 09 is still there; their cells' spawns and magics are left out."""
    code = _notebook_code()
    tp = code.definitions("09_tensor_parallel.ipynb", ["Attention", "Block", "TP_PLAN", "SP_PLAN",
                                                       "reduce_partial_gradients", "tp_block", "vocab_parallel_loss"])
    assert callable(tp["tp_block"]) and set(tp["SP_PLAN"]) > set(tp["TP_PLAN"])
    assert "sp" not in tp and "report" not in tp  # `sp = dtlib.spawn(...)` and the printing cells did not run
    assert callable(code.definitions("04_ddp.ipynb", ["bind_device", "batchnorm_statistics"])["batchnorm_statistics"])
    with pytest.raises(LookupError, match=r"no longer defines \['tp_block_renamed'\]"):
        code.definitions("09_tensor_parallel.ipynb", ["tp_block_renamed"])


def test_the_share_probe_says_why_it_did_not_try_two_nccl_ranks_on_one_gpu(monkeypatch):
    """The check's first line: this torch's NCCL, and two ranks on one GPU only where NCCL 2.30 allows it. On the
    lent GPU's NCCL 2.28.9 it must say so rather than start ranks NCCL refuses."""
    import torch

    monkeypatch.delenv("NCCL_MULTI_RANK_GPU_ENABLE", raising=False)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 28, 9))
    assert gpu_report.share() == "NCCL 2.28.9; no GPU: two NCCL ranks on one GPU not tried"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    said = gpu_report.share()
    assert said.startswith("NCCL 2.28.9; two NCCL ranks on one GPU not tried: NCCL_MULTI_RANK_GPU_ENABLE=1 asks"), said
    assert "needs NCCL 2.30 or later" in said
    assert "NCCL_MULTI_RANK_GPU_ENABLE" not in os.environ  # the probe's switch is its ranks' alone


def test_the_report_says_what_ran_at_each_world_size_and_what_lack_of_gpus_left_on_gloo(logs, tmp_path):
    def job(size: int, asked: str, backend: str) -> str:
        return json.dumps({"launcher": "spawn", "world_size": size, "asked": asked, "backend": backend, "gpus": 1})
    lines = [job(1, "auto", "nccl"), job(2, "auto", "gloo"), job(2, "auto", "gloo"), job(2, "gloo", "gloo"),
             job(4, "nccl", "gloo"), '{"launcher": "spawn", "world_si']  # the last cut short as it was written
    (logs / "notebooks.jobs").write_text("\n".join(lines))
    (logs / "gpu-tests.jobs").write_text(job(1, "auto", "nccl") + "\n")
    report = gpu_report.write(logs, tmp_path / "results", total_s=1.0)[0].read_text().splitlines()
    for line in ("## What ran at each world size", "| gpu tests | 1 | 1 | 0 | 0 |", "| notebooks | 1 | 1 | 0 | 0 |",
                 "| notebooks | 2 | 0 | 2 | 1 |", "| notebooks | 4 | 0 | 1 | 0 |",
                 "Not run on NCCL for lack of GPUs (1 here): 2 at 2 ranks, 1 at 4 ranks. They ran on gloo on the CPU; "
                 "a machine with a GPU per rank runs them on NCCL."):
        assert line in report, line


def test_no_job_logs_no_world_size_section(logs, tmp_path):
    report = gpu_report.write(logs, tmp_path / "results", total_s=1.0)[0].read_text()
    assert "## What ran at each world size" not in report
