"""dtlib.plots: every figure draws from plain data and shows the facts it is given."""

from __future__ import annotations

import math
from dataclasses import replace

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from dtlib import plots  # noqa: E402
from dtlib.bench.startup import LaunchTiming  # noqa: E402
from dtlib.measure import machine


def _texts(fig) -> str:
    return "\n".join(t.get_text() for ax in fig.axes for t in ax.texts + [ax.title])


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def test_machine_figure_shows_cores_gpus_and_backends():
    info = machine.machine_info()
    text = _texts(plots.machine(info))
    assert f"{info.usable_cpus} usable core" in text
    assert f"GPUs: {info.gpu_count}" in text
    for name in info.backends:
        assert name in text


def test_ranks_figure_has_one_box_per_rank_and_the_port():
    results = [{"rank": r, "local_rank": r, "pid": 1000 + r} for r in range(3)]
    text = _texts(plots.ranks(results, port=43210))
    assert "world_size = 3" in text and "127.0.0.1:43210" in text
    for r in range(3):
        assert f"rank {r}" in text and f"pid {1000 + r}" in text


def test_dp_vs_ddp_draws_both_sides():
    fig = plots.dp_vs_ddp(n_devices=2)
    assert len(fig.axes) == 2
    assert "rank 1" in _texts(fig) and "device 0" in _texts(fig)


def test_launch_times_labels_each_bar_with_its_median():
    timings = [LaunchTiming("forkserver", [0.04, 0.05, 0.06]), LaunchTiming("mp.spawn", [1.2, 1.3])]
    fig = plots.launch_times(timings)
    text = _texts(fig)
    assert "0.050 s  (0.04x mp.spawn)" in text and "1.250 s  (1.00x mp.spawn)" in text
    ax = fig.axes[0]
    assert ax.get_xscale() == "linear" and ax.get_xlim()[0] == 0  # a bar's length is its time
    assert [bar.get_width() for bar in ax.patches] == [0.05, 1.25]
    assert not any("floor" in label.get_text() for label in ax.get_yticklabels())  # mp.spawn is the slowest bar


def test_ring_step_draws_one_arrow_per_transfer_and_the_counts():
    from dtlib import ring

    trace = ring.simulate_all_reduce([[0] * 8] * 4)
    fig = plots.ring_step(trace, 2)
    left, right = fig.axes[:2]
    assert "step 2 of 6 (reduce-scatter)" in left.get_title()
    assert sum(p.__class__.__name__ == "FancyArrowPatch" for p in left.patches) == 4
    labels = [t.get_text() for t in left.texts]
    for t in trace.steps[1].transfers:
        assert f"c{t.chunk}\n{t.bytes} B" in labels
    shown = sorted(int(t.get_text()) for t in right.texts)
    assert shown == sorted(trace.steps[1].contributions.ravel().tolist())
    assert right.get_xlabel() == "chunk of the buffer"
    with pytest.raises(ValueError, match="between 0"):
        plots.ring_step(trace, 7)


def test_ring_grid_has_a_panel_per_step_and_traffic_a_line_per_algorithm():
    from dtlib import ring

    trace = ring.simulate_all_reduce([[0] * 8] * 4)
    fig = plots.ring_grid(trace)
    titled = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titled[0] == "0: start" and titled[-1] == "6: all-gather" and len(titled) == 7
    colorbar = fig.axes[-1]  # a colour reads back as a count, 0 to N
    assert "inputs summed" in colorbar.get_ylabel() and colorbar.get_ylim() == (0, 4)
    table = ring.traffic_table([2, 4, 8])
    ax = plots.traffic([2, 4, 8], table).axes[0]
    labels = [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")]
    assert [label.split(" (the same as")[0] for label in labels] == list(table)
    # Equal series are said to be equal, and the later one is drawn hollow and larger, so both show.
    assert labels[2] == "reduce + broadcast (the same as naive all-reduce)"
    assert labels[4] == "halving-doubling all-reduce (the same as ring all-reduce)"
    lines = ax.get_lines()
    assert lines[4].get_markerfacecolor() == "none" and lines[4].get_markersize() > lines[0].get_markersize()
    assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title()
    assert ax.get_xscale() == "log" and list(ax.get_xticks()) == [2, 4, 8]  # doubling world sizes, equal steps


def test_busbw_plot_shows_the_sweep_and_the_fit():
    from dtlib import ring
    from dtlib.bench.bandwidth import Row

    truth = ring.AlphaBeta(1e-4, 2e9)
    rows = []
    for size in (2**10, 2**14, 2**18, 2**22):
        seconds = truth.time("ring all-reduce", 2, size)
        rows.append(Row("allreduce", "library", 2, size, size // 4, "float32", seconds * 1e6,
                        size / seconds / 1e9, size / seconds / 1e9))
    ax = plots.busbw(rows, truth).axes[0]
    measured, fitted = ax.get_lines()
    assert list(measured.get_ydata()) == [r.busbw_gbs for r in rows]
    assert fitted.get_ydata()[-1] == pytest.approx(rows[-1].busbw_gbs)  # the model through its own data
    assert "alpha = 100 us, b = 2.00 GB/s" in fitted.get_label()
    assert "bytes" in ax.get_xlabel() and "GB/s" in ax.get_ylabel() and ax.get_title()
    by_ring = [Row("allreduce", "ring", 2, r.size_bytes, r.count, r.dtype, r.time_us * 2, r.algbw_gbs / 2,
                   r.busbw_gbs / 2) for r in rows]
    library, ring_line, _ = plots.busbw(rows, truth, compare=by_ring).axes[0].get_lines()
    assert library.get_label() == "dist.all_reduce, measured (2 ranks)"
    assert ring_line.get_label() == "dtlib's send/recv ring, measured (2 ranks)"
    assert list(ring_line.get_ydata()) == [r.busbw_gbs for r in by_ring]


def test_before_after_shows_every_value_on_every_rank_from_what_the_ranks_hold():
    """Values as live ranks return them: tensors, all_gather's list of tensors, and None where nothing arrived."""
    x = [torch.tensor([0.0, 1.0]), torch.tensor([10.0, 11.0])]
    gathered = [[torch.tensor([0.0, 1.0]), torch.tensor([10.0, 11.0])], None]  # dist.gather: only rank 0's list
    before, after = plots.before_after(x, gathered, "gather(x, dst=0)").axes
    assert sorted(t.get_text() for t in before.texts) == ["0", "1", "10", "11"]
    assert [t.get_text() for t in after.texts if t.get_text()] == ["0", "1", "10", "11", "nothing received"]
    assert after.get_title() == "after" and before.get_xlabel() == "position in the tensor"
    assert after.figure.get_suptitle() == "gather(x, dst=0)"
    with pytest.raises(ValueError, match="one value per rank"):
        plots.before_after(x, x[:1], "all_reduce")


def test_before_after_marks_what_a_collective_leaves_undefined():
    """A reduce's other ranks hold NaN under strict mode: drawn as undefined, never as a number or a blank."""
    nan = float("nan")
    x = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]), torch.tensor([5.0, 6.0])]
    summed = [torch.tensor([9.0, 12.0]), torch.tensor([nan, nan]), torch.tensor([7.0, nan])]
    _, after = plots.before_after(x, summed, "reduce(x, dst=0)").axes
    assert [t.get_text() for t in after.texts] == ["9", "12", "7", "undef.", "undefined: never read"]
    assert len(after.patches) == 3  # one grey cell per undefined number


def _strategy_rows():
    from dtlib.train.fsdp_compare import StrategyRow

    parts = {"parameters": 56128, "gradients": 56128, "optimizer_state": 112376}
    comm = {"all_gather": {"calls": 6, "bytes": 224512}, "reduce_scatter": {"calls": 3, "bytes": 112256}}
    return [StrategyRow("DDP", 2, 1, 449144, {"parameters": 112256, "gradients": 112256, "optimizer_state": 224632},
                        449144, 449024, {"all_reduce": {"calls": 1, "bytes": 112256}}, 9.0, 2.4, []),
            StrategyRow("FSDP2 no reshard after forward", 2, 2, 224632, parts, 336888, 336768, comm, 30.0, 2.4, []),
            StrategyRow("FSDP1 SHARD_GRAD_OP", 2, 2, 224632, parts, None, 336768, comm, 20.0, 2.4, [])]


def test_memory_bars_put_each_formula_in_a_bar_beside_the_measurement():
    rows = _strategy_rows()
    ax = plots.memory_bars(rows).axes[0]
    formula = next(c for c in ax.containers if c.get_label() == "formula at the peak")
    assert [bar.get_height() for bar in formula] == pytest.approx([r.estimate / 1e3 for r in rows])
    measured_x = {round(bar.get_x(), 6) for c in ax.containers if c.get_label().startswith("measured") for bar in c}
    assert not measured_x & {round(bar.get_x(), 6) for bar in formula}  # side by side, never on top
    tops = [sum(bar.get_height() for c in ax.containers if c.get_label().startswith("measured") for bar in c
                if abs(bar.get_x() + bar.get_width() / 2 - (i - 0.19)) < 1e-6) for i in range(len(rows))]
    assert tops == pytest.approx([(r.peak or r.at_rest) / 1e3 for r in rows])
    assert [t.get_text() for t in ax.texts] == ["peak not\nvisible\n(FSDP1)"]  # only where FSDP1 hides it
    assert ax.get_legend().get_bbox_to_anchor().x0 > ax.get_window_extent().x1 - 1  # outside the data


def test_comm_bars_draw_no_line_across_the_strategies():
    rows = _strategy_rows()
    sent = {"DDP": 112256.0, "FSDP2 no reshard after forward": 112256.0, "FSDP1 SHARD_GRAD_OP": 112256.0}
    ax = plots.comm_bars(rows, sent).axes[0]
    assert not ax.get_lines()
    ring = next(c for c in ax.containers if c.get_label().startswith("sent by one rank"))
    assert [bar.get_height() for bar in ring] == pytest.approx([sent[r.label] / 1e3 for r in rows])
    gathers = next(c for c in ax.containers if c.get_label() == "all-gather buffer S")
    assert [bar.get_height() for bar in gathers] == pytest.approx([0, 224.512, 224.512])
    assert len(plots.comm_bars(rows).axes[0].containers) == 3  # no ring bars unless given


def test_ddp_timeline_splits_each_all_reduce_where_the_last_rank_launched_it():
    from types import SimpleNamespace

    def rank(number, start, comm, origin):  # each rank counts from its own zero, origin_s on perf_counter
        return SimpleNamespace(rank=number, hidden_share=[0.0], timeline={
            "step": 1, "start_s": start, "compute_end_s": start + 0.010, "end_s": 0.1, "comm": comm,
            "origin_s": origin})

    early = rank(0, 0.000, [(0.010, 0.045, 2**20)], origin=100.0)  # launched at 10 ms, the other rank at 40 ms
    late = rank(1, 0.010, [(0.020, 0.025, 2**20)], origin=100.020)  # its own zero came 20 ms later
    ax = plots.ddp_timeline([early, late]).axes[0]
    def span(collection):  # a broken_barh's one bar: (x, width) in ms
        xs = collection.get_paths()[0].vertices[:, 0]
        return round(float(xs.min()), 6), round(float(xs.max() - xs.min()), 6)

    waits = [span(collection) for collection in ax.collections if collection.get_alpha() == 0.3]
    assert waits == [(10.0, 30.0)]  # rank 0 waited from 10 ms to 40 ms; rank 1 did not wait
    assert "other ranks not yet" in " ".join(text.get_text() for text in ax.get_legend().get_texts())
    alone = plots.ddp_timeline([early]).axes[0]  # one rank: nothing to wait for, no light bars, no legend entry
    assert all(collection.get_alpha() != 0.3 for collection in alone.collections)


def test_ddp_timeline_labels_every_bucket_and_buckets_launched_together_apart():
    from types import SimpleNamespace

    comm = [(0.004, 0.006, 2**20), (0.009, 0.011, 2**20), (0.0091, 0.0115, 31 * 2**10)]  # the last two at once
    result = SimpleNamespace(rank=0, hidden_share=[0.5], timeline={"step": 1, "start_s": 0.0, "compute_end_s": 0.010,
                                                                   "end_s": 0.012, "comm": comm})
    ax = plots.ddp_timeline([result]).axes[0]
    assert [text.get_text().strip() for text in ax.texts] == ["1.00", "1.00", "0.03"]  # MiB
    assert ax.texts[1].get_position()[1] != ax.texts[2].get_position()[1]
    assert "Step 1: 50% of communication hidden" in ax.get_title()


def test_placements_reads_placement_objects_and_their_long_and_short_names_and_refuses_others():
    from torch.distributed.tensor import Partial, Replicate, Shard

    from dtlib.plots.parallel import _placement

    for given, read in [(Shard(1), ("shard", 1)), ("Shard(dim=-1)", ("shard", -1)), ("S(0)", ("shard", 0)),
                        (Replicate(), ("replicate", 0)), ("R", ("replicate", 0)), (Partial(), ("partial", 0)),
                        ("P(sum)", ("partial", 0))]:
        assert _placement(given) == read
    for bad in ("X(1)", "Shard", "", "Shard(a)"):
        with pytest.raises(ValueError, match="not a DTensor placement"):
            _placement(bad)
    with pytest.raises(ValueError, match="1-D and 2-D"):
        plots.placements({"cube": ((2, 2, 2), Shard(0))}, 2)
    with pytest.raises(ValueError, match="at least one tensor"):
        plots.placements({}, 2)
    row_stripes = plots.placements({"w": ((8, 4), Shard(0))}, 2).axes[0].patches  # Shard(0): rows split
    assert [(p.get_y(), p.get_height()) for p in row_stripes] == [(0, 4), (4, 4)]
    column_stripes = plots.placements({"w": ((8, 4), "Shard(1)")}, 2).axes[0].patches
    assert [(p.get_x(), p.get_width()) for p in column_stripes] == [(0, 2), (2, 2)]


def test_memory_bars_mark_cudas_peak_only_where_the_ranks_ran_on_gpus():
    rows = _strategy_rows()
    assert not [line for line in plots.memory_bars(rows).axes[0].lines if "CUDA" in line.get_label()]
    rows[0] = replace(rows[0], cuda_memory={"allocated": 400_000, "peak": 900_000, "reserved": 2_097_152})
    ax = plots.memory_bars(rows).axes[0]
    (marker,) = [line for line in ax.lines if "CUDA" in line.get_label()]
    heights = marker.get_ydata()
    assert heights[0] == pytest.approx(900.0) and all(math.isnan(h) for h in heights[1:])
    assert ax.get_ylim()[1] >= 900.0  # the diamond is inside the axes


def test_ring_attention_blocks_count_what_notebook_12s_live_ring_counts():
    """The figure's arithmetic against the ring notebook 12 runs on 4 ranks and 64 tokens (8 per chunk): in
    order the busiest rank computes 256 scores at every step, zigzag 256 then 128; totals 256..1024 and 640."""
    from dtlib.plots.attention import chunks_of, step_scores

    busiest = {layout: [max(step_scores(4, layout, step, chunk=8)) for step in range(4)]
               for layout in ("in order", "zigzag")}
    assert busiest == {"in order": [256] * 4, "zigzag": [256, 128, 128, 128]}
    totals = [sum(step_scores(4, "in order", step, chunk=8)[rank] for step in range(4)) for rank in range(4)]
    assert totals == [256, 512, 768, 1024]
    assert chunks_of(0, 4, "zigzag") == (0, 7) and chunks_of(3, 4, "in order") == (6, 7)
    # every block on or below the diagonal is computed once over the p steps, none above it
    seen = [(q, k) for step in range(4) for rank in range(4) for q in chunks_of(rank, 4, "zigzag")
            for k in chunks_of((rank - step) % 4, 4, "zigzag") if k <= q]
    assert sorted(seen) == [(q, k) for q in range(8) for k in range(q + 1)]
    figure = plots.ring_attention_blocks(4)
    assert len(figure.axes) == 8 and figure.axes[5].get_title() == "zigzag, step 1\nbusiest rank: 2 blocks"
    with pytest.raises(ValueError, match="layout must be one of"):
        chunks_of(0, 4, "random")
    with pytest.raises(ValueError, match="world_size must be a whole number from 2 to 8"):
        plots.ring_attention_blocks(1)
