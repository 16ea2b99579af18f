"""``DTLIB_JOB_LOG``: every job that dtlib.spawn or live ranks start leaves one line, and nothing is written where
the variable is unset. Oracle: the world size and backend each call was given."""

from __future__ import annotations

import json

import pytest

import dtlib
from dtlib.launch import joblog


def _size(rank: int, world_size: int) -> int:
    return world_size


@pytest.mark.timeout(120)
def test_spawn_and_live_ranks_each_leave_one_line(tmp_path, monkeypatch):
    path = tmp_path / "jobs"
    monkeypatch.setenv(joblog.JOB_LOG, str(path))
    assert dtlib.spawn(_size, 2, backend="gloo", timeout=60) == [2, 2]
    assert dtlib.spawn(_size, 3, timeout=60) == [3, 3, 3]  # "auto": gloo here (tests/conftest.py)
    with dtlib.LiveRanks(2, timeout=60) as ranks:
        assert ranks.run("world_size") == [2, 2]
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(line["launcher"], line["world_size"], line["asked"], line["backend"]) for line in lines] == [
        ("spawn", 2, "gloo", "gloo"), ("spawn", 3, "auto", "gloo"), ("live", 2, "auto", "gloo")]
    assert joblog.read(path) == lines


def test_unset_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(joblog.JOB_LOG, raising=False)
    monkeypatch.chdir(tmp_path)
    joblog.record("spawn", 2, "auto", "gloo")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="launcher must be one of"):
        joblog.record("mpirun", 2, "auto", "gloo")


def test_why_a_job_ran_on_gloo():
    def job(size: int, asked: str, backend: str, gpus: int) -> dict[str, object]:
        return {"world_size": size, "asked": asked, "backend": backend, "gpus": gpus}
    assert joblog.why(job(2, "auto", "nccl", 2)) == "nccl"
    assert joblog.why(job(4, "auto", "gloo", 2)) == "gloo: fewer GPUs than ranks"
    assert joblog.why(job(4, "auto", "gloo", 0)) == "gloo: fewer GPUs than ranks"
    assert joblog.why(job(2, "gloo", "gloo", 8)) == "gloo: asked for"
    assert joblog.why(job(2, "auto", "gloo", 8)) == "gloo: asked for"  # DTLIB_BACKEND=gloo, or no NCCL in torch
    assert joblog.by_world_size([job(2, "auto", "nccl", 2), job(4, "auto", "gloo", 2), job(4, "auto", "gloo", 2)]) \
        == {2: {"nccl": 1}, 4: {"gloo: fewer GPUs than ranks": 2}}
