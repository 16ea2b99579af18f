"""dtlib.bench fsdp: the table shows each row's numbers in its columns; the JSON records carry the ring traffic."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

import dtlib.bench.fsdp
from dtlib.train import fsdp_compare, models
from dtlib.train.fsdp_compare import StrategyRow

S = 4 * sum(p.numel() for p in models.build("transformer").parameters())  # fp32 bytes of the whole model


def _row(label, at_rest, peak, estimate, comm, shard_group=2, step_ms=12.5):
    return StrategyRow(label, 2, shard_group, at_rest, {"parameters": at_rest, "gradients": 0, "optimizer_state": 0},
                       peak, estimate, comm, step_ms, 2.0, [])


ROWS = [
    _row("DDP", 4000, 4000, 4000.0, {"all_reduce": {"calls": 1, "bytes": 1000}}, shard_group=1),
    _row("FSDP2 full shard", 2010, 2010, 2000.0, {"all_gather": {"calls": 6, "bytes": 2000},
                                                  "reduce_scatter": {"calls": 3, "bytes": 1000}}),
    _row("FSDP1 FULL_SHARD", 2004, None, 2000.0, {"all_gather": {"calls": 5, "bytes": 1900},
                                                  "reduce_scatter": {"calls": 3, "bytes": 1000}}),
]


def _cells(line: str) -> tuple[str, list[str]]:
    """A data line's label (the first 31 characters after the indent) and the columns after it."""
    return line[2:33].strip(), line[33:].split()


def test_format_table_has_a_header_and_one_line_per_row():
    lines = dtlib.bench.fsdp.format_table(ROWS).splitlines()
    assert lines[0].startswith("# dtlib.bench fsdp:") and "world_size=2" in lines[0]
    assert lines[1].startswith("# setting") and lines[1].split()[-2:] == ["step", "ms"]
    assert len(lines) == 2 + len(ROWS)
    cells = dict(_cells(line) for line in lines[2:])
    assert list(cells) == [row.label for row in ROWS]
    # at rest, peak, formula, meas/f, AG calls, AG bytes, RS bytes, AR bytes, sent/rank, vs DDP, step ms
    assert cells["DDP"] == ["4000", "4000", "4000", "1.000", "0", "0", "0", "1000", "1000", "1.00x", "12.50"]
    assert cells["FSDP2 full shard"] == ["2010", "2010", "2000", "1.005", "6", "2000", "1000", "0", "1500",
                                         "1.50x", "12.50"]
    assert cells["FSDP1 FULL_SHARD"][:4] == ["2004", "-", "2000", "-"]  # FSDP1 hides its gathered weights
    assert cells["FSDP1 FULL_SHARD"][8:10] == ["1450", "1.45x"]  # (1900 + 1000) / 2 sent, against DDP's 1000


def test_gpu_ranks_add_cudas_peak_as_a_last_column():
    rows = [replace(ROWS[0], cuda_memory={"allocated": 4100, "peak": 9000, "reserved": 16384}), ROWS[1]]
    lines = dtlib.bench.fsdp.format_table(rows).splitlines()
    assert lines[1].split()[-2:] == ["CUDA", "peak"]
    assert [_cells(line)[1][-1] for line in lines[2:]] == ["9000", "-"]  # a row without the allocator says "-"
    assert "CUDA" not in dtlib.bench.fsdp.format_table(ROWS)  # CPU ranks: no such column


def test_records_carry_the_bytes_sent_per_rank():
    records = dtlib.bench.fsdp.as_records(ROWS)
    assert [record["label"] for record in records] == [row.label for row in ROWS]
    assert [record["bytes_sent_per_rank"] for record in records] == [1000, 1500, 1450]
    assert records[2]["peak"] is None and records[1]["comm"] == ROWS[1].comm
    json.dumps(records)  # plain values only


@pytest.mark.timeout(150)
def test_command_line_prints_json_records():
    completed = subprocess.run([sys.executable, "-m", "dtlib.bench", "fsdp", "--world-size", "2", "--steps", "3",
                                "--json"], capture_output=True, text=True, timeout=140)
    assert completed.returncode == 0, completed.stderr
    records = json.loads(completed.stdout)
    assert [record["label"] for record in records] == [label for label in fsdp_compare.SETTINGS if "HSDP" not in label]
    by_label = {record["label"]: record for record in records}
    for record in records:
        row = StrategyRow(**{key: value for key, value in record.items() if key != "bytes_sent_per_rank"})
        assert record["bytes_sent_per_rank"] == fsdp_compare.bytes_sent_per_rank(row)
        assert record["world_size"] == 2 and (record["peak"] is None) == record["label"].startswith("FSDP1")
        assert record["final_loss"] == pytest.approx(by_label["DDP"]["final_loss"], abs=1e-5)
    # DDP: a ring all-reduce of S over 2 ranks sends S; full shard gathers 2S and reduce-scatters S, half of each.
    assert by_label["DDP"]["bytes_sent_per_rank"] == S
    assert by_label["FSDP2 full shard"]["bytes_sent_per_rank"] == 1.5 * S
    assert by_label["FSDP2 no reshard after forward"]["bytes_sent_per_rank"] == S


@pytest.mark.parametrize("world_size", [3, 5, 0])
def test_measure_refuses_a_world_size_that_does_not_divide_the_batch(monkeypatch, world_size):
    def no_processes(*args, **kwargs):
        raise AssertionError("measure started ranks for a world size it should refuse")

    monkeypatch.setattr(fsdp_compare, "strategies", no_processes)
    batch = dtlib.bench.fsdp.GLOBAL_BATCH
    with pytest.raises(ValueError, match=rf"^world_size={world_size} cannot split the comparison's global batch of "
                                         rf"{batch} samples evenly: use 1, 2, 4, 8 or 16 ranks$"):
        dtlib.bench.fsdp.measure(world_size)
