"""dtlib.bench ddp: each row's numbers in their columns, the speed-up over one rank, and the JSON records."""

from __future__ import annotations

import json

from dtlib.bench import ddp

ROWS = [ddp.Row("1 rank, whole global batch", 1, 2048, 40.0, 0, 0.0, 0.0, 0.5),
        ddp.Row("torch DDP, buckets (default 25 MB)", 2, 1024, 25.0, 2, 3.05, 0.55, 0.5)]


def test_table_shows_each_setting_and_its_speed_up_over_one_rank():
    title, header, *lines = ddp.format_table(ROWS).splitlines()
    assert title.startswith("# dtlib.bench ddp: torch ") and "step 0 skipped" in title
    assert header.startswith("# setting") and header.split()[-3:] == ["MiB/step", "hidden", "loss"]
    assert [line[2:48].strip() for line in lines] == [row.setting for row in ROWS]  # the setting column: 46 wide
    # ranks, batch/rank, step ms, speed-up (40 / 25), calls/step, MiB/step, hidden, loss
    assert lines[1][48:].split() == ["2", "1024", "25.00", "1.60x", "2", "3.05", "55%", "0.5000"]
    assert lines[0][48:].split()[3] == "1.00x"


def test_records_are_the_rows_fields():
    records = ddp.as_records(ROWS)
    assert records[1] == {"setting": "torch DDP, buckets (default 25 MB)", "world_size": 2, "per_rank_batch": 1024,
                          "step_ms": 25.0, "allreduce_calls_per_step": 2, "allreduce_mb_per_step": 3.05,
                          "hidden_share": 0.55, "final_loss": 0.5}
    json.dumps(records)  # plain values only


def test_the_one_rank_baseline_runs_on_the_backend_of_the_ranks_it_is_compared_with(monkeypatch):
    """One GPU, two ranks: the ranks fall back to gloo on the CPU, and so must the baseline (left to ``auto``,
    one rank would get NCCL and the GPU). No process starts: ``ddp.run`` is replaced by a recorder."""
    from dtlib.launch import spawn

    monkeypatch.delenv(spawn.BACKEND_OVERRIDE, raising=False)
    monkeypatch.setattr(spawn.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(spawn.dist, "is_nccl_available", lambda: True)
    assert (spawn.resolve_backend("auto", 1), spawn.resolve_backend("auto", 2)) == ("nccl", "gloo")
    backends = []

    def recorded_run(config, world_size, **spawn_options):
        backends.append((world_size, spawn_options.get("backend", "auto")))
        return [ddp.ddp.RankResult(rank, world_size, "gloo", 0, losses=[0.5] * 3, step_times_s=[0.1] * 3,
                                         comm_calls=[1] * 3, comm_bytes=[8] * 3, hidden_share=[0.5] * 3)
                for rank in range(world_size)]

    monkeypatch.setattr(ddp.ddp, "run", recorded_run)
    ddp.measure(world_size=2, steps=3)
    assert backends == [(1, "gloo")] + [(2, "gloo")] * 3
