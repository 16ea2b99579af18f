"""dtlib.plots: every figure draws from plain data and shows the facts it is given."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from dtlib import plots, sysinfo  # noqa: E402
from dtlib.bench.launch import LaunchTiming  # noqa: E402


def _texts(fig) -> str:
    return "\n".join(t.get_text() for ax in fig.axes for t in ax.texts + [ax.title])


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def test_machine_figure_shows_cores_gpus_and_backends():
    info = sysinfo.machine_info()
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
    assert "0.050 s" in text and "1.250 s" in text


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
    table = ring.traffic_table([2, 4, 8])
    ax = plots.traffic([2, 4, 8], table).axes[0]
    assert [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")] == list(table)
    assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title()


def test_busbw_plot_shows_the_sweep_and_the_fit():
    from dtlib import ring
    from dtlib.bench.collective import Row

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


def test_collective_figure_shows_every_value_before_and_after():
    from dtlib.collectives import CollectiveResult

    result = CollectiveResult("gather", "gloo", [[0.0, 1.0], [10.0, 11.0]], [[0.0, 1.0, 10.0, 11.0], []])
    before, after = plots.collective(result).axes
    assert sorted(t.get_text() for t in before.texts) == ["0", "1", "10", "11"]
    assert [t.get_text() for t in after.texts if t.get_text()] == ["0", "1", "10", "11", "nothing received"]
    assert after.get_title() == "after gather (gloo)" and before.get_xlabel() == "position in the tensor"
