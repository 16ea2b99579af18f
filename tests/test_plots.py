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
