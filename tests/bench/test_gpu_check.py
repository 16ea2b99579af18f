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


@pytest.mark.timeout(120)
def test_without_cuda_the_check_says_what_it_would_run_writes_nothing_and_exits_0(tmp_path):
    results, logs = tmp_path / "results", tmp_path / "logs"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable, "GPU_CHECK_RESULTS": str(results),
           "GPU_CHECK_LOGS": str(logs)}  # no GPU to torch, even on a machine with some
    done = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("gpu-check: no CUDA GPU here"), done.stdout
    for expected in ("tests/gpu/test_gpu_collectives.py tests/gpu/test_gpu_tensor_parallel.py", "-m gpu",
                     "tests/train/test_fsdp.py", "--nbval-lax notebooks/", "two NCCL ranks on one GPU",
                     f"{results}/gpu_run.md"):
        assert expected in done.stdout, expected
    plans = done.stdout.split("GPU(s): N = ")[1:]  # the plan for 1, 2, 4 and 8 GPUs
    assert [int(plan.split(",")[0]) for plan in plans] == [1, 2, 4, 8], done.stdout
    for ranks, plan in zip((1, 2, 4, 8), plans, strict=True):
        for bench in ("allreduce", "ddp", "fsdp"):
            assert f"dtlib.bench {bench} --world-size {ranks} " in plan, plan
        limits = [int(line.split("at most")[1].split()[0]) for line in plan.splitlines() if "s: python" in line]
        assert len(limits) == 5 and f"at most {sum(limits)} s in all" in plan
        assert sum(limits) <= 600 - 30  # a lent machine's command runs 10 minutes at most: room for the report
    one_gpu = [int(line.split("at most")[1].split()[0]) for line in plans[0].splitlines() if "s: python" in line]
    assert sum(one_gpu) <= gpu_report.TIME_LIMIT_S - 30  # measured on one H100: 285 s of it used
    assert not results.exists() and not logs.exists()


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
