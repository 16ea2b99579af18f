"""dtlib.train.fsdp_compare by hand: the ring's share of each collective. Its rows of real jobs are tested in
tests/train/test_fsdp.py, built from the jobs that file runs anyway."""

from __future__ import annotations

from dtlib.train.fsdp_compare import StrategyRow, bytes_sent_per_rank


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
