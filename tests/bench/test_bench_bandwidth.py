"""dtlib.bench's collective sweeps: nccl-tests' bandwidth arithmetic, the table, and the benchmark's
own overhead measured against a bare loop of dist.all_reduce."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dtlib import ring
from dtlib.bench import bandwidth


def test_sizes_read_like_nccl_tests():
    assert bandwidth.parse_size("1K") == 1024
    assert bandwidth.parse_size("64M") == 64 * 2**20
    assert bandwidth.parse_size("2g") == 2 * 2**30
    assert bandwidth.parse_size("4096") == 4096
    with pytest.raises(ValueError, match="cannot read the size '64 megabytes'"):
        bandwidth.parse_size("64 megabytes")


def test_sizes_double_and_split_evenly_over_ranks():
    assert bandwidth.sizes_between(1024, 8192, 2) == [1024, 2048, 4096, 8192]
    sizes = bandwidth.sizes_between(1000, 100_000, 3)
    assert all(size % (3 * 4) == 0 for size in sizes)
    assert sizes == sorted(set(sizes))
    with pytest.raises(ValueError, match="min_bytes <= max_bytes"):
        bandwidth.sizes_between(2048, 1024, 2)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_bus_factors_are_nccl_tests(n):
    # PERFORMANCE.md of nccl-tests: all-reduce 2(n-1)/n; all-gather, reduce-scatter (n-1)/n; broadcast 1.
    assert bandwidth.BUS_FACTOR["allreduce"](n) == pytest.approx(2 * (n - 1) / n)
    assert bandwidth.BUS_FACTOR["allgather"](n) == pytest.approx((n - 1) / n)
    assert bandwidth.BUS_FACTOR["reducescatter"](n) == pytest.approx((n - 1) / n)
    assert bandwidth.BUS_FACTOR["broadcast"](n) == 1.0
    # The same factor is the simulated ring's traffic per rank in units of S.
    trace = ring.simulate_all_reduce([[0.0] * (n * 10)] * n)
    assert trace.bytes_sent.max() / trace.buffer_bytes == pytest.approx(bandwidth.BUS_FACTOR["allreduce"](n))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("op", bandwidth.OPS)
def test_sweep_rows_hold_nccl_tests_arithmetic(op):
    rows = bandwidth.sweep(op, 2, "1K", "16K", iters=3, warmup=1, output="none")
    assert [r.size_bytes for r in rows] == [1024, 2048, 4096, 8192, 16384]
    for r in rows:
        assert r.count == r.size_bytes // 4 and r.dtype == "float32" and r.time_us > 0
        assert r.algbw_gbs == pytest.approx(r.size_bytes / (r.time_us / 1e6) / 1e9)
        assert r.busbw_gbs == pytest.approx(r.algbw_gbs * bandwidth.BUS_FACTOR[op](2))
    table = bandwidth.format_table(rows)
    assert "time(us)" in table and "busbw(GB/s)" in table and len(table.splitlines()) == 2 + len(rows)


@pytest.mark.timeout(120)
def test_command_line_prints_json_and_runs_the_ring():
    out = subprocess.run(
        [sys.executable, "-m", "dtlib.bench", "allreduce", "--world-size", "2", "--min-bytes", "4K",
         "--max-bytes", "8K", "--iters", "2", "--algo", "ring", "--json"],
        capture_output=True, text=True, timeout=100, check=True,
    ).stdout
    records = json.loads(out[out.index("["):])
    assert [(r["size_bytes"], r["algo"]) for r in records] == [(4096, "ring"), (8192, "ring")]


def test_bad_options_are_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="unknown operation 'alltoall'"):
        bandwidth.sweep("alltoall")
    with pytest.raises(ValueError, match="use it with allreduce"):
        bandwidth.sweep("broadcast", algo="ring")
    with pytest.raises(ValueError, match="iters >= 1"):
        bandwidth.sweep("allreduce", iters=0)


def _rows(algo: str, model: ring.AlphaBeta, sizes: list[int]) -> list[bandwidth.Row]:
    rows = []
    for size in sizes:
        seconds = model.time("ring all-reduce", 2, size)
        rows.append(bandwidth.Row("allreduce", algo, 2, size, size // 4, "float32", seconds * 1e6,
                                   size / seconds / 1e9, size / seconds / 1e9))
    return rows


def test_comparison_shows_the_largest_sizes_the_model_and_the_share():
    sizes = [2**k for k in range(10, 25)]
    link = ring.AlphaBeta(3e-4, 0.8e9)
    library, by_ring = _rows("library", link, sizes), _rows("ring", ring.AlphaBeta(3e-4, 0.4e9), sizes)
    lines = bandwidth.format_comparison(library, by_ring, link).splitlines()
    assert "library" in lines[1] and "ring/library" in lines[1] and len(lines) == 2 + 3
    size, mib, predicted, measured, ring_busbw, share = lines[-1].split()
    assert (size, mib) == ("16", "MiB")
    assert float(predicted) == pytest.approx(library[-1].busbw_gbs, abs=0.005)  # the model through its own data
    assert float(measured) == pytest.approx(library[-1].busbw_gbs, abs=0.005)
    assert float(share) == pytest.approx(by_ring[-1].busbw_gbs / library[-1].busbw_gbs, abs=0.005)
    without_model = bandwidth.format_comparison(library, by_ring).splitlines()
    assert "model" not in without_model[1] and without_model[-1].split() == [size, mib, measured, ring_busbw, share]
    with pytest.raises(ValueError, match="same sizes"):
        bandwidth.format_comparison(library, by_ring[:-1])


def test_fit_reads_back_a_model():
    truth = ring.AlphaBeta(3e-5, 2e9)
    rows = [bandwidth.Row("allgather", "library", 4, s, s // 4, "float32",
                           truth.time("ring all-gather", 4, s) * 1e6, 0.0, 0.0) for s in (2**12, 2**16, 2**20)]
    fitted = bandwidth.fit(rows)
    assert fitted.alpha_s == pytest.approx(3e-5) and fitted.bandwidth_bytes_per_s == pytest.approx(2e9)
