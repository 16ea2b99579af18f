"""dtlib.train.fsdp_compare: the strategies hold and send what the ZeRO arithmetic and the ring formulas say."""

from __future__ import annotations

import pytest

from dtlib.measure import memory
from dtlib.train import fsdp_compare, models
from dtlib.train.fsdp_compare import StrategyRow, bytes_sent_per_rank

S = 4 * sum(p.numel() for p in models.build("transformer").parameters())  # fp32 bytes of the whole model
STEPS = 3


# --- strategies side by side --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two():
    return {row.label: row for row in fsdp_compare.strategies(2, steps=STEPS)}


@pytest.fixture(scope="module")
def four():
    return {row.label: row for row in fsdp_compare.strategies(4, steps=STEPS)}


@pytest.fixture(params=[2, 4])
def rows(request):
    return request.getfixturevalue({2: "two", 4: "four"}[request.param])


@pytest.mark.timeout(180)
def test_strategies_run_the_settings_that_fit(two, four):
    hsdp = "FSDP2 HSDP (2 x 2 mesh)"
    assert list(two) == [label for label in fsdp_compare.SETTINGS if label != hsdp]  # 2 ranks: no 2 x 2 mesh
    assert list(four) == list(fsdp_compare.SETTINGS)
    for world_size, rows in ((2, two), (4, four)):
        for row in rows.values():
            assert row.world_size == world_size and row.step_ms > 0
        assert rows["DDP"].shard_group == 1 and rows["FSDP2 full shard"].shard_group == world_size
    assert four[hsdp].shard_group == 2


@pytest.mark.timeout(180)
def test_each_row_carries_its_runs_memory_and_ddp_holds_the_most(rows):
    """The table's plumbing. That the memory equals the ZeRO formulas and the losses equal DDP's is proven
    once, in tests/train/test_fsdp.py, on the same runner."""
    ddp = rows["DDP"]
    assert all(ddp.at_rest > row.at_rest for label, row in rows.items() if label != "DDP")
    assert ddp.estimate == 16 * S / 4  # the row's formula: 4 + 4 + 8 bytes per parameter, all replicated
    for row in rows.values():
        assert sum(row.at_rest_parts.values()) == row.at_rest and set(row.at_rest_parts) == {
            "parameters", "gradients", "optimizer_state"}
    assert ddp.at_rest_parts["parameters"] == ddp.at_rest_parts["gradients"] == S


@pytest.mark.timeout(180)
def test_peak_without_reshard_is_fsdps_formula(rows):
    """FSDP2 without resharding holds the gathered fp32 weights (S) beside its fp32 shards of weights and
    gradients and Adam's moments (4S/n): 4P + 16P/N, more than ZeRO-2's 4P + 12P/N in fp32."""
    n = rows["DDP"].world_size
    no_reshard = rows["FSDP2 no reshard after forward"]
    assert no_reshard.estimate == pytest.approx(S + 4 * S / n)
    zero2 = memory.estimate(S / 4, n, "zero2", param_bytes=4, grad_bytes=4, optim_bytes_per_param=8)
    assert no_reshard.estimate - zero2 == pytest.approx(S / n)  # 4P/N more: a shard beside the gathered copy
    assert 1 <= no_reshard.peak / no_reshard.estimate <= 1.05
    assert no_reshard.peak - no_reshard.at_rest == S  # the whole weights, gathered between forward and backward
    full = rows["FSDP2 full shard"]
    assert full.peak == full.at_rest and full.estimate == pytest.approx(4 * S / n)
    for label, row in rows.items():
        if row.peak is not None:
            assert 1 <= row.peak / row.estimate <= 1.05, label  # DDP, every FSDP2 setting, HSDP on 4 ranks
    for label, row in rows.items():
        assert (row.peak is None) == label.startswith("FSDP1"), label  # FSDP1's gathered weights are hidden


@pytest.mark.timeout(180)
def test_bytes_sent_per_rank_relative_to_ddp(two, four):
    # Ring traffic per rank, with S the fp32 model size. DDP all-reduces S over n ranks: 2(n-1)/n S.
    # FSDP all-gathers 2S (forward and backward) and reduce-scatters S over n ranks: 3(n-1)/n S, so 1.5x DDP
    # for any n. Without reshard it gathers once: 2(n-1)/n S, exactly DDP.
    for rows in (two, four):
        ddp = bytes_sent_per_rank(rows["DDP"])
        assert ddp == 2 * (rows["DDP"].world_size - 1) / rows["DDP"].world_size * S
        assert bytes_sent_per_rank(rows["FSDP2 full shard"]) / ddp == 1.5
        assert bytes_sent_per_rank(rows["FSDP2 no reshard after forward"]) / ddp == 1.0
    # HSDP on 4 ranks, shard groups of g=2, r=2 replicas: all-gather 2S and reduce-scatter S within the group,
    # (g-1)/g each: 1.5 S; then all-reduce of each S/2 shard over 2 replicas, 2(r-1)/r: S/2. Total 2S,
    # against DDP's 2 * 3/4 S = 1.5 S: 4/3.
    assert bytes_sent_per_rank(four["FSDP2 HSDP (2 x 2 mesh)"]) == 2 * S
    assert bytes_sent_per_rank(four["FSDP2 HSDP (2 x 2 mesh)"]) / bytes_sent_per_rank(four["DDP"]) == \
        pytest.approx(4 / 3, rel=1e-12)


def _made_up(world_size: int, shard_group: int, comm: dict[str, dict[str, int]]) -> StrategyRow:
    return StrategyRow("made up", world_size, shard_group, at_rest=1, at_rest_parts={}, peak=None, estimate=1.0,
                       comm=comm, step_ms=1.0, final_loss=0.0, notes=[])


def test_bytes_sent_per_rank_by_hand():
    # 8 ranks in shard groups of 4 (2 replicas): gather and reduce-scatter move 3/4 of their buffer,
    # the all-reduce over 2 replicas 2 * 1/2 of it.
    comm = {"all_gather": {"calls": 6, "bytes": 1000}, "reduce_scatter": {"calls": 3, "bytes": 400},
            "all_reduce": {"calls": 3, "bytes": 100}}
    assert bytes_sent_per_rank(_made_up(8, 4, comm)) == 750 + 300 + 100
    # DDP on 4 ranks: shard group 1, all-reduce over 4 replicas: 2 * 3/4.
    assert bytes_sent_per_rank(_made_up(4, 1, {"all_reduce": {"calls": 1, "bytes": 1000}})) == 1500
    # Full sharding on 5 ranks (one group, one replica): 4/5 of each buffer.
    assert bytes_sent_per_rank(_made_up(5, 5, {"all_gather": {"calls": 1, "bytes": 1000},
                                               "reduce_scatter": {"calls": 1, "bytes": 500}})) == 1200
    assert bytes_sent_per_rank(_made_up(1, 1, {"all_reduce": {"calls": 1, "bytes": 1000}})) == 0  # nobody to send to
    assert bytes_sent_per_rank(_made_up(4, 4, {})) == 0


def test_comparison_table_fits_a_notebook_and_quotes_the_rows(four):
    """Notebook 06's table: at most 110 characters a line (JupyterLab's output area at 1280 px), so it keeps its
    columns; the traffic row is bytes_sent_per_rank against DDP's, the memory row each strategy's bytes."""
    labels = ("DDP", "FSDP2 full shard", "FSDP2 no reshard after forward", "FSDP2 HSDP (2 x 2 mesh)")
    rows = [four[label] for label in labels]
    lines = fsdp_compare.comparison_table(rows)
    assert max(map(len, lines)) <= 110, "\n".join(lines)
    header = " ".join(line for line in lines if not line[0].strip()).split()  # wrapped strategy names
    assert all(word in header for label in labels for word in label.split())
    by_aspect = {line.split("  ")[0].strip(): line.split()[-len(rows):] for line in lines if line[0].strip()}
    ddp_sent = fsdp_compare.bytes_sent_per_rank(rows[0])
    assert by_aspect["traffic vs DDP"] == [f"{fsdp_compare.bytes_sent_per_rank(r) / ddp_sent:.2f}x" for r in rows]
    assert by_aspect["state per rank (kB)"] == [f"{r.at_rest / 1e3:.1f}" for r in rows]
