"""dtlib.bench ddp: each row's numbers in their columns, the speed-up over one rank, and the JSON records."""

from __future__ import annotations

import json

from dtlib.bench import ddp as bench_ddp

ROWS = [bench_ddp.Row("1 rank, whole global batch", 1, 2048, 40.0, 0, 0.0, 0.0, 0.5),
        bench_ddp.Row("torch DDP, buckets (default 25 MB)", 2, 1024, 25.0, 2, 3.05, 0.55, 0.5)]


def test_table_shows_each_setting_and_its_speed_up_over_one_rank():
    title, header, *lines = bench_ddp.format_table(ROWS).splitlines()
    assert title.startswith("# dtlib.bench ddp: torch ") and "step 0 skipped" in title
    assert header.startswith("# setting") and header.split()[-3:] == ["MiB/step", "hidden", "loss"]
    assert [line[2:48].strip() for line in lines] == [row.setting for row in ROWS]  # the setting column: 46 wide
    # ranks, batch/rank, step ms, speed-up (40 / 25), calls/step, MiB/step, hidden, loss
    assert lines[1][48:].split() == ["2", "1024", "25.00", "1.60x", "2", "3.05", "55%", "0.5000"]
    assert lines[0][48:].split()[3] == "1.00x"


def test_records_are_the_rows_fields():
    records = bench_ddp.as_records(ROWS)
    assert records[1] == {"setting": "torch DDP, buckets (default 25 MB)", "world_size": 2, "per_rank_batch": 1024,
                          "step_ms": 25.0, "allreduce_calls_per_step": 2, "allreduce_mb_per_step": 3.05,
                          "hidden_share": 0.55, "final_loss": 0.5}
    json.dumps(records)  # plain values only
